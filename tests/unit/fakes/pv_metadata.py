"""The fake LVM's PVs as bytes on disk: each VG's one PV holds a label, a PV
header and one metadata area whose header points at the VG's metadata text,
rendered from the fake's own state in the layout lvm2 2.03 writes
(lib/format_text/layout.h, export.c). The plugin's committed-metadata
reader (storage/vg_text.py) reads these bytes through the fake Kernel as it
reads a real PV, so the unit tables run its path too.

The format is written out here on its own, not taken from the reader: the
constants, the checksum and the layout are lvm2's, and test_fakehost.py
holds the label and the area's header byte for byte, and the text's
sections key by key, against what LVM wrote in the test VM
(tests/unit/data/lvm-metadata.json). What is not modelled:
a PV per VG only, one metadata area, no pool metadata spare (lvol0_pmspare,
which the fake's `vgs` does not count either), and LVM's hidden LV names
only for a thin pool's data and metadata.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.unit.fakes.lvm import FakeLv, FakeVg

SECTOR = 512
LABEL_SECTOR = 1  # lvm2 writes its label in the second sector
MDA_OFFSET = 4096  # where pvcreate puts the first metadata area
MDA_HEADER = 512
PE_ALIGN = 1 << 20  # pvcreate's default data alignment
LVM_VERSION = "2.03.16(2) (2022-05-18)"  # Debian 12's, as it heads the text
HOST_NAME = "fake-node"
# The date lvm2 writes beside its version and creation_time (a comment; no
# reader takes it: the fake's clock is a counter, not a date).
DATE = "Tue Nov 14 22:13:20 2023"
_LABEL_ID = b"LABELONE"
_LABEL_TYPE = b"LVM2 001"
_MDA_MAGIC = b" LVM2 x[5A%r0N*>"
_INITIAL_CRC = 0xF597A6CF


def lvm_crc(data: bytes) -> int:
    """lvm2's calc_crc (lib/misc/crc.c) from its initial value: CRC-32 without
    the usual inversions."""
    return zlib.crc32(data, _INITIAL_CRC ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def lvm_id(*seed: str) -> str:
    """A 32-character LVM ID, dashed 6-4-4-4-4-4-6 as LVM prints it, the same
    for the same seed."""
    raw = hashlib.sha256("/".join(seed).encode()).hexdigest()[:32]
    parts, at = [], 0
    for n in (6, 4, 4, 4, 4, 4, 6):
        parts.append(raw[at:at + n])
        at += n
    return "-".join(parts)


def pv_path(vg: str) -> str:
    return f"/dev/fake-pv-{vg}"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _strings(items: Iterable[str]) -> str:
    return "[" + ", ".join(_quote(i) for i in items) + "]"


def _extents(size: int, extent: int) -> int:
    return -(-size // extent)


def _section(name: str, uuid: str, *, visible: bool, flags: Iterable[str] = (),
             tags: Iterable[str] = (), created: int, extents: int,
             segment: list[str]) -> list[str]:
    """One LV's section as export.c writes it, one segment."""
    status = ["READ", "WRITE", "VISIBLE"] if visible else ["READ", "WRITE"]
    tag_list = sorted(tags)
    return [f"{name} {{", f"id = {_quote(uuid)}", f"status = {_strings(status)}",
            f"flags = {_strings(flags)}",
            *([f"tags = {_strings(tag_list)}"] if tag_list else []),
            f"creation_time = {created}", f"creation_host = {_quote(HOST_NAME)}",
            "segment_count = 1", "", "segment1 {", "start_extent = 0",
            f"extent_count = {extents}", "", *segment, "}", "}", ""]


def _striped(at: int) -> list[str]:
    return ['type = "striped"', "stripe_count = 1", "", "stripes = [", f'"pv0", {at}', "]"]


