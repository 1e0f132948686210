"""The committed-metadata reader, on what LVM 2.03 really wrote (a PV's label
sector, metadata-area header and text, captured in the test VM), and on
images made from it with one thing broken at a time."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import struct
import threading
from collections.abc import Collection
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from csi_local.errors import DeviceMapperMissing, DmReplyMalformed
from csi_local.host.device_mapper import DmDevice, PoolUsage, Target
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.storage import committed_vg
from csi_local.storage import vg_text as lm
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import LogicalVolume, VolumeGroup
from csi_local.volumes.device_classes import DeviceClass, DeviceClasses
from csi_local.volumes.pool import Pool, Pools
from tests.unit.conftest import FakeRunner

DATA = Path(__file__).parent / "data"
CAPTURE = json.loads((DATA / "lvm-metadata.json").read_text())
HEAD = base64.b64decode(CAPTURE["head_b64"])  # sectors 0-8: the label, then the mda header
TEXT = CAPTURE["text"].encode()
MDA = 4096  # where this PV's metadata area starts (its label says so)
HOST = Kernel()  # the PV images are files, read as the plugin reads a PV


def area() -> tuple[int, int, int, int, int]:
    """(area start, area size, text offset, text size, text crc) from the header."""
    start, size = struct.unpack_from("<QQ", HEAD, MDA + 24)
    offset, length, crc, _flags = struct.unpack_from("<QQII", HEAD, MDA + 40)
    return start, size, offset, length, crc


def image(tmp_path: Path, head: bytes = HEAD, text: bytes = TEXT,
          at: int | None = None) -> str:
    """A PV image: `head` at 0 and `text` where the header says (or at `at`)."""
    start, _, offset, _, _ = area()
    buf = bytearray(1 << 20)
    buf[:len(head)] = head
    where = start + offset if at is None else at
    buf[where:where + len(text)] = text
    path = tmp_path / "pv.img"
    path.write_bytes(bytes(buf))
    return str(path)


def test_the_host_reads_exactly_the_bytes_asked_for(tmp_path: Path) -> None:
    """Kernel.read_device, as the reader asks it: any offset and length (the
    direct read is aligned inside it), fewer bytes at the end, OSError for
    what is not there."""
    data = bytes(range(256)) * 64  # 16 KiB
    path = tmp_path / "dev.img"
    path.write_bytes(data)
    for offset, length in ((0, 2048), (4096, 512), (513, 7000), (16000, 384)):
        assert HOST.read_device(str(path), offset, length) == data[offset:offset + length]
    assert HOST.read_device(str(path), 16000, 1000) == data[16000:]
    assert HOST.read_device(str(path), 20000, 10) == b""
    with pytest.raises(FileNotFoundError):
        HOST.read_device(str(tmp_path / "nothing"), 0, 512)


def test_lvm_crc_is_lvms_own() -> None:
    # The text's checksum as LVM wrote it in the header.
    assert lm.lvm_crc(TEXT) == area()[4]
    assert lm.lvm_crc(b"") == lm.INITIAL_CRC


def test_reads_what_lvm_wrote_and_agrees_with_lvs(tmp_path: Path) -> None:
    found = lm.read_committed(HOST, image(tmp_path))
    assert found.text == TEXT
    meta = lm.vg_metadata(found.text)
    assert meta.name == "vg-cap" and meta.extent_size == 4 << 20
    assert found.pv_uuid in meta.pv_uuids  # the label's PV is one of the VG's
    # `lvs -a` of the same VG at the same moment, in bytes.
    rows = json.loads(CAPTURE["lvs"])["report"][0]["lv"]
    assert len(rows) == len(meta.lvs)
    for row in rows:
        lv = meta.lvs[row["lv_name"].strip("[]")]  # lvs brackets hidden LVs
        created = datetime.strptime(row["lv_time"], "%Y-%m-%d %H:%M:%S %z").timestamp()
        assert (lv.size, lv.uuid, lv.created) == (int(row["lv_size"]), row["lv_uuid"],
                                                  created), row
        assert lv.tags == {t for t in row["lv_tags"].split(",") if t}, row
        assert (lv.pool, lv.origin) == (row["pool_lv"], row["origin"]), row
        assert lv.device_id == int(row["thin_id"] or -1), row
    assert meta.lvs["csi-s-snap"].activation_skip and meta.lvs["csi-s-snap"].origin
    assert meta.lvs["po-ol"].segment_type == "thin-pool"
    # The pool's chunk size (its segment's chunk_size, in sectors), as
    # `lvs -o chunk_size` reports it; 0 for the others.
    assert meta.lvs["po-ol"].chunk_size == 64 << 10 and meta.lvs["csi-v-abc"].chunk_size == 0
    assert not meta.lvs["po-ol_tdata"].visible and meta.lvs["csi-v-abc"].visible


def _with(buf: bytes, offset: int, data: bytes) -> bytes:
    out = bytearray(buf)
    out[offset:offset + len(data)] = data
    return bytes(out)


def _resealed_header(head: bytes) -> bytes:
    """`head` with its metadata-area header's checksum made right again."""
    crc = lm.lvm_crc(head[MDA + 4:MDA + 512])
    return _with(head, MDA, struct.pack("<I", crc))


