"""A VG's committed metadata, read from a PV's metadata area: what LVM itself
reads before every report, without starting a process.

Every `lvs` costs a process, LVM's start-up and a scan of every block device:
a third of a second under emulation, for a few KiB of text. The text is on
disk, in a layout LVM has kept since 2002 (lvm2's lib/format_text/layout.h):
a label in one of the first four sectors names the PV and its metadata
areas; each area starts with a header whose first location points at the
committed metadata text, with its size and checksum. LVM writes a new
version beside the old one and then the header, so a reader sees one
committed version or the next, never a mix: the checksums prove which. This
is what `lvs --readonly` does (it reads the disks without LVM's locks).

A VG's metadata is on several PVs, and a PV may hold two copies: which one
is the VG's is decided by the caller (committed_vg.CommittedMetadata) from all of
them, by their seqno, as LVM decides it (read_copies, text_head).

Only reading is done here, and any doubt gives None (the caller asks `lvs`):
a device that is not the PV expected, a checksum that does not match,
metadata of another VG, text that does not parse. The bytes come through
the Kernel (`read_device`: O_DIRECT, past the page cache, as LVM writes
them), so a unit test's fake host serves its own LVM state in this format
and this very parser reads it.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

SECTOR = 512
LABEL_ID = b"LABELONE"
LABEL_TYPE = b"LVM2 001"
MDA_MAGIC = b" LVM2 x[5A%r0N*>"
MDA_HEADER_SIZE = 512
RAW_LOCN_IGNORED = 0x1
INITIAL_CRC = 0xF597A6CF  # lvm2's lib/misc/crc.h
MAX_TEXT = 16 << 20  # no VG's metadata comes near this: a bigger size is damage


class MetadataUnreadable(Exception):
    """This PV cannot give its VG's committed metadata (the caller asks LVM)."""