def _lv_sections(fvg: FakeVg, lvs: Iterable[FakeLv]) -> list[str]:
    """Every LV's section: the visible ones in the order they were made, then
    each pool's hidden metadata and data LVs, placed on the PV in turn."""
    visible: list[str] = []
    hidden: list[str] = []
    at = 0  # the next free extent on the PV
    for lv in lvs:
        extents = _extents(lv.size, fvg.extent)
        if lv.kind == "pool":
            top = max((x.thin_id for x in fvg.lvs.values() if x.pool == lv.name), default=0)
            visible += _section(lv.name, lv.uuid, visible=True, tags=lv.tags,
                                created=lv.created, extents=extents, segment=[
                                    'type = "thin-pool"', f'metadata = "{lv.name}_tmeta"',
                                    f'pool = "{lv.name}_tdata"', f"transaction_id = {top}",
                                    f"chunk_size = {lv.chunk_size // SECTOR}",
                                    'discards = "passdown"', "zero_new_blocks = 1"])
            meta = _extents(lv.metadata_size, fvg.extent)
            hidden += _section(f"{lv.name}_tmeta", lvm_id(fvg.name, lv.name, "tmeta"),
                               visible=False, created=lv.created, extents=meta,
                               segment=_striped(at))
            hidden += _section(f"{lv.name}_tdata", lvm_id(fvg.name, lv.name, "tdata"),
                               visible=False, created=lv.created, extents=extents,
                               segment=_striped(at + meta))
            at += meta + extents
        else:
            visible += _section(
                lv.name, lv.uuid, visible=True, flags=["ACTIVATION_SKIP"] if lv.skip else [],
                tags=lv.tags, created=lv.created, extents=extents, segment=[
                    'type = "thin"', f"thin_pool = {_quote(lv.pool)}",
                    f"transaction_id = {max(0, lv.thin_id - 1)}", f"device_id = {lv.thin_id}",
                    *([f"origin = {_quote(lv.origin)}"] if lv.origin else [])])
    return visible + hidden


def pe_start(fvg: FakeVg) -> int:
    """Bytes before the PV's first extent: its metadata area, aligned."""
    return _extents(MDA_OFFSET + fvg.mda_size, PE_ALIGN) * PE_ALIGN


def vg_text(fvg: FakeVg, lvs: Iterable[FakeLv] | None = None, seqno: int | None = None) -> bytes:
    """VG `fvg`'s metadata text with its LVs (`lvs`: these instead, as the
    fake's lvcreate sizes the next version), as lvm2 writes it to the
    metadata area, its closing NUL included. `mda_padding` bytes of the
    description stand for the long command lines LVM records there."""
    written = max((lv.created for lv in fvg.lvs.values()), default=0)
    lines = [f"{fvg.name} {{", f"id = {_quote(lvm_id(fvg.name, 'vg'))}",
             f"seqno = {fvg.seqno if seqno is None else seqno}", 'format = "lvm2"',
             'status = ["RESIZEABLE", "READ", "WRITE"]', "flags = []",
             f"extent_size = {fvg.extent // SECTOR}", "max_lv = 0", "max_pv = 0",
             "metadata_copies = 0", "", "physical_volumes {", "", "pv0 {",
             f"id = {_quote(lvm_id(fvg.name, 'pv'))}", f"device = {_quote(pv_path(fvg.name))}",
             "", 'status = ["ALLOCATABLE"]', "flags = []",
             f"dev_size = {(pe_start(fvg) + fvg.size) // SECTOR}",
             f"pe_start = {pe_start(fvg) // SECTOR}", f"pe_count = {fvg.size // fvg.extent}",
             "}", "}", "", "logical_volumes {", "",
             *_lv_sections(fvg, fvg.lvs.values() if lvs is None else lvs), "}", "", "}",
             f"# Generated by LVM2 version {LVM_VERSION}: {DATE}", "",
             'contents = "Text Format Volume Group"', "version = 1", "",
             f"description = {_quote('Write from the fake.' + ' ' * fvg.mda_padding)}", "",
             f"creation_host = {_quote(HOST_NAME)}\t# Linux {HOST_NAME}",
             f"creation_time = {written}\t# {DATE}", "", ""]
    return "\n".join(lines).encode() + b"\0"