@pytest.mark.parametrize(("name", "head", "text", "why"), [
    ("no-label", bytes(len(HEAD)), TEXT, "no LVM2 label"),
    ("label-damaged", _with(HEAD, 512 + 40, b"\xff"), TEXT, "label checksum"),
    ("header-damaged", _with(HEAD, MDA + 100, b"\x01"), TEXT, "header .* is damaged"),
    ("text-changed", HEAD, TEXT.replace(b"seqno = ", b"seqno = 9"), "checksum mismatch"),
    ("text-only-ignored", _resealed_header(_with(HEAD, MDA + 60, struct.pack("<I", 1))), TEXT,
     "no metadata area holds"),
    ("text-out-of-its-area",
     _resealed_header(_with(HEAD, MDA + 40, struct.pack("<Q", 1 << 40))), TEXT,
     "out of its area"),
])
def test_anything_broken_is_unreadable_never_guessed(tmp_path: Path, name: str, head: bytes,
                                                     text: bytes, why: str) -> None:
    with pytest.raises(lm.MetadataUnreadable, match=why):
        lm.read_committed(HOST, image(tmp_path, head, text))


def test_text_that_wraps_round_the_area_is_read_whole(tmp_path: Path) -> None:
    """LVM's metadata area is a ring: a new version that does not fit before
    its end goes on at the start, just after the header."""
    start, size, _, length, crc = area()
    offset = size - 1000  # the last 1000 bytes of the area, then the rest at its start
    head = _resealed_header(_with(HEAD, MDA + 40, struct.pack("<QQII", offset, length, crc, 0)))
    buf = bytearray(Path(image(tmp_path, head, b"", at=0)).read_bytes())
    buf[start + offset:start + size] = TEXT[:1000]
    buf[start + 512:start + 512 + length - 1000] = TEXT[1000:]
    (tmp_path / "pv.img").write_bytes(bytes(buf))
    assert lm.read_committed(HOST, str(tmp_path / "pv.img")).text == TEXT


@pytest.mark.parametrize(("text", "want"), [
    (b'a { b = "x\\"y\\\\z" }', {"a": {"b": 'x"y\\z'}}),
    (b"a {\n# a comment { not a section\nn = -3\nf = 1.5\nl = [\"p\", 7, ]\n}\n",
     {"a": {"n": -3, "f": 1.5, "l": ["p", 7]}}),
    (b'v { lv-1+x.y { s1 { type = "thin" } } }\0\0\0',
     {"v": {"lv-1+x.y": {"s1": {"type": "thin"}}}}),
])
def test_parse_text(text: bytes, want: dict[str, Any]) -> None:
    assert lm.parse_text(text) == want


@pytest.mark.parametrize("text", [b"a { b = 1", b"a { = 1 }", b"a { b c }", b'a { b = "x }',
                                  b"a { b = word }"])
def test_parse_text_refuses_what_lvm_does_not_write(text: bytes) -> None:
    with pytest.raises(lm.MetadataUnreadable):
        lm.parse_text(text)


# vg_metadata: each LV's section parsed once, and again only when it changes.