def lvm_crc(data: bytes, crc: int = INITIAL_CRC) -> int:
    """lvm2's calc_crc: CRC-32 (zlib's polynomial) from `crc`, with neither
    zlib's initial nor its final inversion."""
    return zlib.crc32(data, crc ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


class DeviceReads(Protocol):
    """What this module needs of the host: bytes of a block device
    (host.kernel.Kernel.read_device)."""

    def read_device(self, path: str, offset: int, length: int) -> bytes: ...


def _read(reads: DeviceReads, device: str, offset: int, length: int) -> bytes:
    data = reads.read_device(device, offset, length)
    if len(data) < length:
        raise MetadataUnreadable(f"{device}: short read at byte {offset}")
    return data


@dataclass(frozen=True)
class Committed:
    """One PV's copy of its VG's committed metadata."""

    pv_uuid: str  # as LVM prints it, with dashes
    text: bytes


def _dashed(uuid: bytes) -> str:
    """A PV's 32-character ID as LVM prints it: 6-4-4-4-4-4-6."""
    s = uuid.decode("ascii")
    parts, at = [], 0
    for n in (6, 4, 4, 4, 4, 4, 6):
        parts.append(s[at:at + n])
        at += n
    return "-".join(parts)


@dataclass(frozen=True)
class Copies:
    """Every copy of its VG's committed metadata one PV holds: one per
    metadata area that keeps one (none when every area is ignored, or the PV
    has none: LVM then keeps the VG's metadata on its other PVs only)."""

    pv_uuid: str
    texts: tuple[bytes, ...]
    # The size of each area that holds one of `texts` (in their order): the
    # areas LVM writes every new version to, so the ones that can run out.
    area_sizes: tuple[int, ...] = ()


def max_text_size(area_size: int) -> int:
    """The largest metadata text (its closing NUL included) LVM writes into a
    metadata area of `area_size` bytes (header included); a bigger one fails
    the change ("exceeds maximum metadata size", lvm2's _vg_write_raw). The
    new version is written beside the committed one, each starting on a
    sector: half of what the header leaves, less a sector."""
    return max(0, (area_size - MDA_HEADER_SIZE) // 2 - SECTOR)


def read_committed(reads: DeviceReads, device: str) -> Committed:
    """The committed metadata text on PV `device` (its first metadata area
    that holds one), its checksums verified. MetadataUnreadable otherwise."""
    found = read_copies(reads, device)
    if not found.texts:
        raise MetadataUnreadable(f"{device}: no metadata area holds committed metadata")
    return Committed(found.pv_uuid, found.texts[0])


def read_copies(reads: DeviceReads, device: str) -> Copies:
    """Every committed metadata text on PV `device`, each one's checksums
    verified. MetadataUnreadable when the PV or one of its areas cannot be
    read whole: LVM would warn and read the other, the caller asks LVM."""
    try:
        return _read_copies(reads, device)
    except OSError as err:
        raise MetadataUnreadable(f"{device}: {err.strerror or err}") from None


def _read_copies(reads: DeviceReads, device: str) -> Copies:
    head = _read(reads, device, 0, 4 * SECTOR)
    for n in range(4):
        label = head[n * SECTOR:(n + 1) * SECTOR]
        if label[:8] == LABEL_ID and label[24:32] == LABEL_TYPE:
            break
    else:
        raise MetadataUnreadable(f"{device} has no LVM2 label")
    (crc,) = struct.unpack_from("<I", label, 16)
    if lvm_crc(label[20:]) != crc:
        raise MetadataUnreadable(f"{device}: label checksum mismatch")
    (offset,) = struct.unpack_from("<I", label, 20)
    pv_uuid = label[offset:offset + 32]
    at = offset + 32 + 8  # the PV's ID, then its size
    areas: list[tuple[int, int]] = []
    for kind in ("data", "metadata"):
        while True:
            if at + 16 > SECTOR:
                raise MetadataUnreadable(f"{device}: label's area lists overrun it")
            area_offset, area_size = struct.unpack_from("<QQ", label, at)
            at += 16
            if area_offset == 0 and area_size == 0:
                break
            if kind == "metadata":
                areas.append((area_offset, area_size))
    texts = [(_area_text(reads, device, area_offset, area_size), area_size)
             for area_offset, area_size in areas]
    return Copies(_dashed(pv_uuid), tuple(t for t, _ in texts if t is not None),
                  tuple(size for t, size in texts if t is not None))


# The head of a VG's text as LVM writes it: `name {`, then its id and seqno
# first. Enough to tell copies apart without parsing them.
_HEAD = re.compile(rb'\A(?:\s|#[^\n]*)*([^\s{}\[\]=,"#]+)\s*\{\s*id\s*=\s*"([^"]*)"\s*'
                   rb'seqno\s*=\s*(\d+)')


def text_head(text: bytes) -> tuple[str, str, int]:
    """(VG name, VG ID, seqno) of a metadata text, from its first lines."""
    m = _HEAD.match(text)
    if m is None:
        raise MetadataUnreadable("metadata text does not start with a VG's name, id and seqno")
    return (m.group(1).decode("utf-8", "surrogateescape"), m.group(2).decode("ascii", "replace"),
            int(m.group(3)))


def _area_text(reads: DeviceReads, device: str, area_offset: int,
               area_size: int) -> bytes | None:
    header = _read(reads, device, area_offset, MDA_HEADER_SIZE)
    (crc,) = struct.unpack_from("<I", header, 0)
    if header[4:20] != MDA_MAGIC or lvm_crc(header[4:]) != crc:
        raise MetadataUnreadable(f"{device}: metadata area header at {area_offset} is damaged")
    start, size = struct.unpack_from("<QQ", header, 24)
    if start != area_offset or size != area_size:
        raise MetadataUnreadable(f"{device}: metadata area header does not match its label")
    text_offset, text_size, text_crc, flags = struct.unpack_from("<QQII", header, 40)
    if flags & RAW_LOCN_IGNORED or text_size == 0:
        return None  # an area LVM keeps no metadata in (metadataignore)
    if (text_size > MAX_TEXT or text_size > size - MDA_HEADER_SIZE
            or not MDA_HEADER_SIZE <= text_offset < size):
        raise MetadataUnreadable(f"{device}: metadata location out of its area")
    # A circular buffer after the header: the text may wrap to its start.
    first = min(text_size, size - text_offset)
    text = _read(reads, device, start + text_offset, first)
    if first < text_size:
        text += _read(reads, device, start + MDA_HEADER_SIZE, text_size - first)
    if lvm_crc(text) != text_crc:
        raise MetadataUnreadable(f"{device}: metadata text checksum mismatch (written "
                                 "meanwhile?)")
    return text


# The text: lvm2's config format. Sections `name { ... }`, settings
# `key = value`, values a string, a number or a list of them; # comments.
# Every byte that is not white space belongs to one token: a lone quote (a
# string never closed) is a token of its own, which no rule accepts.
_TOKEN = re.compile(rb"""
    "(?:[^"\\]|\\.)*"
  | \#[^\n]*
  | [{}\[\]=,]
  | [^\s{}\[\]=,"\#]+
  | "
""", re.VERBOSE | re.DOTALL)
_ESCAPE = re.compile(rb"\\(.)", re.DOTALL)
_PUNCT = frozenset(b"{}[]=,")

Value = str | int | float | list["Value"] | dict[str, "Value"]


def _tokens(text: bytes) -> list[tuple[str, bytes]]:
    # One findall in C, then a kind for each token from its first byte: the
    # text of a VG with a thousand LVs is a few hundred KiB.
    out: list[tuple[str, bytes]] = []
    for tok in _TOKEN.findall(text):
        first = tok[0]
        if first == 0x23:  # '#': a comment
            continue
        if first == 0x22:  # '"': a whole string, or the lone quote of one never closed
            if len(tok) == 1:
                raise MetadataUnreadable("metadata text: a string is never closed")
            out.append(("str", tok))
        elif len(tok) == 1 and first in _PUNCT:
            out.append(("punct", tok))
        else:
            out.append(("word", tok))
    return out


def _scalar(kind: str, raw: bytes) -> Value:
    if kind == "str":
        return _ESCAPE.sub(rb"\1", raw[1:-1]).decode("utf-8", "surrogateescape")
    if kind == "word":
        try:
            return float(raw) if b"." in raw else int(raw)
        except ValueError:
            pass
    raise MetadataUnreadable(f"metadata text: unexpected {raw[:40]!r}")


def parse_text(text: bytes) -> dict[str, Value]:
    """The config tree of metadata text (trailing NULs ignored)."""
    toks = _tokens(text.rstrip(b"\0"))
    pos = 0

    def take() -> tuple[str, bytes]:
        nonlocal pos
        if pos >= len(toks):
            raise MetadataUnreadable("metadata text ends early")
        pos += 1
        return toks[pos - 1]

    def value() -> Value:
        kind, raw = take()
        if (kind, raw) != ("punct", b"["):
            return _scalar(kind, raw)
        items: list[Value] = []
        while True:
            kind, raw = take()
            if (kind, raw) == ("punct", b"]"):
                return items
            if (kind, raw) == ("punct", b","):
                continue
            items.append(_scalar(kind, raw))

    def section(top: bool) -> dict[str, Value]:
        out: dict[str, Value] = {}
        while pos < len(toks) or not top:
            kind, raw = take()
            if not top and (kind, raw) == ("punct", b"}"):
                return out
            if kind != "word":
                raise MetadataUnreadable(f"metadata text: expected a name, found {raw[:40]!r}")
            key = raw.decode("utf-8", "surrogateescape")
            _, op = take()
            if op == b"{":
                out[key] = section(False)
            elif op == b"=":
                out[key] = value()
            else:
                raise MetadataUnreadable(f"metadata text: {key!r} is followed by {op[:40]!r}")
        return out

    return section(True)


@dataclass(frozen=True)
class MetaLv:
    """An LV as the VG's metadata records it."""

    name: str
    uuid: str
    size: int  # bytes
    tags: frozenset[str]
    segment_type: str  # of its first segment: "thin", "thin-pool", "striped", ...
    pool: str  # a thin volume's pool
    origin: str  # a thin snapshot's origin
    device_id: int  # a thin volume's ID in its pool (-1: not a thin volume)
    metadata_lv: str  # a thin pool's metadata LV ("pool_tmeta")
    visible: bool
    activation_skip: bool
    created: int
    # Extents it takes on PVs: those of its segments that map PV areas
    # (`stripes`, linear or striped). Thin volumes, thin pools, RAID and
    # mirrors map other LVs (their _tdata, _rimage...), which count instead.
    pv_extents: int = 0
    chunk_size: int = 0  # a thin pool's, bytes (its segment's chunk_size is in sectors)


@dataclass(frozen=True)
class VgMetadata:
    name: str
    uuid: str
    seqno: int
    extent_size: int  # bytes
    pv_uuids: frozenset[str]
    lvs: dict[str, MetaLv]
    # PVs LVM could not find when it wrote this version (flagged MISSING).
    missing_pvs: frozenset[str] = frozenset()
    pe_count: int = 0  # extents of all its PVs, as `vgs` sums them (vg_extent_count)
    # Each LV's section as the text has it, and what it says: the next
    # version of the text parses only the sections that are new (vg_metadata).
    sections: dict[bytes, MetaLv] = field(default_factory=dict, repr=False, compare=False)
    # The lvm2 that wrote this version, from the comment it heads its settings
    # with ("2.03.16(2) (2022-05-18)"; "" when the text has none), and the host
    # it ran on (creation_host): a VG may be changed by the host's LVM and by
    # the plugin's, and doctor compares their versions.
    written_by: str = ""
    creation_host: str = ""


def _words(v: Value | None) -> frozenset[str]:
    return frozenset(x for x in v if isinstance(x, str)) if isinstance(v, list) else frozenset()


def _int(v: Value | None, default: int = 0) -> int:
    return v if isinstance(v, int) else default


def _str(v: Value | None) -> str:
    return v if isinstance(v, str) else ""


# What the layout of a text needs: a section's name with its opening brace,
# a closing brace, and what may hide either (a string, a comment).
_SKELETON = re.compile(rb"""
    "(?:[^"\\]|\\.)*"
  | \#[^\n]*
  | ([^\s{}\[\]=,"\#]+)\s*\{
  | \}
""", re.VERBOSE | re.DOTALL)
_LVS_SECTION = b"logical_volumes"


# One LV's section whole, as LVM writes it: `name { ... }` with sections one
# level deep inside (its segments). Matched in C, one call per LV: walking
# the skeleton of a thousand LVs in Python takes seconds under emulation.
# Possessive quantifiers: a section that does not match fails at once,
# without trying every way to split its text.
_ATOM = rb"""(?:[^{}"\#]++|"(?:[^"\\]|\\.)*+"|\#[^\n]*+)"""
_WHOLE_LV = re.compile(rb"\s*+([^\s{}\[\]=,\"\#]++)\s*+\{(?:%s|\{%s*+\})*+\}"
                       % (_ATOM, _ATOM), re.DOTALL)


def _whole_lvs(text: bytes, pos: int, lvs: list[tuple[str, bytes]]) -> int:
    """LV sections from `pos` on, each matched whole, into `lvs`, up to the
    first that is not (the end of the list, or one nested deeper): where
    that is."""
    while (m := _WHOLE_LV.match(text, pos)) is not None:
        lvs.append((m.group(1).decode("utf-8", "surrogateescape"), text[m.start(1):m.end()]))
        pos = m.end()
    return pos


def _layout(text: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(the text without its logical_volumes section, each LV's section in
    it as (name, its text)). Whatever lies between two LV sections must be
    white space: any other layout is not one LVM writes."""
    path: list[bytes] = []  # the sections open at this point
    area: tuple[int, int] | None = None
    lvs: list[tuple[str, bytes]] = []
    lv_start = gap_start = pos = 0
    while (m := _SKELETON.search(text, pos)) is not None:
        pos = m.end()
        if m.group(0)[0] in b'"#':
            continue
        name = m.group(1)
        if name is not None:
            path.append(name)
            if len(path) == 2 and name == _LVS_SECTION:
                if area is not None:
                    raise MetadataUnreadable("metadata text: two logical_volumes sections")
                area = (m.start(), -1)
                gap_start = pos = _whole_lvs(text, pos, lvs)
            elif len(path) == 3 and path[1] == _LVS_SECTION:
                if _tokens(text[gap_start:m.start()]):
                    raise MetadataUnreadable("metadata text: settings among the LVs")
                lv_start = m.start()
            continue
        if not path:
            raise MetadataUnreadable(f"metadata text: a }} with no section at byte {m.start()}")
        closed = path.pop()
        if len(path) == 2 and path[1] == _LVS_SECTION:
            lvs.append((closed.decode("utf-8", "surrogateescape"), text[lv_start:m.end()]))
            gap_start = pos = _whole_lvs(text, pos, lvs)
        elif len(path) == 1 and closed == _LVS_SECTION:
            assert area is not None
            if _tokens(text[gap_start:m.start()]):
                raise MetadataUnreadable("metadata text: settings among the LVs")
            area = (area[0], m.end())
    if path:
        raise MetadataUnreadable("metadata text ends early")
    if area is None:
        return text, []
    return text[:area[0]] + text[area[1]:], lvs


def _maps_pvs(stripes: Value | None) -> bool:
    """Whether a segment's `stripes` (["pv0", 0, ...]) are areas of PVs."""
    return isinstance(stripes, list) and any(isinstance(x, str) and x.startswith("pv")
                                             for x in stripes)


def _meta_lv(vg: str, lv_name: str, lv: dict[str, Value], extent: int) -> MetaLv:
    segments = [lv[f"segment{i}"] for i in range(1, _int(lv.get("segment_count")) + 1)
                if isinstance(lv.get(f"segment{i}"), dict)]
    if not segments:
        raise MetadataUnreadable(f"LV {vg}/{lv_name} has no segments")
    first = segments[0]
    assert isinstance(first, dict)
    thin = first.get("type") == "thin"
    return MetaLv(
        name=lv_name, uuid=_str(lv.get("id")),
        size=sum(_int(s.get("extent_count")) for s in segments
                 if isinstance(s, dict)) * extent,
        tags=_words(lv.get("tags")), segment_type=_str(first.get("type")),
        pool=_str(first.get("thin_pool")) if thin else "",
        origin=_str(first.get("origin")) if thin else "",
        device_id=_int(first.get("device_id"), -1) if thin else -1,
        metadata_lv=_str(first.get("metadata")) if first.get("type") == "thin-pool" else "",
        visible="VISIBLE" in _words(lv.get("status")),
        activation_skip="ACTIVATION_SKIP" in _words(lv.get("flags")),
        created=_int(lv.get("creation_time")),
        pv_extents=sum(_int(s.get("extent_count")) for s in segments
                       if isinstance(s, dict) and _maps_pvs(s.get("stripes"))),
        chunk_size=_int(first.get("chunk_size")) * 512
        if first.get("type") == "thin-pool" else 0,
    )


# "# Generated by LVM2 version 2.03.16(2) (2022-05-18): Tue Nov 24 09:21:45 2026", the
# line lvm2's export.c writes after the VG's section, before `contents`.
_WRITTEN_BY = re.compile(rb"^# Generated by LVM2 version ([^:\n]+):", re.MULTILINE)


def written_by(head: bytes) -> str:
    """The version of the lvm2 that wrote a metadata text (without its LV
    sections, which hold no such line), "" when it names none."""
    found = _WRITTEN_BY.search(head)
    return found.group(1).decode("ascii", "replace").strip() if found else ""


def vg_metadata(text: bytes, previous: VgMetadata | None = None,
                only: Collection[str] | None = None) -> VgMetadata:
    """The VG of a metadata text: its one section, its PVs' IDs and its LVs.

    `previous`: what an earlier version of this VG's text said. An LV whose
    section is the same, byte for byte, is taken from it unparsed: a change
    rewrites a section or two, and parsing a section is what costs (a few ms
    per LV under emulation; a thousand LVs would take seconds).

    `only`: parse just the sections of the LVs of these names, for a reader
    that needs a few LVs of thousands (the plugin's start: its pools, its
    staged volumes). `lvs` then holds those of them the VG has, and nothing
    else: a partial view, never to be taken for the whole VG. Everything
    else is checked as in a whole parse but the other LVs' sections."""
    head, sections = _layout(text.rstrip(b"\0"))
    tree = parse_text(head)
    vgs = [(k, v) for k, v in tree.items() if isinstance(v, dict)]
    if len(vgs) != 1:
        raise MetadataUnreadable(f"metadata text holds {len(vgs)} VGs, not one")
    name, vg = vgs[0]
    assert isinstance(vg, dict)
    extent = _int(vg.get("extent_size")) * SECTOR
    if extent <= 0:
        raise MetadataUnreadable(f"VG {name}: no extent size")
    pvs = vg.get("physical_volumes", {})
    pv_uuids = frozenset(_str(pv.get("id")) for pv in (pvs.values() if isinstance(pvs, dict)
                                                       else ()) if isinstance(pv, dict))
    missing = frozenset(_str(pv.get("id")) for pv in (pvs.values() if isinstance(pvs, dict)
                                                      else ()) if isinstance(pv, dict)
                        and "MISSING" in _words(pv.get("flags")) | _words(pv.get("status")))
    known = previous.sections if previous is not None and previous.extent_size == extent \
        and previous.name == name else {}
    lvs: dict[str, MetaLv] = {}
    parsed: dict[bytes, MetaLv] = {}
    names: set[str] = set()

    def take(lv_name: str, section: bytes) -> MetaLv:
        meta = known.get(section)
        if meta is None:
            tree = parse_text(section)
            lv = tree.get(lv_name)
            if len(tree) != 1 or not isinstance(lv, dict):
                raise MetadataUnreadable(f"LV {name}/{lv_name}: its section does not parse")
            meta = _meta_lv(name, lv_name, lv, extent)
        lvs[lv_name] = parsed[section] = meta
        return meta

    pools: list[MetaLv] = []
    for lv_name, section in sections:
        if lv_name in names:
            raise MetadataUnreadable(f"VG {name} names LV {lv_name} twice")
        names.add(lv_name)
        if only is None or lv_name in only:
            meta = take(lv_name, section)
            if meta.metadata_lv:
                pools.append(meta)
    if only is not None:
        # A thin pool comes with its metadata LV, whose size `lvs` shows as its own.
        wanted = {p.metadata_lv for p in pools} - set(lvs)
        for lv_name, section in sections if wanted else ():
            if lv_name in wanted:
                take(lv_name, section)
    pe_count = sum(_int(pv.get("pe_count")) for pv in (pvs.values() if isinstance(pvs, dict)
                                                         else ()) if isinstance(pv, dict))
    return VgMetadata(name, _str(vg.get("id")), _int(vg.get("seqno")), extent, pv_uuids, lvs,
                      missing, pe_count, parsed, written_by=written_by(head),
                      creation_host=_str(tree.get("creation_host")))