@dataclass
class Committed:
    """Where the area's text is: LVM writes each version just after the last
    one, on a sector, and wraps round to the area's start (past its header)
    when it runs into the end, so a version may be split in two."""

    text: bytes = b""
    offset: int = MDA_HEADER  # from the area's start


def commit(fvg: FakeVg) -> Committed:
    """The VG's committed text now. A text that differs from the last one read
    is a new version: its seqno goes up and it is written after the last."""
    body = vg_text(fvg, seqno=0)
    if body != fvg.last_text:
        last = fvg.committed
        if last.text:
            fvg.seqno += 1
            offset = last.offset + _extents(len(last.text), SECTOR) * SECTOR
            if offset >= fvg.mda_size:
                offset = MDA_HEADER + offset - fvg.mda_size
        else:
            fvg.seqno, offset = 1, MDA_HEADER
        fvg.last_text = body
        fvg.committed = Committed(vg_text(fvg), offset)
    return fvg.committed


def label(pv_uuid: str, device_size: int, data_offset: int, mda_size: int) -> bytes:
    """The label sector: its header, then the PV header (the PV's ID and size,
    its data area, its metadata area, each list closed by a zero pair) and
    the extension (version 2, the PV in use, no bootloader area)."""
    pv = (pv_uuid.replace("-", "").encode() + struct.pack("<Q", device_size)
          + struct.pack("<QQQQ", data_offset, 0, 0, 0)
          + struct.pack("<QQQQ", MDA_OFFSET, mda_size, 0, 0)
          + struct.pack("<II", 2, 1) + struct.pack("<QQ", 0, 0))
    body = struct.pack("<I", 32) + _LABEL_TYPE + pv  # from offset_xl on
    body += bytes(SECTOR - 20 - len(body))
    head = _LABEL_ID + struct.pack("<Q", LABEL_SECTOR)
    return head + struct.pack("<I", lvm_crc(body)) + body


def mda_header(start: int, size: int, text_offset: int, text_size: int, text_crc: int) -> bytes:
    """A metadata area's header: its checksum, magic, version 1, where the area
    is, and the one raw location of the committed text (the list closed by
    a zero location)."""
    body = (_MDA_MAGIC + struct.pack("<IQQ", 1, start, size)
            + struct.pack("<QQII", text_offset, text_size, text_crc, 0) + bytes(24))
    body += bytes(MDA_HEADER - 4 - len(body))
    return struct.pack("<I", lvm_crc(body)) + body


def pv_bytes(fvg: FakeVg, offset: int, length: int) -> bytes:
    """`length` bytes of VG `fvg`'s PV from `offset`: zeros but for the label,
    the metadata area's header and the text where it points."""
    now = commit(fvg)
    text = now.text
    size = fvg.mda_size
    first = min(len(text), size - now.offset)
    regions = [
        (LABEL_SECTOR * SECTOR, label(lvm_id(fvg.name, "pv"), pe_start(fvg) + fvg.size,
                                      pe_start(fvg), size)),
        (MDA_OFFSET, mda_header(MDA_OFFSET, size, now.offset, len(text), lvm_crc(text))),
        (MDA_OFFSET + now.offset, text[:first]),
        (MDA_OFFSET + MDA_HEADER, text[first:]),
    ]
    end = min(offset + length, pe_start(fvg) + fvg.size)
    out = bytearray(max(0, end - offset))
    for at, data in regions:
        lo, hi = max(at, offset), min(at + len(data), end)
        if lo < hi:
            out[lo - offset:hi - offset] = data[lo - at:hi - at]
    return bytes(out)