def _counting_parse(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    parsed: list[bytes] = []
    real = lm.parse_text

    def spy(text: bytes) -> dict[str, Any]:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(lm, "parse_text", spy)
    return parsed


def test_the_sections_say_what_the_whole_text_says() -> None:
    tree = lm.parse_text(TEXT)["vg-cap"]
    assert isinstance(tree, dict) and isinstance(tree["logical_volumes"], dict)
    whole = {name: lm._meta_lv("vg-cap", name, lv, 4 << 20)
             for name, lv in tree["logical_volumes"].items() if isinstance(lv, dict)}
    meta = lm.vg_metadata(TEXT)
    assert meta.lvs == whole and len(whole) == 7
    assert (meta.uuid, meta.seqno) == (tree["id"], tree["seqno"])


def test_the_lvm2_that_wrote_the_text_and_its_host() -> None:
    """From the comment lvm2 heads its settings with and creation_host, as a
    real lvm2 wrote them (doctor compares that lvm2 with its own)."""
    meta = lm.vg_metadata(TEXT)
    assert (meta.written_by, meta.creation_host) == ("2.03.16(2) (2022-05-18)", "virtme-ng")
    # An LV's creation_host is its own, never the VG's; no comment, no version.
    bare = TEXT.replace(b"# Generated by LVM2", b"# Written by LVM2").replace(
        b'\ncreation_host = "virtme-ng"\t', b"\n")
    meta = lm.vg_metadata(bare)
    assert (meta.written_by, meta.creation_host) == ("", "")


def test_a_new_version_parses_only_the_sections_that_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first = lm.vg_metadata(TEXT)
    # What an lvchange --addtag writes: one LV's section differs, and the seqno.
    changed = TEXT.replace(b'tags = ["csi-local.kind=snapshot"]',
                           b'tags = ["csi-local.kind=snapshot", "x"]').replace(
        b"seqno = 10", b"seqno = 11")
    parsed = _counting_parse(monkeypatch)
    again = lm.vg_metadata(changed, first)
    assert len(parsed) == 2  # the VG without its LVs, and the one LV that changed
    assert parsed[1].startswith(b"csi-s-snap {") and b"csi-v-abc {" not in parsed[1]
    assert again.seqno == 11 and again.lvs["csi-s-snap"].tags == {"csi-local.kind=snapshot",
                                                                  "x"}
    assert again == lm.vg_metadata(changed)  # the same answer as a parse from scratch
    # Another VG's metadata (here: another extent size) reuses nothing.
    parsed.clear()
    lm.vg_metadata(TEXT.replace(b"extent_size = 8192", b"extent_size = 16384"), first)
    assert len(parsed) == 8


def test_only_the_named_lvs_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the plugin's start reads (its pools, its staged volumes): just their
    sections parsed, each saying what the whole parse says; a thin pool comes
    with its metadata LV (`lvs` shows that LV's size as the pool's)."""
    whole = lm.vg_metadata(TEXT)
    parsed = _counting_parse(monkeypatch)
    part = lm.vg_metadata(TEXT, only={"po-ol", "csi-v-abc", "csi-v-nope"})
    assert sorted(part.lvs) == ["csi-v-abc", "po-ol", "po-ol_tmeta"]
    assert all(part.lvs[name] == whole.lvs[name] for name in part.lvs)
    assert len(parsed) == 4  # the VG without its LVs, and those three sections
    assert not any(b"csi-s-snap {" in text or b"1+odd.name_x {" in text for text in parsed)
    assert dataclasses.replace(part, lvs=whole.lvs) == whole  # the VG itself, whole
    # A layout LVM does not write is refused as by a whole parse.
    twice = b"v { logical_volumes { a { segment_count = 1 segment1 { type = \"thin\" } }\n" \
        b"a { } } extent_size = 1 }"
    with pytest.raises(lm.MetadataUnreadable, match="names LV a twice"):
        lm.vg_metadata(twice, only={"b"})


@pytest.mark.parametrize(("text", "why"), [
    (b"v { logical_volumes { a { } x = 1 } }", "settings among the LVs"),
    (b"v { logical_volumes { x = 1 a { } } }", "settings among the LVs"),
    (b"v { logical_volumes { } logical_volumes { } }", "two logical_volumes"),
    (b"v { logical_volumes { a { segment_count = 1 segment1 { type = \"thin\" } }\n"
     b"a { } } extent_size = 1 }", "names LV a twice"),
    (b"v { } }", "with no section"),
    (b"v { logical_volumes { a {", "ends early"),
    (b'v { extent_size = 1 logical_volumes { a { t = "x } } }', "never closed"),
])
def test_a_layout_lvm_does_not_write_is_unreadable(text: bytes, why: str) -> None:
    with pytest.raises(lm.MetadataUnreadable, match=why):
        lm.vg_metadata(text)


def test_an_lv_nested_deeper_than_lvm_writes_today_is_still_read() -> None:
    # LV sections are matched whole in one step; one with sections two levels
    # deep is walked brace by brace, and those after it are matched whole again.
    def lv(name: str, extents: int, inner: bytes = b"") -> bytes:
        return (b"%s {\nsegment_count = 1\nsegment1 {\nextent_count = %d\ntype = \"thin\"\n"
                b"%s}\n}\n" % (name.encode(), extents, inner))
    text = (b"v {\nextent_size = 8\nlogical_volumes {\n" + lv("a", 1)
            + lv("b", 2, b"settings {\nx = 1\n}\n") + lv("c", 3) + b"}\n}\n")
    meta = lm.vg_metadata(text)
    assert {n: m.size for n, m in meta.lvs.items()} == {"a": 4096, "b": 8192, "c": 12288}
    assert set(meta.sections) == {lv("a", 1).rstrip(), lv("b", 2, b"settings {\nx = 1\n}\n")
                                  .rstrip(), lv("c", 3).rstrip()}


def test_braces_in_strings_and_comments_are_not_sections() -> None:
    text = (b'v { extent_size = 8 # a } and a {\n'
            b'logical_volumes { a { tags = ["}", "{"] segment_count = 1\n'
            b'segment1 { extent_count = 2 type = "thin" } } } }\n'
            b'description = "lvcreate --config \'devices { a } }\'"\n')
    meta = lm.vg_metadata(text)
    assert meta.lvs["a"].tags == {"}", "{"} and meta.lvs["a"].size == 2 * 8 * 512


# CommittedMetadata: the PVs from `pvs`, the LV's kernel state from device-mapper.

def _pvs(rows: list[tuple[str, str, str]]) -> str:
    return json.dumps({"report": [{"pv": [
        {"pv_name": p, "vg_name": v, "pv_uuid": u} for p, v, u in rows]}]})


def pool_status(usage: PoolUsage) -> str:
    """A thin-pool target's status text saying `usage`, as the kernel prints it."""
    mode = "out_of_data_space" if usage.out_of_data_space else "ro" if usage.read_only else "rw"
    held = "-" if usage.metadata_snapshot_root is None else str(usage.metadata_snapshot_root)
    return (f"{usage.transaction_id} {usage.metadata_used}/{usage.metadata_total} "
            f"{usage.data_used}/{usage.data_total} {held} {mode} discard_passdown "
            f"queue_if_no_space {'needs_check' if usage.needs_check else '-'} 768")


class KernelStub(Kernel):
    """The real Kernel's reads of the PV images (files), and a device-mapper of
    the test's making: its devices, and the status of its thin pools (by
    their device's name), which the plugin's own parser reads."""

    def __init__(self) -> None:
        self.devices: dict[str, tuple[int, int]] = {}
        self.info: dict[str, DmDevice] = {}
        self.pools: dict[str, PoolUsage | str] = {}  # a status text as it is
        self.reads: list[tuple[str, int, int]] = []

    def read_device(self, path: str, offset: int, length: int) -> bytes:
        self.reads.append((path, offset, length))
        return super().read_device(path, offset, length)

    def dm_device(self, name: str) -> DmDevice | None:
        return self.info.get(name)

    def dm_devices(self) -> dict[str, tuple[int, int]]:
        return dict(self.devices)

    def dm_status(self, name: str) -> list[Target] | None:
        usage = self.pools.get(name)
        if usage is None:
            return None
        text = usage if isinstance(usage, str) else pool_status(usage)
        return [Target(0, 1 << 19, "thin-pool", text)]


POOL_DEVICE = "vg--cap-po--ol"  # vg-cap/po-ol's thin-pool target, not stacked
POOL_USAGE = PoolUsage(transaction_id=3, metadata_used=10, metadata_total=1024,
                       data_used=1000, data_total=4096, read_only=False,
                       out_of_data_space=False, needs_check=False)


@pytest.fixture
def kernel() -> KernelStub:
    return KernelStub()


@pytest.fixture
def pv(tmp_path: Path, kernel: KernelStub) -> str:
    kernel.info["vg--cap-csi--v--abc"] = DmDevice(253, 7, 1, True, False)
    return image(tmp_path)


def _uuid(path: str) -> str:
    return lm.read_committed(HOST, path).pv_uuid


def test_thin_volume_from_metadata_and_kernel(runner: FakeRunner, kernel: KernelStub,
                                              pv: str) -> None:
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    reader = CommittedMetadata(runner, kernel)
    lv = reader.thin_volume("vg-cap", "csi-v-abc")
    assert lv is not None
    assert (lv.vg, lv.pool, lv.size, lv.path) == ("vg-cap", "po-ol", 64 << 20,
                                                 "/dev/vg-cap/csi-v-abc")
    assert lv.tags == {"csi-local.kind=volume", "csi-local.size=67108864"}
    assert lv.is_thin_volume and lv.active and lv.open
    assert (lv.kernel_major, lv.kernel_minor, lv.thin_id) == (253, 7, 1)
    snap = reader.thin_volume("vg-cap", "csi-s-snap")  # no device: inactive
    assert snap is not None and not snap.active and snap.activation_skip
    assert snap.kernel_major == -1 and snap.origin == "csi-v-abc"
    # Not a thin volume, or not there at all: LVM has the last word.
    assert reader.thin_volume("vg-cap", "po-ol") is None
    assert reader.thin_volume("vg-cap", "csi-v-nope") is None
    assert len(runner.calls) == 1  # one `pvs`, kept


@pytest.mark.parametrize(("rows", "vg"), [
    pytest.param([], "vg-cap", id="vg-has-no-pv-known"),
    pytest.param([("@pv", "vg-cap", "other-uuid")], "vg-cap", id="another-pv-at-that-node"),
    pytest.param([("@pv", "vg-x", "@uuid")], "vg-x", id="metadata-of-another-vg"),
    pytest.param([("/nonexistent/pv", "vg-cap", "@uuid")], "vg-cap", id="pv-gone"),
])
def test_no_certain_answer_is_none(runner: FakeRunner, kernel: KernelStub, pv: str,
                                   rows: list[tuple[str, str, str]], vg: str) -> None:
    fill = {"@pv": pv, "@uuid": _uuid(pv)}
    runner.on(["pvs"], _pvs([tuple(fill.get(x, x) for x in row)  # type: ignore[misc]
                             for row in rows]))
    reader = CommittedMetadata(runner, kernel)
    assert reader.volume_group(vg) is None
    assert reader.thin_volume(vg, "csi-v-abc") is None


def test_pvs_read_again_only_when_no_pv_answers(runner: FakeRunner, kernel: KernelStub,
                                                pv: str) -> None:
    runner.on(["pvs"], _pvs([(pv + ".old", "vg-cap", _uuid(pv))]))
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))  # the PV's node changed
    reader = CommittedMetadata(runner, kernel)
    # Within REFRESH of the last `pvs`, no other: the caller asks `lvs` instead.
    assert reader.volume_group("vg-cap") is None
    assert len(runner.calls) == 1
    reader.REFRESH = 0.0  # as if REFRESH seconds went by
    assert reader.volume_group("vg-cap") is not None  # found at the second reading
    assert len(runner.calls) == 2
    assert reader.volume_group("vg-cap") is not None  # and kept: no third
    assert len(runner.calls) == 2



