"""The creation policy both front ends share (volumes/creation.py), row by row.

Each front end words a refusal its own way (tests/unit/test_controller.py,
test_device_class_servicers.py and the test_dhv*.py tables pin the words and codes);
here, the rules themselves: which difference refuses a repeated create, in
which order, and how small a new volume or a copy's limit may be."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import pytest

from csi_local.errors import Difference, SizeOutOfRange, VolumeDiffers
from csi_local.host.crypt import HEADER_BYTES
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume, VgReport
from csi_local.volumes.creation import check_copy_limit, check_repeat, smallest_size
from csi_local.volumes.device_classes import parse_classes
from csi_local.volumes.pool import Pools
from tests.unit.conftest import FakeRunner

MiB, GiB = 1 << 20, 1 << 30
ENC = "x.encryption=luks2"  # a front end's encryption tag
CLASSES = parse_classes("""\
default = "fast"

[classes.fast]
volume_group = "vg0"
thin_pool = "fast"

[classes.big]
volume_group = "vg1"
thin_pool = "big"
""", source="classes.toml")


def pools() -> Pools:
    return Pools(CLASSES, FakeRunner(), Locks(tempfile.mkdtemp()))


def lv(vg: str = "vg0", pool: str = "fast", tags: tuple[str, ...] = (), size: int = 0,
       name: str = "v") -> LogicalVolume:
    return LogicalVolume(name=name, vg=vg, size=size, tags=frozenset(tags), attr="Vwi-a-tz--",
                         pool=pool, origin="", path=f"/dev/{vg}/{name}", data_percent=None,
                         metadata_percent=None, created=0, health="", kernel_major=-1,
                         kernel_minor=-1)


IN_FAST, IN_BIG, IN_NONE = lv(), lv("vg1", "big"), lv("vg1", "other")
ENCRYPTED = lv(tags=(ENC,))


def repeat(volume: LogicalVolume, *, ours: bool = True, device_class: str | None = None,
           same_source: bool = True, encrypted: bool | None = None) -> str:
    """The class a repeated create meets `volume` in, else the difference."""
    try:
        return check_repeat(pools(), volume, ours=ours, device_class=device_class,
                            same_source=same_source, encrypted=encrypted,
                            encrypted_tag=ENC).class_name
    except VolumeDiffers as err:
        return err.difference


@pytest.mark.parametrize("volume,kw,want", [
    # Met again: each field as asked, or not asked.
    pytest.param(IN_FAST, {}, "fast", id="nothing-asked"),
    pytest.param(IN_BIG, {}, "big", id="any-class-where-it-is"),
    pytest.param(IN_BIG, {"device_class": "big"}, "big", id="its-class"),
    pytest.param(ENCRYPTED, {"encrypted": True}, "fast", id="encrypted-as-asked"),
    pytest.param(IN_FAST, {"encrypted": False}, "fast", id="plain-as-asked"),
    pytest.param(ENCRYPTED, {"encrypted": None}, "fast", id="encryption-not-asked"),
    # Refused, each for what differs.
    pytest.param(IN_FAST, {"ours": False}, Difference.NOT_OURS, id="not-ours"),
    pytest.param(IN_NONE, {}, Difference.NO_CLASS, id="in-no-class"),
    pytest.param(IN_BIG, {"device_class": "fast"}, Difference.CLASS, id="other-class"),
    pytest.param(IN_FAST, {"same_source": False}, Difference.SOURCE, id="other-source"),
    pytest.param(IN_FAST, {"encrypted": True}, Difference.ENCRYPTION, id="not-encrypted"),
    pytest.param(ENCRYPTED, {"encrypted": False}, Difference.ENCRYPTION, id="encrypted"),
    # The first difference is the one told.
    pytest.param(IN_NONE, {"ours": False, "device_class": "big"}, Difference.NOT_OURS,
                 id="not-ours-before-no-class"),
    pytest.param(IN_NONE, {"device_class": "big"}, Difference.NO_CLASS,
                 id="no-class-before-class"),
    pytest.param(IN_BIG, {"device_class": "fast", "same_source": False}, Difference.CLASS,
                 id="class-before-source"),
    pytest.param(ENCRYPTED, {"same_source": False, "encrypted": False}, Difference.SOURCE,
                 id="source-before-encryption"),
])
def test_a_repeated_create(volume: LogicalVolume, kw: dict[str, Any], want: str) -> None:
    assert repeat(volume, **kw) == want


def report(chunk: int) -> VgReport:
    """vg0's report, its pool `fast` of `chunk`-byte chunks (0: not reported)."""
    pool_lv = dataclasses.replace(lv(name="fast", pool=""), attr="twi-a-tz--", chunk_size=chunk)
    return VgReport(lvs=(pool_lv,), extent_size=4 * MiB)


@pytest.mark.parametrize("fs_minimum,encrypted,chunk,want", [
    pytest.param(300 * MiB, False, 64 * 1024, 300 * MiB, id="plain-is-its-fs"),
    pytest.param(0, False, 0, 0, id="plain-no-minimum"),
    # The LUKS2 header (16 MiB) first, aligned to 1 MiB or to a chunk that does
    # not divide it.
    pytest.param(300 * MiB, True, 64 * 1024, 300 * MiB + HEADER_BYTES, id="encrypted-1mib"),
    pytest.param(4 * MiB, True, 0, 4 * MiB + HEADER_BYTES, id="encrypted-chunk-unknown"),
    pytest.param(4 * MiB, True, 192 * 1024, 4 * MiB + HEADER_BYTES + 128 * 1024,
                 id="encrypted-192k-chunks"),
    pytest.param(4 * MiB, True, 32 * MiB, 4 * MiB + 32 * MiB, id="encrypted-32m-chunks"),
])
def test_smallest_size(fs_minimum: int, encrypted: bool, chunk: int, want: int) -> None:
    pool = pools().select("fast")
    assert smallest_size(pool, report(chunk), fs_minimum, encrypted) == want


@pytest.mark.parametrize("limit,refused", [
    pytest.param(0, False, id="no-limit"),
    pytest.param(GiB, False, id="limit-is-its-size"),
    pytest.param(2 * GiB, False, id="limit-above"),
    pytest.param(GiB - 1, True, id="limit-below"),
])
def test_a_copy_is_at_least_its_source(limit: int, refused: bool) -> None:
    source = lv(size=GiB)
    if not refused:
        check_copy_limit(source, limit, "limit_bytes")
        return
    with pytest.raises(SizeOutOfRange, match=f"limit_bytes {limit} is smaller than the "
                                              f"source's {GiB} bytes"):
        check_copy_limit(source, limit, "limit_bytes")
