"""A volume's IO limits (docs/qos.md): the parameters that set them, their
values, and the LVM tags that keep them.

Four limits, each cgroup v2's `io.max` key of the same meaning: read and
write bytes per second (`rbps`, `wbps`), read and write operations per
second (`riops`, `wiops`). A limit not set is no limit. They are set at
CreateVolume (a StorageClass's `parameters`, a VolumeAttributesClass's
`mutable_parameters`, a Nomad volume's `parameters`, or the device class's
default), and changed by ControllerModifyVolume. The LV's tags are the
record, as for everything else about a volume: the node reads them from the
committed metadata (no process) at every publish and on every reconcile,
and writes them into the workload's `io.max` (volumes/qos_enforcement.py).

No transport types and no processes here; a value a request cannot have is a
ValueError naming the parameter, which each front end words in its own way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from csi_local.storage.lvm import LogicalVolume, check_tag

# io.max's keys, in the order the kernel prints them.
KEYS = ("rbps", "wbps", "riops", "wiops")
# The CSI parameters (StorageClass, VolumeAttributesClass, a Nomad CSI
# volume): camelCase, as `deviceClass` is.
CSI_PARAMETERS = {"readBps": "rbps", "writeBps": "wbps",
                  "readIops": "riops", "writeIops": "wiops"}
# The host volume plugin's parameters and the classes file's [classes.X.qos]
# keys: snake_case, as `device_class` and the file's other keys are.
FILE_KEYS = {"read_bps": "rbps", "write_bps": "wbps",
             "read_iops": "riops", "write_iops": "wiops"}
# What lifts a limit (ControllerModifyVolume; a class default overridden).
UNLIMITED = "max"
# The kernel keeps limits in 64 bits, and `max` is its all-ones value.
_MOST = (1 << 64) - 2
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_VALUE_RE = re.compile(r"([0-9]{1,20})(k|M|G|T|Ki|Mi|Gi|Ti)?")
_BYTES_KEYS = ("rbps", "wbps")
# The CSI plugin's tags: one per limit set, its value in bytes or operations
# per second (docs/on-disk-format.md). The host volume plugin's are its own
# namespace's (volumes/host_volume_names.py).
TAG_PREFIX = "csi-local.qos."


@dataclass(frozen=True)
class Limits:
    """A volume's IO limits; None: no limit of that kind."""

    rbps: int | None = None
    wbps: int | None = None
    riops: int | None = None
    wiops: int | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, k) is not None for k in KEYS)

    def items(self) -> list[tuple[str, int | None]]:
        return [(k, getattr(self, k)) for k in KEYS]

    def io_max(self) -> str:
        """The four keys as `io.max` takes and prints them after MAJ:MIN."""
        return " ".join(f"{k}={UNLIMITED if v is None else v}" for k, v in self.items())

    def describe(self) -> str:
        """For people (status, logs): the limits set, or "none"."""
        return ", ".join(f"{k}={v}" for k, v in self.items() if v is not None) or "none"

    def merged(self, changes: Mapping[str, int | None]) -> Limits:
        """These limits with `changes` (io.max keys) applied; a None lifts one."""
        return replace(self, **dict(changes))


NO_LIMITS = Limits()
assert tuple(f.name for f in fields(Limits)) == KEYS  # one order everywhere


def parse_value(name: str, key: str, value: str) -> int | None:
    """One limit's value: a whole number above 0 (bytes per second may carry
    a suffix: k, M, G, T in powers of 1000, Ki, Mi, Gi, Ti of 1024), or
    `max` (or empty) for none. ValueError naming the parameter `name`."""
    text = value.strip()
    if text in ("", UNLIMITED):
        return None
    match = _VALUE_RE.fullmatch(text)
    if match is None or (match.group(2) and key not in _BYTES_KEYS):
        unit = ("a whole number of bytes per second, with an optional suffix k, M, G, T, "
                "Ki, Mi, Gi or Ti" if key in _BYTES_KEYS
                else "a whole number of operations per second")
        raise ValueError(f"parameter {name!r} must be {unit}, or {UNLIMITED!r} for no "
                         f"limit; not {value!r}")
    number = int(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    if number < 1 or number > _MOST:
        raise ValueError(f"parameter {name!r} must be at least 1 and at most {_MOST} "
                         f"({UNLIMITED!r} for no limit); not {value!r}")
    return number


def changes_from(parameters: Mapping[str, str],
                 names: Mapping[str, str] = CSI_PARAMETERS) -> dict[str, int | None]:
    """{io.max key: value or None} of the limits `parameters` name (others
    are not looked at); ValueError naming the first bad one."""
    return {key: parse_value(name, key, parameters[name])
            for name, key in names.items() if name in parameters}


def tags_of(limits: Limits, prefix: str = TAG_PREFIX) -> list[str]:
    """The tags recording `limits`: one per limit set."""
    return [check_tag(f"{prefix}{k}={v}") for k, v in limits.items() if v is not None]


def limits_of(lv: LogicalVolume, prefix: str = TAG_PREFIX) -> Limits:
    """The limits an LV's tags record; a malformed tag counts as no limit (it
    was not written by this module)."""
    values: dict[str, int | None] = {}
    for key in KEYS:
        raw = lv.tag_value(prefix + key)
        values[key] = int(raw) if raw and raw.isdigit() and 0 < int(raw) <= _MOST else None
    return Limits(**values)


def tag_changes(lv: LogicalVolume, limits: Limits,
                prefix: str = TAG_PREFIX) -> tuple[list[str], list[str]]:
    """(tags to add, tags to delete) that make `lv` record `limits` and
    nothing else of its kind: one lvchange, so that a reader of the committed
    metadata sees the old limits or the new, never a mix."""
    have = {t for t in lv.tags if t.startswith(prefix)}
    want = set(tags_of(limits, prefix))
    return sorted(want - have), sorted(have - want)