def test_report_from_metadata_and_the_pools_status(runner: FakeRunner, kernel: KernelStub,
                                                   pv: str) -> None:
    """What CreateVolume and GetCapacity need, as `lvs` would say it: every LV's
    size and pool, the pool's size, usage and metadata size."""
    kernel.pools[POOL_DEVICE] = POOL_USAGE
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    report = CommittedMetadata(runner, kernel).report("vg-cap", "po-ol")
    assert report is not None and report.extent_size == 4 << 20
    pool = report.find("po-ol")
    assert pool is not None and pool.is_thin_pool and pool.active
    assert (pool.size, pool.metadata_size) == (256 << 20, 4 << 20)
    assert (pool.data_percent, pool.metadata_percent) == (24.41, 0.98)
    thin = sorted(lv.name for lv in report.lvs if lv.is_thin_volume and lv.pool == "po-ol")
    assert thin == ["1+odd.name_x", "csi-s-snap", "csi-v-abc"]
    vol = report.find("csi-v-abc")
    assert vol is not None and vol.size == 64 << 20 and vol.tags == {
        "csi-local.kind=volume", "csi-local.size=67108864"}
    assert vol.kernel_major == -1 and vol.data_percent is None  # no kernel state read



def test_the_vgs_size_and_free_space_from_its_pvs_and_lvs(runner: FakeRunner, kernel: KernelStub,
                                                          pv: str) -> None:
    """What `vgs` says of the VG: its PVs' extents, less those its LVs map on
    them. Thin volumes and the thin pool map other LVs; the pool's hidden
    data and metadata LVs and the spare take the extents."""
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    space = CommittedMetadata(runner, kernel).space("vg-cap")
    rows = json.loads(CAPTURE["lvs"])["report"][0]["lv"]
    on_pvs = sum(int(r["lv_size"]) for r in rows if r["lv_name"].startswith("["))
    assert on_pvs == (256 + 4 + 4) << 20  # the lvs of the capture: tdata, tmeta, spare
    assert space == VolumeGroup("vg-cap", 255 * (4 << 20), 255 * (4 << 20) - on_pvs, 4 << 20)
    assert CommittedMetadata(runner, kernel).space("vg-nope") is None


