"""Sizes: the one parser of "512M"-style sizes and the one piece of arithmetic
that turns a requested range into a volume size, for the CSI plugin (its
capacity_range) and the host volume plugin (capacity_min/capacity_max)
alike. No processes and no heavy imports: configuration parsing and the
conformance suite use it too.
"""

from __future__ import annotations

import math
import re

from csi_local.errors import SizeOutOfRange, UnsupportedFilesystem
from csi_local.host import filesystem_rules as fsrules

_SIZE_RE = re.compile(r"(\d+)\s*([KMGT]i?B?|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: str | int) -> int:
    """Bytes from 4096, "4096", "512M", "1G", "1GiB" or "1t" (binary units);
    ValueError for anything else (negative, fractional, unknown unit, bool)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}")
        return value
    m = _SIZE_RE.fullmatch(str(value).strip())
    if not m:
        raise ValueError(
            f"invalid size {value!r}: use bytes with an optional K/M/G/T suffix")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()[:1]]


def round_up(size: int, unit: int) -> int:
    """`size` rounded up to a whole number (at least one) of `unit`s."""
    return max(1, math.ceil(size / unit)) * unit


def size_for(required: int, limit: int, extent: int, *, default: int,
             minimum: int = 0) -> int:
    """The size of a new volume: `required` rounded up to whole extents; with
    none, `default` (capped by `limit`); never below `minimum` (a file
    system's smallest, a source's size). 0 means "not set" for `required`
    and `limit`. SizeOutOfRange when no size fits."""
    if limit and required > limit:
        raise SizeOutOfRange(f"the required {required} bytes exceed the limit of {limit}")
    if required:
        size = round_up(max(required, minimum), extent)
    elif limit:
        size = max(min(default, limit // extent * extent), round_up(minimum, extent))
    else:
        size = round_up(max(default, minimum), extent)
    if limit and size > limit:
        raise SizeOutOfRange(
            f"no size in the range [{required}, {limit}] bytes: sizes are whole extents of "
            f"{extent} bytes" + (f" and at least {minimum} bytes" if minimum else "")
        )
    return size


def in_range(size: int, required: int, limit: int) -> bool:
    """Whether `size` meets the range; 0 means "not set" for `required` and
    `limit`."""
    return not (required and size < required) and not (limit and size > limit)


def grow_target(current: int, required: int, limit: int, extent: int) -> int:
    """The size an existing volume of `current` bytes must have: `current` when
    it already meets the range, larger when `required` grew. Shrinking is
    refused (SizeOutOfRange), as is a range no whole extent fits."""
    if limit and limit < current:
        raise SizeOutOfRange(
            f"the volume is {current} bytes and the limit is {limit}: shrinking a volume "
            "is not supported"
        )
    if required <= current:
        return current
    size = round_up(required, extent)
    if limit and size > limit:
        raise SizeOutOfRange(
            f"cannot grow to {required} bytes within the limit of {limit}: sizes are whole "
            f"extents of {extent} bytes"
        )
    return size


def minimum_size(fs_types: tuple[str, ...], default_fs: str) -> int:
    """The smallest volume that every file system of `fs_types` can be made on
    ("" is `default_fs`, the class's default); 0 when none asks for more.
    UnsupportedFilesystem when one cannot be made on this node."""
    smallest = 0
    for asked in fs_types:
        fs_type = asked or default_fs
        problem = fsrules.filesystem_problem(fs_type)
        if problem is not None:
            raise UnsupportedFilesystem(problem)
        smallest = max(smallest, fsrules.min_size(fs_type))
    return smallest
