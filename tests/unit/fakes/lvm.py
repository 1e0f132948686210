"""The fake LVM: volume groups, thin pools and thin volumes, the LVM
commands that report and change them, what is read of them without a
process (each VG's PV, whose bytes fakes/pv_metadata.py renders, and
device-mapper's devices and their status, through the Kernel), and the thin
tools' view of a pool (dmsetup, thin_dump, thin_delta)."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from csi_local.host.device_mapper import DmDevice, Target
from csi_local.host.kernel import Kernel
from csi_local.storage import vg_text
from tests.unit.fakes import pv_metadata
from tests.unit.fakes.common import (
    DM_MAJOR,
    GiB,
    MiB,
    _Fail,
    _one,
    _options,
    _round_up,
    _size,
)
from tests.unit.fakes.devices import Content, _Dev

if TYPE_CHECKING:
    from tests.unit.fakes.crypt import FakeMapper


@dataclass
class FakeLv:
    """One logical volume: a thin pool ("pool") or a thin volume ("thin")."""

    name: str
    size: int
    kind: str
    tags: set[str] = field(default_factory=set)
    active: bool = True
    skip: bool = False  # LVM's activation-skip flag (attr[9] 'k')
    pool: str = ""
    origin: str = ""
    minor: int = -1  # dm minor while active
    created: int = 0
    data_percent: float = 0.0
    metadata_percent: float = 0.0
    busy: bool = False  # held open by something the fake does not model (a process)
    content: Content = field(default_factory=Content)
    metadata_size: int = 8 * MiB  # a pool's metadata LV
    vg: str = ""  # set when the LV is added to a VG
    readahead: str = "auto"  # lvcreate --readahead
    thin_id: int = -1  # a thin volume's device ID in its pool
    # A thin volume's mappings: its chunk -> the pool's data chunk. A write maps
    # new data chunks (copy on write, as dm-thin does for shared chunks), a
    # snapshot shares its origin's, a discard unmaps.
    chunks: dict[int, int] = field(default_factory=dict)
    chunk_size: int = 64 * 1024  # a pool's chunk size
    held: bool = False  # a pool's metadata snapshot is reserved (dmsetup status)
    held_root: int = 42  # its root block: each reserve takes another one
    uuid: str = ""  # lv_uuid, set when the LV is made
    # A thin pool that has failed (its metadata unreadable): the kernel's
    # status of it and of its thin volumes says "Fail", and lvs "failed".
    failed: bool = False

# The minors of a thin pool's other device-mapper devices (its data and
# metadata LVs, and the linear layer LVM stacks over a pool in use): clear of
# the LVs' own and of dm-crypt's (fakes/crypt.py).
_LINEAR_MINOR, _TDATA_MINOR, _TMETA_MINOR = 2000, 3000, 4000
METADATA_BLOCK = 4096  # a thin pool's metadata block, as its status counts them


@dataclass
class FakeVg:
    """One volume group: its extent size, size, whether it is there (a VG that
    is not present answers "not found" to everything, as a detached disk's
    would), and its LVs by name."""

    name: str
    extent: int
    size: int
    present: bool = True
    lvs: dict[str, FakeLv] = field(default_factory=dict)
    # Its metadata area (pvcreate's default size), and bytes of text the
    # VG's metadata holds besides its own and its LVs' (LVM records the
    # command that wrote it: a test makes the text as long as it needs).
    mda_size: int = 1020 * 1024
    mda_padding: int = 0
    # Its PV's reads fail (an I/O error): the committed metadata cannot answer.
    pv_unreadable: bool = False
    # The version of its metadata on its PV (pv_metadata.commit).
    seqno: int = 0
    last_text: bytes = b""
    committed: pv_metadata.Committed = field(default_factory=pv_metadata.Committed)

    @property
    def mda_text(self) -> int:
        """The size of the VG's metadata text as the fake's PV holds it."""
        return len(pv_metadata.vg_text(self))

    @property
    def pools(self) -> list[FakeLv]:
        return [lv for lv in self.lvs.values() if lv.kind == "pool"]

    @property
    def free(self) -> int:
        """What the pools (data and metadata) leave of the VG."""
        return self.size - sum(lv.size + lv.metadata_size for lv in self.pools)


def _vg_not_found(vg: str) -> str:
    return f'  Volume group "{vg}" not found\n  Cannot process volume group {vg}\n'


class FakeLvm(Kernel):
    """Volume groups and their LVs (a FakeHost part)."""

    vg: str  # the first VG: the default of every helper taking a `vg`
    pool_name: str  # its first pool: the default of add_lv
    vgs: dict[str, FakeVg]
    clock: int  # lv_time of the next LV; each lvcreate advances it
    _next_data_chunk: int
    pv_metadata: bool  # `pvs` lists the VGs' PVs, which the committed reader reads
    thin_status_error: bool  # every thin target's status says a failed pool's "Error"

    if TYPE_CHECKING:  # what it uses of the other parts (fakehost.FakeHost has all)
        frozen: set[tuple[int, int]]
        nested_freeze: bool

        def set_content(self, name: str, fs: str | None = None, *, ambivalent: bool = False,
                        unreadable: bool = False, uuid: str | None = None,
                        fs_size: int | None = None, vg: str | None = None) -> Content: ...
        def _need_device(self, path: str, rc: int, message: str) -> _Dev: ...
        def _is_open(self, dev_node: str) -> bool: ...
        def _crypt_holds(self, lv: FakeLv) -> bool: ...
        mappers: dict[str, FakeMapper]

    def add_vg(self, name: str, *, pool: str | None = "pool0", pool_size: int = 10 * GiB,
               extent: int = 4 * MiB, vg_size: int | None = None,
               present: bool = True) -> FakeVg:
        """Another volume group (the first is the constructor's), with a thin pool
        `pool` unless None; `vg_size` defaults to the pool's size plus 1 GiB. A VG
        not `present` is one vgcreate may make (or a test brings back)."""
        assert name not in self.vgs, f"FakeHost: VG {name} exists already"
        size = vg_size if vg_size is not None else pool_size + GiB
        fvg = FakeVg(name, extent, _round_up(size, extent), present)
        self.vgs[name] = fvg
        if present and pool is not None:
            self.add_pool(name, pool, pool_size)
        return fvg

    def add_pool(self, vg: str, name: str, size: int = 10 * GiB) -> FakeLv:
        """Another thin pool in VG `vg` (made earlier: no lvcreate in `calls`). The
        VG's size is not checked: add_vg's `vg_size` says what is left."""
        fvg = self.vgs[vg]
        return self._new_lv(fvg, FakeLv(name, _round_up(size, fvg.extent), "pool"))

    def set_vg_present(self, vg: str, present: bool) -> None:
        """A VG goes (a disk detached, not yet activated) or comes back, its LVs kept."""
        self.vgs[vg].present = present

    @property
    def lvs(self) -> dict[str, FakeLv]:
        """The first VG's LVs by name (the dict itself: tests add and delete)."""
        return self.vgs[self.vg].lvs

    @property
    def vg_present(self) -> bool:
        return self.vgs[self.vg].present

    @vg_present.setter
    def vg_present(self, present: bool) -> None:
        self.vgs[self.vg].present = present

    @property
    def vg_size(self) -> int:
        return self.vgs[self.vg].size

    @vg_size.setter
    def vg_size(self, size: int) -> None:
        self.vgs[self.vg].size = size

    @property
    def extent(self) -> int:
        return self.vgs[self.vg].extent

    def all_lvs(self) -> dict[tuple[str, str], FakeLv]:
        """Every LV of every VG, by (vg, name)."""
        return {(fvg.name, name): lv for fvg in self.vgs.values()
                for name, lv in fvg.lvs.items()}

    def _vg_of(self, name: str, vg: str | None) -> str:
        """`vg`, or the VG holding an LV `name`: the first VG's if it has one, else
        the only other VG that has one (an AssertionError if several do)."""
        if vg is not None:
            return vg
        if name in self.lvs:
            return self.vg
        holders = [v for v, fvg in self.vgs.items() if name in fvg.lvs]
        assert len(holders) <= 1, f"FakeHost: LV {name} is in VGs {holders}: pass vg="
        return holders[0] if holders else self.vg

    def lv(self, name: str, vg: str | None = None) -> FakeLv:
        """The LV `name` of `vg` (None: of the VG that has it; KeyError if none)."""
        return self.vgs[self._vg_of(name, vg)].lvs[name]

    def lv_path(self, name: str, vg: str | None = None) -> str:
        return f"/dev/{self._vg_of(name, vg)}/{name}"

    def add_lv(self, name: str, size: int, *, tags: Iterable[str] = (), active: bool = True,
               skip: bool = False, origin: str = "", fs: str | None = None,
               vg: str | None = None, pool: str | None = None) -> FakeLv:
        """A thin volume as if made earlier (no lvcreate in `calls`), in `vg` (None:
        the first VG) and `pool` (None: the first VG's first pool, or the other
        VG's first pool)."""
        fvg = self.vgs[vg or self.vg]
        if pool is None:
            pool = self.pool_name if fvg.name == self.vg else fvg.pools[0].name
        assert name not in fvg.lvs, f"FakeHost: LV {fvg.name}/{name} exists already"
        lv = self._new_lv(fvg, FakeLv(name, _round_up(size, fvg.extent), "thin", set(tags),
                                      active, skip, pool, origin))
        if fs is not None:
            self.set_content(name, fs=fs, vg=fvg.name)
        return lv

    def write(self, name: str, offset: int, length: int, *, vg: str | None = None) -> None:
        """Bytes written to thin volume `name`: every chunk they touch maps a new
        data chunk (dm-thin copies shared chunks on write, and provisions
        unmapped ones)."""
        lv = self.lv(name, vg)
        assert lv.kind == "thin" and 0 <= offset and offset + length <= lv.size, (name, offset)
        size = self._pool_of(lv).chunk_size
        for chunk in range(offset // size, (offset + length - 1) // size + 1):
            lv.chunks[chunk] = self._next_data_chunk
            self._next_data_chunk += 1

    def discard(self, name: str, offset: int, length: int, *, vg: str | None = None) -> None:
        """A discard of thin volume `name`: the whole chunks inside it are unmapped."""
        lv = self.lv(name, vg)
        size = self._pool_of(lv).chunk_size
        for chunk in range(-(-offset // size), (offset + length) // size):
            lv.chunks.pop(chunk, None)

    def _pool_of(self, lv: FakeLv) -> FakeLv:
        return self.vgs[lv.vg].lvs[lv.pool]

    def set_busy(self, name: str, busy: bool = True, *, vg: str | None = None) -> None:
        self.lv(name, vg).busy = busy

    def _thin_status(self, lv: FakeLv) -> str:
        """An active thin volume's status, "<mapped sectors> <highest mapped
        sector>": its mapped chunks, or one chunk for content written without
        a modelled write (mkfs, a setup); what a pool whose metadata cannot be
        read says instead while `thin_status_error` is set."""
        pool = self.vgs[lv.vg].lvs.get(lv.pool)
        if pool is None or pool.failed:  # gone: a state LVM never leaves (a test's)
            return "Fail"
        if self.thin_status_error:
            return "Error"
        sectors = pool.chunk_size // 512
        chunks = sorted(lv.chunks) or ([0] if lv.content.holds_data else [])
        if not chunks:
            return "0 -"
        return f"{len(chunks) * sectors} {(chunks[-1] + 1) * sectors - 1}"

    @staticmethod
    def _pool_blocks(pool: FakeLv) -> tuple[int, int, int, int]:
        """(metadata used, metadata total, data used, data total) blocks of a
        thin pool: its fill, rounded up to whole blocks (a pool filled to a
        limit reads as at it). The kernel's status says them, and `lvs`
        derives its percentages from them."""
        def used(percent: float, total: int) -> int:
            return min(total, -(-round(percent * total * 100) // 10_000))

        data_total = pool.size // pool.chunk_size
        meta_total = pool.metadata_size // METADATA_BLOCK
        return (used(pool.metadata_percent, meta_total), meta_total,
                used(pool.data_percent, data_total), data_total)

    def _pool_status(self, pool: FakeLv) -> str:
        """A thin-pool target's status: its fill and its metadata snapshot."""
        if pool.failed:
            return "Fail"
        meta_used, meta_total, data_used, data_total = self._pool_blocks(pool)
        held = str(pool.held_root) if pool.held else "-"
        return (f"7 {meta_used}/{meta_total} {data_used}/{data_total} {held} rw "
                "discard_passdown queue_if_no_space - 256")

    def _percent(self, lv: FakeLv, of: str) -> str:
        """data_percent or metadata_percent as `lvs` prints it: a thin volume's
        as set, a pool's from its status's blocks."""
        if lv.kind != "pool":
            return f"{lv.data_percent:.2f}" if of == "data" else ""
        if lv.failed:
            return ""
        meta_used, meta_total, data_used, data_total = self._pool_blocks(lv)
        used, total = (data_used, data_total) if of == "data" else (meta_used, meta_total)
        return f"{100 * used / total:.2f}"

    @staticmethod
    def _mapper(lv: FakeLv) -> str:
        return f"/dev/mapper/{lv.vg.replace('-', '--')}-{lv.name.replace('-', '--')}"

    def _active_lv(self, path: str) -> FakeLv | None:
        for lv in self.all_lvs().values():
            names = {f"/dev/dm-{lv.minor}", self._mapper(lv)}
            if lv.kind == "thin":  # a thin pool has no /dev/VG/LV link
                names.add(f"/dev/{lv.vg}/{lv.name}")
            if lv.active and path in names:
                return lv
        return None

    def _new_lv(self, fvg: FakeVg, lv: FakeLv) -> FakeLv:
        lv.created = self.clock
        self.clock += 1
        lv.vg = fvg.name
        lv.uuid = pv_metadata.lvm_id(fvg.name, lv.name, str(self.clock))
        if lv.kind == "pool":  # LVM gives a pool's metadata LV whole extents
            lv.metadata_size = _round_up(lv.metadata_size, fvg.extent)
        if lv.kind == "thin" and lv.thin_id < 0:  # LVM numbers thin devices per pool
            lv.thin_id = 1 + max((x.thin_id for x in fvg.lvs.values() if x.pool == lv.pool),
                                 default=0)
        fvg.lvs[lv.name] = lv
        if lv.active:
            self._activate(lv)
        return lv

    def _activate(self, lv: FakeLv) -> None:
        """Active, with a dm minor no other active LV of any VG has."""
        used = {x.minor for x in self.all_lvs().values() if x.active and x is not lv}
        lv.active, lv.minor = True, min(set(range(len(used) + 1)) - used)

    def _lv_open(self, lv: FakeLv) -> bool:
        if lv.kind == "pool":
            return any(x.active and x.pool == lv.name for x in self.vgs[lv.vg].lvs.values())
        return lv.busy or (lv.active and (self._is_open(f"/dev/dm-{lv.minor}")
                                          or self._crypt_holds(lv)))

    def _attr(self, lv: FakeLv) -> str:
        a = "a" if lv.active else "-"
        o = "o" if self._lv_open(lv) else "-"
        if lv.kind == "pool":
            return f"twi-{a}{o}tz{'F' if lv.failed else '-'}-"
        return f"Vwi-{a}{o}tz-{'k' if lv.skip else '-'}"

    def _row(self, lv: FakeLv, fields: Sequence[str], argv: Sequence[str]) -> dict[str, str]:
        """The LV's report row: `fields`, each as `lvs` prints it."""
        thin = lv.kind == "thin"
        values: dict[str, Callable[[], str]] = {
            "lv_name": lambda: lv.name, "vg_name": lambda: lv.vg,
            "lv_size": lambda: str(lv.size), "lv_tags": lambda: ",".join(sorted(lv.tags)),
            "lv_attr": lambda: self._attr(lv), "pool_lv": lambda: lv.pool,
            "origin": lambda: lv.origin,
            "lv_path": lambda: f"/dev/{lv.vg}/{lv.name}" if thin else "",
            "data_percent": lambda: self._percent(lv, "data") if lv.active else "",
            "metadata_percent": lambda: self._percent(lv, "metadata"),
            "lv_time": lambda: str(lv.created),
            "lv_health_status": lambda: "failed" if lv.failed else "",
            "lv_kernel_major": lambda: str(DM_MAJOR) if lv.active else "-1",
            "lv_kernel_minor": lambda: str(lv.minor) if lv.active else "-1",
            "vg_extent_size": lambda: str(self.vgs[lv.vg].extent),
            "vg_mda_size": lambda: str(self.vgs[lv.vg].mda_size),
            "vg_mda_free": lambda: str(self._mda_free(self.vgs[lv.vg])),
            "lv_metadata_size": lambda: "" if thin else str(lv.metadata_size),
            "thin_id": lambda: str(lv.thin_id) if thin else "",
            "lv_uuid": lambda: lv.uuid,
            "chunk_size": lambda: "0" if thin else str(lv.chunk_size),
        }
        row = {}
        for name in fields:
            if name not in values:
                raise AssertionError(f"FakeHost does not report field {name!r} in {argv!r}")
            row[name] = values[name]()
        return row

    @staticmethod
    def _mda_free(fvg: FakeVg) -> int:
        """vg_mda_free as LVM reports it: what the largest text it writes
        leaves, in whole sectors."""
        room = vg_text.max_text_size(fvg.mda_size) - fvg.mda_text
        return max(0, room) // 512 * 512

    @staticmethod
    def _vg_fail(vg: str, stdout: str = "") -> _Fail:
        return _Fail(5, _vg_not_found(vg), stdout)

    def _vg(self, name: str) -> FakeVg:
        """A present VG; LVM's "not found" otherwise."""
        fvg = self.vgs.get(name)
        if fvg is None or not fvg.present:
            raise self._vg_fail(name)
        return fvg

    def _target(self, target: str, *,
                must_exist: bool = True) -> tuple[FakeVg, str, FakeLv | None]:
        """VG/LV -> (VG, name, LV); VG not found and LV not found as LVM says them."""
        vg, _, name = target.partition("/")
        fvg = self._vg(vg)
        lv = fvg.lvs.get(name) if name else None
        if lv is None and must_exist:
            raise _Fail(5, f'  Failed to find logical volume "{target}"\n')
        return fvg, name, lv

    def _report(self, argv: Sequence[str], *,
                selectable: bool = False) -> tuple[list[str], list[str], list[str] | None]:
        """(fields, operands, the LV names of a --select or None)."""
        opts, pos = _options(argv, {"--reportformat", "--units", "--config", "-o", "--select"},
                             {"--nosuffix"})
        if (opts.get("--reportformat") != ["json"] or opts.get("--units") != ["b"]
                or "--nosuffix" not in opts or "-o" not in opts
                or 'report/time_format="%s"' not in opts.get("--config", [])):
            raise AssertionError(f"FakeHost only reports JSON in bytes with epoch times: {argv!r}")
        if not pos:
            raise AssertionError(f"FakeHost reports named VGs only (no operand): {argv!r}")
        if len(pos) > 1 and any("/" in p for p in pos):
            raise AssertionError(f"FakeHost reports one VG/LV, or VGs: {argv!r}")
        names = None
        if "--select" in opts:
            if not selectable or "/" in pos[0] or len(opts["--select"]) != 1:
                raise AssertionError(f"FakeHost does not simulate this --select: {argv!r}")
            names = []
            for part in opts["--select"][0].split(" || "):
                m = re.fullmatch(r'lv_name="([A-Za-z0-9+_.][A-Za-z0-9+_.-]*)"', part)
                if m is None:
                    raise AssertionError("FakeHost only simulates --select "
                                         f"'lv_name=\"a\" || lv_name=\"b\"': {argv!r}")
                names.append(m.group(1))
        return opts["-o"][-1].split(","), pos, names

    def _present(self, operands: list[str]) -> tuple[list[FakeVg], list[str]]:
        """The VGs named (each once, as LVM processes them) and those missing."""
        found, missing = [], []
        for name in dict.fromkeys(operands):
            fvg = self.vgs.get(name)
            if fvg is None or not fvg.present:
                missing.append(name)
            else:
                found.append(fvg)
        return found, missing

    def _lvs(self, argv: Sequence[str]) -> str:
        fields, operands, names = self._report(argv, selectable=True)
        rows: list[FakeLv]
        missing: list[str]
        if "/" in operands[0]:
            lv = self._target(operands[0])[2]
            assert lv is not None  # _target refuses a missing one
            rows, missing = [lv], []
        else:
            found, missing = self._present(operands)
            rows = sorted((lv for fvg in found for lv in fvg.lvs.values()
                           if names is None or lv.name in names),
                          key=lambda lv: (lv.vg, lv.name))
        lv_rows = [self._row(lv, fields, argv) for lv in rows]
        out = json.dumps({"report": [{"lv": lv_rows}]}, indent=4) + "\n"
        if missing:
            # LVM reports the VGs it found, then fails for the others.
            raise _Fail(5, "".join(_vg_not_found(vg) for vg in missing), out)
        return out

    def _pvs(self, argv: Sequence[str]) -> str:
        # Each present VG's one PV, while `pv_metadata` says the PVs can be
        # read; else none: the committed-metadata reader then finds nothing,
        # and every read is LVM's (these fakes').
        rows = [{"pv_name": pv_metadata.pv_path(fvg.name), "vg_name": fvg.name,
                 "pv_uuid": pv_metadata.lvm_id(fvg.name, "pv")}
                for fvg in sorted(self.vgs.values(), key=lambda v: v.name)
                if fvg.present and self.pv_metadata]
        return json.dumps({"report": [{"pv": rows}]}) + "\n"

    # What is read without a process: the PVs' bytes and device-mapper.

    def read_device(self, path: str, offset: int, length: int) -> bytes:
        """A present VG's PV holds its metadata (pv_metadata.py); a detached
        one, or any other device, has no bytes to read here."""
        for fvg in self.vgs.values():
            if path == pv_metadata.pv_path(fvg.name) and fvg.present:
                if fvg.pv_unreadable:
                    raise OSError(errno.EIO, os.strerror(errno.EIO), path)
                return pv_metadata.pv_bytes(fvg, offset, length)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

    def _dm_table(self) -> dict[str, tuple[int, str, str, FakeLv | None]]:
        """{name: (minor, target type, status, its LV)} of every device-mapper
        device: each active LV of a present VG as LVM names and stacks it
        (storage/lv_devices.py), and each dm-crypt device."""
        table: dict[str, tuple[int, str, str, FakeLv | None]] = {}
        for (vg, name), lv in self.all_lvs().items():
            if not lv.active or not self.vgs[vg].present:
                continue
            base = f"{vg.replace('-', '--')}-{name.replace('-', '--')}"
            if lv.kind == "thin":
                table[base] = (lv.minor, "thin", self._thin_status(lv), lv)
                continue
            table[f"{base}_tdata"] = (_TDATA_MINOR + lv.minor, "linear", "", None)
            table[f"{base}_tmeta"] = (_TMETA_MINOR + lv.minor, "linear", "", None)
            if self._pool_by_dm_name(f"{base}-tpool") is lv:  # stacked under a linear layer
                table[f"{base}-tpool"] = (lv.minor, "thin-pool", self._pool_status(lv), lv)
                table[base] = (_LINEAR_MINOR + lv.minor, "linear", "", lv)
            else:
                table[base] = (lv.minor, "thin-pool", self._pool_status(lv), lv)
        for name, mapper in self.mappers.items():
            table[name] = (mapper.minor, "crypt", "", None)
        return table

    def dm_devices(self) -> dict[str, tuple[int, int]]:
        return {name: (DM_MAJOR, minor) for name, (minor, _, _, _) in self._dm_table().items()}

    def dm_device(self, name: str) -> DmDevice | None:
        found = self._dm_table().get(name)
        if found is None:
            return None
        minor, _, _, lv = found
        opened = lv is not None and lv.kind == "thin" and self._lv_open(lv)
        return DmDevice(DM_MAJOR, minor, int(opened), live=True, suspended=False)

    def dm_status(self, name: str) -> list[Target] | None:
        found = self._dm_table().get(name)
        if found is None:
            return None
        _, kind, status, lv = found
        return [Target(0, (lv.size if lv is not None else 0) // 512, kind, status)]

    def _vgs(self, argv: Sequence[str]) -> str:
        fields, operands, _ = self._report(argv)
        if any("/" in p for p in operands):
            raise AssertionError(f"FakeHost: vgs of VGs only: {argv!r}")
        found, missing = self._present(operands)
        rows = []
        for fvg in sorted(found, key=lambda v: v.name):
            values = {"vg_name": fvg.name, "vg_size": str(fvg.size),
                      "vg_free": str(fvg.free), "vg_extent_size": str(fvg.extent)}
            if not set(fields) <= set(values):
                raise AssertionError(f"FakeHost does not report {fields!r} in {argv!r}")
            rows.append({f: values[f] for f in fields})
        out = json.dumps({"report": [{"vg": rows}]}) + "\n"
        if missing:
            raise _Fail(5, "".join(_vg_not_found(vg) for vg in missing), out)
        return out

    @staticmethod
    def _new_name(fvg: FakeVg, opts: dict[str, list[str]], argv: Sequence[str]) -> str:
        name = opts.get("--name", [""])[-1]
        if not name:
            raise AssertionError(f"FakeHost needs --name in {argv!r}")
        if name in fvg.lvs:
            raise _Fail(5, f'  Logical Volume "{name}" already exists in volume group '
                           f'"{fvg.name}"\n')
        return name

    def _lvcreate(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--virtualsize", "--name", "--setactivationskip",
                                    "--activate", "--addtag", "--type", "--extents",
                                    "--readahead", "--setautoactivation"},
                             {"--yes", "--thin", "--snapshot"})
        (target,) = _one(pos, argv)
        tags = set(opts.get("--addtag", []))
        readahead = opts.get("--readahead", ["auto"])[-1]
        if readahead not in ("auto", "none") and not readahead.isdigit():
            raise _Fail(3, f"  Invalid argument for --readahead: {readahead}\n")
        if "--setautoactivation" in opts and opts.get("--type") != ["thin-pool"]:
            # lvm2 2.03 (Debian 12), before it opens the VG: thin volumes and
            # snapshots take no --setautoactivation.
            kind = "snapshots" if "--snapshot" in opts else "thins"
            raise _Fail(3, f"  Option --setautoactivation is unsupported with {kind}.\n")
        if opts.get("--type") == ["thin-pool"]:
            if "/" in target:
                raise AssertionError(f"FakeHost makes a thin pool in a VG operand: {argv!r}")
            fvg = self._vg(target)
            pct = int(opts["--extents"][-1].removesuffix("%VG"))
            size = fvg.size * pct // 100 // fvg.extent * fvg.extent
            self._new_lv(fvg, FakeLv(self._new_name(fvg, opts, argv), size, "pool", tags))
            return ""
        if "--thin" in opts and "--virtualsize" in opts:
            fvg, pool_name, pool = self._target(target)
            if pool is None or pool.kind != "pool":
                raise _Fail(5, f"  Logical volume {target} is not a thin pool.\n")
            size = _round_up(_size(opts["--virtualsize"][-1], argv), fvg.extent)
            origin, content, default_skip = "", Content(), "n"
            src = None
        elif "--snapshot" in opts:
            fvg, _, src = self._target(target)
            assert src is not None and src.kind == "thin", f"FakeHost: thin snapshots only {argv}"
            numbers = (DM_MAJOR, src.minor)
            if src.active and numbers in self.frozen and not self.nested_freeze:
                name = f"{fvg.name}-{src.name}"
                raise _Fail(5, f"  device-mapper: suspend ioctl on  ({DM_MAJOR}:{src.minor}) "
                               "failed: Device or resource busy\n"
                               f"  Unable to suspend {name} ({DM_MAJOR}:{src.minor})\n"
                               f"  Failed to suspend thin snapshot origin {target}.\n")
            pool_name, size, origin = src.pool, src.size, src.name
            # A deep copy: a LUKS2 header's data area is copied with it.
            content, default_skip = copy.deepcopy(src.content), "y"
        else:
            raise AssertionError(f"FakeHost does not simulate {argv!r}")
        skip = opts.get("--setactivationskip", [default_skip])[-1] == "y"
        # LVM leaves an LV with the skip flag inactive, even with --activate y.
        active = opts.get("--activate", ["y"])[-1] == "y" and not skip
        lv = FakeLv(self._new_name(fvg, opts, argv), size, "thin", tags, active, skip,
                    pool_name, origin, content=content, readahead=readahead,
                    chunks=dict(src.chunks) if origin and src is not None else {})
        text = len(pv_metadata.vg_text(fvg, [*fvg.lvs.values(), lv]))
        limit = vg_text.max_text_size(fvg.mda_size)
        if text > limit:  # as lvm2's _vg_write_raw refuses it, nothing made
            raise _Fail(5, f"  VG {fvg.name} 9 metadata on /dev/fake ({text} bytes) exceeds "
                           f"maximum metadata size ({limit} bytes)\n"
                           f"  Failed to write VG {fvg.name}.\n")
        self._new_lv(fvg, lv)
        return f'  Logical volume "{lv.name}" created.\n'

    def _lvextend(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--size", "--poolmetadatasize"})
        fvg, _, lv = self._target(_one(pos, argv)[0])
        assert lv is not None and ("--size" in opts or "--poolmetadatasize" in opts), \
            f"FakeHost: {argv!r}"
        extent = fvg.extent
        if "--poolmetadatasize" in opts:  # always relative here: "+Nb"
            assert lv.kind == "pool", f"FakeHost: {argv!r}"
            add = _round_up(_size(opts["--poolmetadatasize"][-1].lstrip("+"), argv), extent)
            self._take_from_vg(fvg, add)
            lv.metadata_size += add
            lv.metadata_percent = lv.metadata_percent * (lv.metadata_size - add) \
                / lv.metadata_size
            return f"  Logical volume {fvg.name}/{lv.name}_tmeta successfully resized.\n"
        raw = opts["--size"][-1]
        if raw.startswith("+"):
            new = _round_up(lv.size + _size(raw[1:], argv), extent)
        else:
            new = _round_up(_size(raw, argv), extent)
        if lv.kind == "pool" and new > lv.size:
            self._take_from_vg(fvg, new - lv.size)
            lv.data_percent = lv.data_percent * lv.size / new
        if new <= lv.size:
            e_new, e_old = new // extent, lv.size // extent
            verb = "matches" if new == lv.size else "not larger than"
            raise _Fail(5, f"  New size ({e_new} extents) {verb} existing size ({e_old} "
                           "extents).\n")
        lv.size = new
        return f"  Logical volume {fvg.name}/{lv.name} successfully resized.\n"

    @staticmethod
    def _take_from_vg(fvg: FakeVg, size: int) -> None:
        """Room in the VG for a pool to grow by `size` bytes, as lvextend checks it."""
        if size > fvg.free:
            raise _Fail(5, f"  Insufficient free space: {size // fvg.extent} extents needed, "
                           f"but only {fvg.free // fvg.extent} available\n")

    def _lvremove(self, argv: Sequence[str]) -> str:
        _, pos = _options(argv, (), {"--yes"})
        fvg, name, lv = self._target(_one(pos, argv)[0])
        assert lv is not None
        if lv.kind == "pool" and any(x.pool == name for x in fvg.lvs.values()):
            raise AssertionError(f"FakeHost does not remove a pool with thin volumes: {argv!r}")
        if self._lv_open(lv):
            raise _Fail(5, f"  Logical volume {fvg.name}/{name} in use.\n")
        del fvg.lvs[name]
        for other in fvg.lvs.values():
            if other.origin == name:
                other.origin = ""  # a thin snapshot outlives its origin
        return f'  Logical volume "{name}" successfully removed.\n'

    def _lvchange(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--addtag", "--deltag", "--activate", "--setactivationskip",
                                    "--errorwhenfull"}, {"--ignoreactivationskip"})
        fvg, name, lv = self._target(_one(pos, argv)[0])
        assert lv is not None
        lv.tags |= set(opts.get("--addtag", []))
        lv.tags -= set(opts.get("--deltag", []))
        if "--setactivationskip" in opts:
            lv.skip = opts["--setactivationskip"][-1] == "y"
        want = opts.get("--activate", [""])[-1]
        if want == "y" and not lv.active and (not lv.skip or "--ignoreactivationskip" in opts):
            self._activate(lv)
        elif want == "n" and lv.active:
            if self._lv_open(lv):
                raise _Fail(5, f"  Logical volume {fvg.name}/{name} in use.\n")
            lv.active, lv.minor = False, -1
        return ""

    def _vgcreate(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--metadatasize"}, {"--yes"})
        vg, device = _one(pos, argv, 2)
        fvg = self.vgs.get(vg)
        if fvg is not None and fvg.present:
            raise _Fail(5, f"  A volume group called {vg} already exists.\n")
        dev = self._need_device(device, 5, "  No device found for {d}.")
        if fvg is None:
            fvg = self.add_vg(vg, pool=None, present=False)
        fvg.size = dev.size // fvg.extent * fvg.extent
        fvg.present = True
        if "--metadatasize" in opts:
            fvg.mda_size = _size(opts["--metadatasize"][-1], argv)
        return f'  Volume group "{vg}" successfully created\n'

    def _vgchange(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--activate"})
        fvg = self._vg(_one(pos, argv)[0])
        assert opts.get("--activate") == ["y"], f"FakeHost: {argv!r}"
        for lv in fvg.lvs.values():
            if not lv.active and not lv.skip:
                self._activate(lv)
        return ""

    def _pool_by_dm_name(self, name: str) -> FakeLv | None:
        """The active thin pool whose thin-pool target is dm device `name`:
        "<vg>-<pool>-tpool" while a thin volume of it is active, else
        "<vg>-<pool>", as LVM stacks it."""
        for (vg, lv_name), lv in self.all_lvs().items():
            if lv.kind != "pool" or not lv.active or not self.vgs[vg].present:
                continue
            base = f"{vg.replace('-', '--')}-{lv_name.replace('-', '--')}"
            stacked = any(x.active and x.pool == lv_name for x in self.vgs[vg].lvs.values())
            if name == (f"{base}-tpool" if stacked else base):
                return lv
        return None

    def _pool_by_tmeta(self, path: str) -> FakeLv:
        for (vg, lv_name), lv in self.all_lvs().items():
            base = f"{vg.replace('-', '--')}-{lv_name.replace('-', '--')}"
            if lv.kind == "pool" and lv.active and path == f"/dev/mapper/{base}_tmeta":
                return lv
        raise _Fail(1, f"{path}: No such file or directory\n")

    def _dmsetup(self, argv: Sequence[str]) -> str:
        if len(argv) < 3 or argv[1] not in ("status", "message"):
            raise AssertionError(f"FakeHost does not simulate {argv!r}")
        pool = self._pool_by_dm_name(argv[2])
        if pool is None:
            raise _Fail(1, "Device does not exist.\nCommand failed.\n")
        if argv[1] == "status":
            return f"0 {pool.size // 512} thin-pool {self._pool_status(pool)} \n"
        if tuple(argv[3:]) == ("0", "reserve_metadata_snap"):
            if pool.held:
                raise _Fail(1, f"device-mapper: message ioctl on {argv[2]}  failed: Device or "
                               "resource busy\nCommand failed.\n")
            pool.held = True
            pool.held_root += 1
            return ""
        if tuple(argv[3:]) == ("0", "release_metadata_snap"):
            if not pool.held:
                raise _Fail(1, f"device-mapper: message ioctl on {argv[2]}  failed: Invalid "
                               "argument\nCommand failed.\n")
            pool.held = False
            return ""
        raise AssertionError(f"FakeHost does not simulate {argv!r}")

    def _thin_device(self, pool: FakeLv, dev_id: str) -> FakeLv | None:
        return next((x for x in self.vgs[pool.vg].lvs.values()
                     if x.pool == pool.name and str(x.thin_id) == dev_id), None)

    @staticmethod
    def _superblock(pool: FakeLv, body: str) -> str:
        return (f'<superblock uuid="" time="1" transaction="7" flags="0" version="2" '
                f'data_block_size="{pool.chunk_size // 512}" nr_data_blocks="0">\n{body}'
                "</superblock>\n")

    def _thin_dump(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--dev-id"}, {"--metadata-snap"})
        pool = self._pool_by_tmeta(_one(pos, argv)[0])
        assert "--metadata-snap" in opts, f"FakeHost: a live pool's metadata read live {argv!r}"
        if not pool.held:
            raise _Fail(1, "no current metadata snap\n")
        (dev_id,) = opts["--dev-id"]
        lv = self._thin_device(pool, dev_id)
        if lv is None:
            return self._superblock(pool, "")
        lines = [f'  <device dev_id="{dev_id}" mapped_blocks="{len(lv.chunks)}" '
                 'transaction="1" creation_time="1" snap_time="1">\n']
        # thin_dump joins runs contiguous in both the device and the data.
        items = sorted(lv.chunks.items())
        i = 0
        while i < len(items):
            j = i
            while (j + 1 < len(items) and items[j + 1][0] == items[j][0] + 1
                   and items[j + 1][1] == items[j][1] + 1):
                j += 1
            if j == i:
                lines.append(f'    <single_mapping origin_block="{items[i][0]}" '
                             f'data_block="{items[i][1]}" time="0"/>\n')
            else:
                lines.append(f'    <range_mapping origin_begin="{items[i][0]}" '
                             f'data_begin="{items[i][1]}" length="{j - i + 1}" time="0"/>\n')
            i = j + 1
        lines.append("  </device>\n")
        return self._superblock(pool, "".join(lines))

    def _thin_delta(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--snap1", "--snap2"}, {"--metadata-snap"})
        pool = self._pool_by_tmeta(_one(pos, argv)[0])
        assert "--metadata-snap" in opts, f"FakeHost: a live pool's metadata read live {argv!r}"
        if not pool.held:
            raise _Fail(1, "no current metadata snap\n")
        (a_id,), (b_id,) = opts["--snap1"], opts["--snap2"]
        a, b = self._thin_device(pool, a_id), self._thin_device(pool, b_id)
        if a is None or b is None:
            raise _Fail(1, f"Unable to find mapping tree for snap{1 if a is None else 2} "
                           f"({a_id if a is None else b_id})\n")

        def kind(chunk: int) -> str:
            left, right = a.chunks.get(chunk), b.chunks.get(chunk)
            if left is None:
                return "right_only"
            if right is None:
                return "left_only"
            return "same" if left == right else "different"

        runs: list[list[object]] = []
        for chunk in sorted(set(a.chunks) | set(b.chunks)):
            k = kind(chunk)
            if runs and runs[-1][0] == k and runs[-1][1] + runs[-1][2] == chunk:  # type: ignore[operator]
                runs[-1][2] += 1  # type: ignore[operator]
            else:
                runs.append([k, chunk, 1])
        body = "".join(f'    <{k} begin="{begin}" length="{n}"/>\n' for k, begin, n in runs)
        return self._superblock(pool, f'  <diff left="{a_id}" right="{b_id}">\n{body}  </diff>\n')