@pytest.mark.parametrize(("out_of_data", "read_only", "attr", "health"), [
    (False, False, "twi-a-tz--", ""),
    (True, False, "twi-a-tzD-", "out_of_data"),
    (False, True, "twi-a-tzM-", "metadata_read_only"),
])
def test_the_pools_health_as_lvs_says_it(runner: FakeRunner, kernel: KernelStub, pv: str,
                                         out_of_data: bool, read_only: bool, attr: str,
                                         health: str) -> None:
    kernel.pools[POOL_DEVICE] = PoolUsage(
        transaction_id=3, metadata_used=10, metadata_total=1024,
        data_used=4096 if out_of_data else 10, data_total=4096, read_only=read_only,
        out_of_data_space=out_of_data, needs_check=False)
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    report = CommittedMetadata(runner, kernel).report("vg-cap", "po-ol")
    assert report is not None
    pool = report.find("po-ol")
    assert pool is not None and (pool.attr, pool.health) == (attr, health)
    vol = report.find("csi-v-abc")
    assert vol is not None and vol.health == ""


def test_out_of_data_space_is_named_before_read_only() -> None:
    """lvs names the first of the two (a status says one mode: this is the
    rule's order, not a state the kernel reports)."""
    both = dataclasses.replace(POOL_USAGE, read_only=True, out_of_data_space=True)
    assert committed_vg._pool_health(both) == ("D", "out_of_data")


def test_listing_from_metadata_the_device_list_and_the_pools_status(
        runner: FakeRunner, kernel: KernelStub, pv: str) -> None:
    """What ListVolumes and the state's recovery read: every visible LV, each
    active one (a device-mapper device) with its numbers, the pool with its
    usage; from one `pvs` in the reader's life and no other process."""
    kernel.devices.update({
        "vg--cap-csi--v--abc": (254, 5), "vg--cap-po--ol": (254, 3),
        "vg--cap-po--ol-tpool": (254, 2), "other-vg-lv": (254, 9)})
    kernel.pools[f"{POOL_DEVICE}-tpool"] = POOL_USAGE  # stacked: the target is there
    kernel.pools[POOL_DEVICE] = "0 1 linear"  # the linear layer over it, never asked
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    lvs = {lv.name: lv for lv in CommittedMetadata(runner, kernel).listing(["vg-cap"]) or []}
    assert sorted(lvs) == ["1+odd.name_x", "csi-s-snap", "csi-v-abc", "po-ol"]  # as `lvs VG`
    vol = lvs["csi-v-abc"]
    assert vol.active and (vol.kernel_major, vol.kernel_minor) == (254, 5)
    assert vol.tags == {"csi-local.kind=volume", "csi-local.size=67108864"}
    assert not lvs["csi-s-snap"].active and lvs["csi-s-snap"].kernel_major == -1
    assert lvs["csi-s-snap"].activation_skip and lvs["csi-s-snap"].origin == "csi-v-abc"
    pool = lvs["po-ol"]
    # A stacked pool's device is its -tpool layer, as lvs says.
    assert pool.is_thin_pool and pool.active and (pool.kernel_major, pool.kernel_minor) == (
        254, 2)
    assert (pool.data_percent, pool.metadata_percent, pool.health) == (24.41, 0.98, "")
    assert len(runner.calls) == 1


def test_a_listing_builds_again_only_the_lvs_that_changed(
        runner: FakeRunner, kernel: KernelStub, pv: str) -> None:
    """A listing takes again the LV objects the last one built from the same
    metadata, device and usage (ListVolumes then reuses their entries); an LV
    whose device or pool usage changed is built anew, as a fresh reader
    builds it. Listings and reports keep theirs apart."""
    devices = kernel.devices
    devices.update({"vg--cap-csi--v--abc": (254, 5), "vg--cap-po--ol-tpool": (254, 2)})
    kernel.pools[POOL_DEVICE] = POOL_USAGE
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    reader = CommittedMetadata(runner, kernel)

    def listed(r: CommittedMetadata) -> dict[str, LogicalVolume]:
        return {lv.name: lv for lv in r.listing(["vg-cap"]) or []}

    first = listed(reader)
    report = reader.report("vg-cap", "po-ol")
    again = listed(reader)
    assert again == first and all(again[k] is first[k] for k in first)
    assert report is not None and reader.report("vg-cap", "po-ol") == report
    del devices["vg--cap-csi--v--abc"]  # deactivated
    devices["vg--cap-csi--s--snap"] = (254, 7)  # activated
    kernel.pools[POOL_DEVICE] = dataclasses.replace(POOL_USAGE, data_used=4096,
                                                    out_of_data_space=True)
    now = listed(reader)
    assert now == listed(CommittedMetadata(runner, kernel))  # as a fresh reader builds them
    assert not now["csi-v-abc"].active and now["csi-s-snap"].kernel_minor == 7
    assert now["po-ol"].health == "out_of_data"
    assert now["1+odd.name_x"] is first["1+odd.name_x"]  # nothing of it changed


@pytest.mark.parametrize("broken", ["devices", "pool_usage", "metadata"])
def test_listing_is_none_when_anything_does_not_answer(
        runner: FakeRunner, kernel: KernelStub, pv: str, monkeypatch: pytest.MonkeyPatch,
        broken: str) -> None:
    def no_device_mapper() -> dict[str, tuple[int, int]]:
        raise DeviceMapperMissing(2, "No such file or directory")

    if broken == "devices":
        monkeypatch.setattr(kernel, "dm_devices", no_device_mapper)
    kernel.pools[POOL_DEVICE] = "Fail" if broken == "pool_usage" else POOL_USAGE
    runner.on(["pvs"], _pvs([] if broken == "metadata" else [(pv, "vg-cap", _uuid(pv))]))
    reader = CommittedMetadata(runner, kernel)
    assert reader.listing(["vg-cap"]) is None
    assert reader.thin_pools([("vg-cap", "po-ol")]) is None or broken == "devices"


def test_thin_pools_as_probe_asks(runner: FakeRunner, kernel: KernelStub, pv: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "dm_devices", lambda: pytest.fail("Probe needs no device list"))
    kernel.pools[POOL_DEVICE] = POOL_USAGE
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    got = CommittedMetadata(runner, kernel).thin_pools([
        ("vg-cap", "po-ol"), ("vg-cap", "nopool"), ("vg-cap", "csi-v-abc")])
    assert got is not None
    pool, missing, thin = got[("vg-cap", "po-ol")], got[("vg-cap", "nopool")], \
        got[("vg-cap", "csi-v-abc")]
    assert pool is not None and pool.is_thin_pool and pool.active
    assert missing is None
    assert thin is not None and not thin.is_thin_pool  # Probe says "not a thin pool"


def test_thin_pools_parse_only_the_pools_and_keep_no_partial_view(
        runner: FakeRunner, kernel: KernelStub, pv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe's and the start's read of the pools parses their sections alone, and
    answers as a reader that parsed the whole text; the whole parse is left to
    the first listing, which sees every LV."""
    kernel.pools[POOL_DEVICE] = POOL_USAGE
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    whole = CommittedMetadata(runner, kernel)
    assert whole.volume_group("vg-cap") is not None  # its whole parse kept
    want = whole.thin_pools([("vg-cap", "po-ol")])
    parsed = _counting_parse(monkeypatch)
    reader = CommittedMetadata(runner, kernel)
    got = reader.thin_pools([("vg-cap", "po-ol")])
    assert got == want and got is not None
    pool = got[("vg-cap", "po-ol")]
    assert pool is not None and pool.metadata_size == 4 << 20
    assert len(parsed) == 3  # the VG without its LVs, the pool, its metadata LV
    listed = reader.listing(["vg-cap"])
    assert listed is not None and sorted(lv.name for lv in listed) == [
        "1+odd.name_x", "csi-s-snap", "csi-v-abc", "po-ol"]


def test_the_warm_up_and_a_listing_beside_it_parse_the_text_once(
        runner: FakeRunner, kernel: KernelStub, pv: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin warms the listing's read after its start (Pools.warm): a
    ListVolumes that comes while that parse runs waits for it and takes it,
    and the text is parsed whole once, never twice, never half kept."""
    kernel.pools[POOL_DEVICE] = POOL_USAGE
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    reader = CommittedMetadata(runner, kernel)
    pools = Pools(DeviceClasses((DeviceClass("default", "vg-cap", "po-ol"),), "default"),
                  runner, Locks(str(tmp_path / "locks")), committed=reader)
    whole: list[bytes] = []
    parsing, release = threading.Event(), threading.Event()
    real = lm.vg_metadata

    def slow_parse(text: bytes, previous: lm.VgMetadata | None = None,
                   only: Collection[str] | None = None) -> lm.VgMetadata:
        if only is None:
            whole.append(text)
            parsing.set()
            assert release.wait(10)  # the warm-up's parse, held until the listing waits
        return real(text, previous, only)

    monkeypatch.setattr(lm, "vg_metadata", slow_parse)
    warm = threading.Thread(target=pools.warm)
    warm.start()
    assert parsing.wait(10)
    listed: list[tuple[list[tuple[Pool | None, LogicalVolume]], list[str]]] = []
    listing = threading.Thread(target=lambda: listed.append(pools.listing()))
    listing.start()
    listing.join(0.5)
    assert listing.is_alive()  # waiting for the warm-up's parse, not parsing its own
    release.set()
    warm.join(10)
    listing.join(10)
    assert not warm.is_alive() and not listing.is_alive()
    assert len(whole) == 1
    (lvs, missing), = listed
    assert missing == [] and sorted(lv.name for _, lv in lvs) == [
        "1+odd.name_x", "csi-s-snap", "csi-v-abc", "po-ol"]
    assert runner.calls == [tuple(runner.calls[0])] and runner.calls[0][0] == "pvs"  # no lvs
    # Kept: the next listing parses nothing.
    assert pools.listing()[0] and len(whole) == 1


def test_the_warm_up_without_a_reader_or_an_answer_does_nothing(
        runner: FakeRunner, kernel: KernelStub, tmp_path: Path) -> None:
    """No reader: nothing read. A VG that does not answer: the listing finds
    out (and asks lvs) when it comes; the warm-up raises nothing."""
    classes = DeviceClasses((DeviceClass("default", "vg-cap", "po-ol"),), "default")
    Pools(classes, runner, Locks(str(tmp_path / "locks"))).warm()
    assert runner.calls == []
    runner.on(["pvs"], _pvs([]))
    Pools(classes, runner, Locks(str(tmp_path / "locks")),
          committed=CommittedMetadata(runner, kernel)).warm()
    assert {call[0] for call in runner.calls} == {"pvs"}


def test_report_is_none_when_the_pools_status_cannot_be_trusted(
        runner: FakeRunner, kernel: KernelStub, pv: str) -> None:
    kernel.pools[POOL_DEVICE] = "Fail"  # a failed pool's status
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    assert CommittedMetadata(runner, kernel).report("vg-cap", "po-ol") is None


def test_a_kernel_reply_that_does_not_hold_together_is_no_answer(
        runner: FakeRunner, kernel: KernelStub, pv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any storage error from device-mapper sends the caller to `lvs`, as the
    pool status does in report(), instead of failing the RPC."""
    def malformed(name: str) -> DmDevice:
        raise DmReplyMalformed("target 0 at byte 9999 is outside the reply")

    monkeypatch.setattr(kernel, "dm_device", malformed)
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    assert CommittedMetadata(runner, kernel).thin_volume("vg-cap", "csi-v-abc") is None


def test_thin_volume_uses_the_metadata_it_is_given(runner: FakeRunner, kernel: KernelStub,
                                                   pv: str) -> None:
    """find_committed reads each VG once; the LV it found is not read again."""
    runner.on(["pvs"], _pvs([(pv, "vg-cap", _uuid(pv))]))
    reader = CommittedMetadata(runner, kernel)
    meta = reader.volume_group("vg-cap")
    assert kernel.reads  # the label, the area's header, the text
    kernel.reads.clear()
    lv = reader.thin_volume("vg-cap", "csi-v-abc", meta)
    assert lv is not None and lv.active and kernel.reads == []
    assert reader.thin_volume("vg-cap", "csi-v-abc") == lv and kernel.reads  # read again


# Many PVs, many copies: the highest seqno is the VG's, and any disagreement
# among its PVs is no certain answer (issue 30, defect 2).

UUID_A = "SE9X3R-UzHd-Fwaw-g6Gb-3BIl-WU9F-IQF0cw"  # the captured PV's
UUID_B = "Bbbbbb-bbbb-bbbb-bbbb-bbbb-bbbb-bbbbbb"


def _pv(tmp_path: Path, name: str, uuid: str, text: bytes) -> str:
    """A PV image of the captured layout with PV ID `uuid` and `text` committed."""
    head = bytearray(HEAD)
    at = next(n * 512 for n in range(4) if head[n * 512:n * 512 + 8] == lm.LABEL_ID)
    (offset,) = struct.unpack_from("<I", head, at + 20)
    head[at + offset:at + offset + 32] = uuid.replace("-", "").encode()
    head[at + 16:at + 20] = struct.pack("<I", lm.lvm_crc(bytes(head[at + 20:at + 512])))
    start, _, text_offset, _, _ = area()
    header = _with(bytes(head), MDA + 40,
                   struct.pack("<QQII", text_offset, len(text), lm.lvm_crc(text), 0))
    buf = bytearray(1 << 20)
    buf[:len(header)] = _resealed_header(header)
    buf[start + text_offset:start + text_offset + len(text)] = text
    path = tmp_path / name
    path.write_bytes(bytes(buf))
    return str(path)


def _seqno(text: bytes, n: int) -> bytes:
    return re.sub(rb"seqno = \d+", b"seqno = %d" % n, text, count=1)


def test_an_outdated_copy_on_a_pv_no_longer_listed_is_never_believed(
        runner: FakeRunner, kernel: KernelStub, tmp_path: Path) -> None:
    """PV A was away while the VG was reduced to PV B and changed: A still
    holds the old copy, which lists A. The plugin saw both PVs before."""
    newest = _seqno(TEXT, 11).replace(UUID_A.encode(), UUID_B.encode())
    newest = newest.replace(b"csi-v-abc", b"csi-v-new")
    a = _pv(tmp_path, "a.img", UUID_A, TEXT)
    b = _pv(tmp_path, "b.img", UUID_B, newest)
    runner.on(["pvs"], _pvs([(a, "vg-cap", UUID_A), (b, "vg-cap", UUID_B)]))
    reader = CommittedMetadata(runner, kernel)
    assert reader.volume_group("vg-cap") is None  # lvs answers (and warns)
    (problem,) = reader.problems("vg-cap")
    assert a in problem and "outdated" in problem and "seqno 10" in problem
    # Gone again (or wiped by vgck --updatemetadata): B's copy answers.
    Path(a).unlink()
    meta = reader.volume_group("vg-cap")
    assert meta is not None and meta.seqno == 11 and "csi-v-new" in meta.lvs
    assert reader.problems("vg-cap") == ()


def test_the_highest_seqno_wins_and_an_outdated_listed_pv_is_a_problem(
        runner: FakeRunner, kernel: KernelStub, tmp_path: Path) -> None:
    a = _pv(tmp_path, "a.img", UUID_A, TEXT)
    b = _pv(tmp_path, "b.img", UUID_B, _seqno(TEXT, 12))  # lists A only: B is none of it
    runner.on(["pvs"], _pvs([(b, "vg-cap", UUID_B), (a, "vg-cap", UUID_A)]))
    reader = CommittedMetadata(runner, kernel)
    assert reader.volume_group("vg-cap") is None
    (problem,) = reader.problems("vg-cap")
    assert problem.startswith(f"PV {a} has outdated metadata") and "newest 12" in problem


def test_copies_of_one_seqno_that_differ_are_no_answer(runner: FakeRunner, kernel: KernelStub,
                                                       tmp_path: Path) -> None:
    other = TEXT.replace(b"csi-v-abc", b"csi-v-xyz")
    a = _pv(tmp_path, "a.img", UUID_A, TEXT)
    b = _pv(tmp_path, "b.img", UUID_B, other)
    runner.on(["pvs"], _pvs([(a, "vg-cap", UUID_A), (b, "vg-cap", UUID_B)]))
    reader = CommittedMetadata(runner, kernel)
    assert reader.volume_group("vg-cap") is None
    assert reader.problems("vg-cap") == ("VG vg-cap: copies of metadata seqno 10 differ",)


def test_a_listed_pv_missing_is_no_answer(runner: FakeRunner, kernel: KernelStub,
                                          tmp_path: Path) -> None:
    a = str(tmp_path / "a.img")
    runner.on(["pvs"], _pvs([(a, "vg-cap", UUID_A), ("[unknown]", "vg-cap", UUID_B)]))
    # The newest copy lists B too, which is nowhere to be read.
    listing_b = TEXT.replace(b"physical_volumes {\n",
                             b'physical_volumes {\n\npv9 {\nid = "%s"\n}\n' % UUID_B.encode())
    a = _pv(tmp_path, "a.img", UUID_A, listing_b)
    reader = CommittedMetadata(runner, kernel)
    assert reader.volume_group("vg-cap") is None
    (problem,) = reader.problems("vg-cap")
    assert UUID_B in problem and "[unknown]" in problem and "cannot be read" in problem


def test_a_pv_with_every_area_ignored_holds_no_copy_and_is_no_problem(
        runner: FakeRunner, kernel: KernelStub, tmp_path: Path) -> None:
    listing_b = TEXT.replace(b"physical_volumes {\n",
                             b'physical_volumes {\n\npv9 {\nid = "%s"\n}\n' % UUID_B.encode())
    a = _pv(tmp_path, "a.img", UUID_A, listing_b)
    b = _pv(tmp_path, "b.img", UUID_B, TEXT)
    ignored = bytearray(Path(b).read_bytes())  # metadataignore: the flag in its raw_locn
    ignored[MDA + 60:MDA + 64] = struct.pack("<I", lm.RAW_LOCN_IGNORED)
    Path(b).write_bytes(_resealed_header(bytes(ignored[:len(HEAD)])) + bytes(ignored[len(HEAD):]))
    runner.on(["pvs"], _pvs([(a, "vg-cap", UUID_A), (b, "vg-cap", UUID_B)]))
    reader = CommittedMetadata(runner, kernel)
    meta = reader.volume_group("vg-cap")
    assert meta is not None and meta.pv_uuids == {UUID_A, UUID_B}
    assert reader.problems("vg-cap") == ()


def test_check_adds_lvms_own_warnings(runner: FakeRunner, kernel: KernelStub,
                                      tmp_path: Path) -> None:
    """`pvs` does not list a PV whose outdated copy LVM ignores: a reader that
    never saw it cannot tell, and the reports ask LVM (its words, lvm2 2.03)."""
    b = _pv(tmp_path, "b.img", UUID_A, TEXT)
    runner.on(["pvs"], _pvs([(b, "vg-cap", UUID_A)]))
    runner.on(["vgs"], "", stderr=(
        "  WARNING: ignoring metadata seqno 8 on /dev/loop0 for seqno 13 on /dev/loop1 for "
        "VG vg-cap.\n  WARNING: Inconsistent metadata found for VG vg-cap.\n"
        "  See vgck --updatemetadata to correct inconsistency.\n"
        "  WARNING: outdated PV /dev/loop0 seqno 8 has been removed in current VG vg-cap "
        "seqno 13.\n"))
    reader = CommittedMetadata(runner, kernel)
    assert reader.check("vg-cap") == ()  # its own reads: every copy it knows agrees
    assert reader.check("vg-cap", ask_lvm=True) == (
        "LVM: ignoring metadata seqno 8 on /dev/loop0 for seqno 13 on /dev/loop1 for VG "
        "vg-cap.",
        "LVM: Inconsistent metadata found for VG vg-cap.",
        "LVM: outdated PV /dev/loop0 seqno 8 has been removed in current VG vg-cap seqno 13.")


def test_a_pv_once_seen_is_still_read_when_pvs_leaves_it_out(
        runner: FakeRunner, kernel: KernelStub, tmp_path: Path) -> None:
    """`pvs` does not list a PV whose outdated copy LVM ignores: one the
    reader saw in the VG before is still read, and its old copy reported."""
    newest = _seqno(TEXT, 11).replace(UUID_A.encode(), UUID_B.encode())
    a = _pv(tmp_path, "a.img", UUID_A, TEXT)
    b = _pv(tmp_path, "b.img", UUID_B, newest)
    runner.on(["pvs"], _pvs([(a, "vg-cap", UUID_A), (b, "vg-cap", UUID_B)]))
    # While it was away LVM listed it as "[unknown]"; once reduced, not at all.
    runner.on(["pvs"], _pvs([("[unknown]", "vg-cap", UUID_A), (b, "vg-cap", UUID_B)]))
    runner.on(["pvs"], _pvs([(b, "vg-cap", UUID_B)]))
    reader = CommittedMetadata(runner, kernel)
    reader.REFRESH = 0.0  # `pvs` again at each doubt
    assert reader.volume_group("vg-cap") is None
    assert reader.volume_group("vg-cap") is None
    assert len(runner.calls) == 3  # read again: A still there, and still outdated
    (problem,) = reader.problems("vg-cap")
    assert a in problem and "outdated" in problem


def test_the_metadata_area_from_the_pvs(runner: FakeRunner, kernel: KernelStub,
                                        tmp_path: Path) -> None:
    """The size of each area that holds a copy, from its header; the VG's
    tightest area with the committed text's size (what LVM counts against
    max_text_size); an ignored area counts for nothing."""
    _, size, _, length, _ = area()
    a = _pv(tmp_path, "a.img", UUID_A, TEXT)
    assert lm.read_copies(HOST, a).area_sizes == (size,)
    runner.on(["pvs"], _pvs([(a, "vg-cap", UUID_A)]))
    reader = CommittedMetadata(runner, kernel)
    assert reader.metadata_area("vg-cap") is None  # not read yet
    assert reader.volume_group("vg-cap") is not None
    got = reader.metadata_area("vg-cap")
    assert got is not None and (got.size, got.used) == (size, len(TEXT)) == (size, length)
    assert got.limit == (size - 512) // 2 - 512 and got.free == got.limit - length
    ignored = bytearray(Path(a).read_bytes())
    ignored[MDA + 60:MDA + 64] = struct.pack("<I", lm.RAW_LOCN_IGNORED)
    Path(a).write_bytes(_resealed_header(bytes(ignored[:len(HEAD)])) + bytes(ignored[len(HEAD):]))
    assert lm.read_copies(HOST, a).area_sizes == ()
