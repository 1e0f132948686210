"""The VGs as committed on their PVs: what `lvs` would answer, read off the
disks (csi_local.storage.vg_text parses the text) and asked of
device-mapper (csi_local.storage.lv_devices), both through the Kernel, with
no LVM process per read (one `pvs`, run through storage.lvm, says where
the PVs are). The hot paths (a lookup, a capacity
check, a listing) use it, and fall back to storage.lvm's commands whenever
it cannot answer for certain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from csi_local.errors import CommandError, StorageError
from csi_local.storage import vg_text
from csi_local.storage.lv_devices import dm_name, pool_usage
from csi_local.storage.lvm import (
    LogicalVolume,
    MetadataArea,
    VgReport,
    VolumeGroup,
    metadata_warnings,
    pvs_by_vg,
)

if TYPE_CHECKING:
    from csi_local.host.device_mapper import PoolUsage
    from csi_local.host.kernel import Kernel
    from csi_local.host.runner import Runner

log = logging.getLogger(__name__)


class CommittedMetadata:
    """LVs as the VGs' committed metadata records them and the kernel shows
    them: read off the PVs and asked of device-mapper, with no process (see
    csi_local.storage.vg_text). For the hot paths that only need to find one LV;
    None whenever it cannot answer for certain, and the caller asks `lvs`.

    The PVs of each VG come from one `pvs`, at first use and again (at most
    every REFRESH seconds) when the known PVs of a VG do not answer for
    certain: a PV added, removed or renamed under a new device node. A PV
    once seen in the VG is still read after (see _physical_volumes)."""

    REFRESH = 30.0

    def __init__(self, runner: Runner, host: Kernel) -> None:
        self.runner = runner
        self.host = host  # the PVs' bytes and device-mapper's devices
        self._lock = threading.Lock()
        self._pvs: dict[str, list[tuple[str, str]]] | None = None  # vg -> [(path, uuid)]
        self._read_at = 0.0
        # vg -> the last text read and what it says: a VG that did not change
        # since is not parsed again, and one that did parses its new sections.
        self._parsed: dict[str, tuple[bytes, vg_text.VgMetadata]] = {}
        # vg -> held while its whole text is parsed (see _parse_whole).
        self._parsing: dict[str, threading.Lock] = {}
        self._problems: dict[str, tuple[str, ...]] = {}
        self._areas: dict[str, MetadataArea] = {}
        # (vg, with devices or not) -> the LVs its last listing or report built,
        # taken again while nothing they were built from changed (_listed_lvs).
        self._built: dict[tuple[str, bool], _BuiltLvs] = {}

    def _physical_volumes(self, refresh: bool) -> dict[str, list[tuple[str, str]]]:
        with self._lock:
            stale = refresh and time.monotonic() - self._read_at >= self.REFRESH
            if self._pvs is None or stale:
                self._read_at = time.monotonic()
                pvs = pvs_by_vg(self.runner)
                # A PV once the VG's is still read: `pvs` leaves out one whose
                # copy is outdated (LVM ignores it, and warns), and it may come
                # back. One whose label says another ID now is skipped at read.
                # A missing PV is listed as "[unknown]": where it was is kept.
                for vg, known in (self._pvs or {}).items():
                    listed = pvs.setdefault(vg, [])
                    where = {uuid: path for path, uuid in listed}
                    for path, uuid in known:
                        if uuid not in where:
                            listed.append((path, uuid))
                        elif path.startswith("/") and not where[uuid].startswith("/"):
                            listed[:] = [(path if u == uuid else p, u) for p, u in listed]
                self._pvs = pvs
            return self._pvs

    def volume_group(self, vg: str, only: Collection[str] | None = None
                     ) -> vg_text.VgMetadata | None:
        """VG `vg`'s committed metadata, when every copy on its PVs agrees;
        None otherwise (the caller asks LVM, which reads them all too).

        `only`: the caller needs just the LVs of these names (the plugin's
        start: its pools, its staged volumes), and gets a view whose `lvs`
        holds those of them the VG has, nothing else (vg_text.vg_metadata).
        Only their sections are parsed, unless the whole text is parsed
        already; the whole parse is left to the first read that needs every
        LV (the plugin's warm-up just after its start, Pools.warm; a listing,
        a capacity check), and only it is kept.

        As LVM: every metadata area of every PV of the VG is read, and the
        copy with the highest seqno is the VG's. PVs that copy does not list
        are none of the VG's (one taken out while it was away still holds
        the old copy). Whenever a listed PV is missing, or a copy is older
        or differs, LVM's own answer is taken (its warnings, its repair):
        problems() says why."""
        for refresh in (False, True):
            try:
                pvs = self._physical_volumes(refresh).get(vg, [])
            except CommandError:
                return None
            meta, problems = self._examine(vg, pvs, only)
            with self._lock:
                self._problems[vg] = tuple(problems)
            if meta is not None:
                return meta
        return None

    def problems(self, vg: str) -> tuple[str, ...]:
        """Why the last read of `vg` could not answer from its committed
        metadata (a PV missing, a copy outdated or differing); () when it
        could, or when `vg` was never read."""
        with self._lock:
            return self._problems.get(vg, ())

    def check(self, vg: str, *, ask_lvm: bool = False, attempts: int = 3,
              pause: float = 0.2) -> tuple[str, ...]:
        """problems() of a fresh read, for reports (status, doctor, metrics): a
        copy older than another for the instant LVM takes to commit a change
        to each PV in turn is no problem, so one is only reported when it
        lasts `attempts` reads.

        `ask_lvm`: LVM's own warnings of the VG's metadata too, from one
        `vgs`. `pvs` does not list a PV whose outdated copy LVM ignores, so
        a reader that never saw it there cannot tell; LVM reads every
        device and says so."""
        problems: tuple[str, ...] = ()
        for attempt in range(attempts):
            if self.volume_group(vg) is not None:
                break
            if attempt + 1 < attempts:
                time.sleep(pause)
        else:
            problems = self.problems(vg)
        if ask_lvm:
            problems += tuple(w for w in metadata_warnings(self.runner, vg)
                              if w not in problems)
        return problems

    def _examine(self, vg: str, pvs: Sequence[tuple[str, str]],
                 only: Collection[str] | None = None
                 ) -> tuple[vg_text.VgMetadata | None, list[str]]:
        """(the newest metadata when it answers for certain, else None; the
        problems found) from the PVs `pvs` lists for `vg`; `only`: as
        volume_group()."""
        # uuid -> (path, the copies of this VG it holds: (VG ID, seqno, text)),
        # and the sizes of the areas they are in
        present: dict[str, tuple[str, list[tuple[str, int, bytes]]]] = {}
        area_sizes: dict[str, tuple[int, ...]] = {}
        unreadable: dict[str, str] = {}  # uuid -> why
        for path, uuid in pvs:
            try:
                found = vg_text.read_copies(self.host, path)
                if found.pv_uuid != uuid:
                    continue  # another PV under that node now
                copies = []
                for text in found.texts:
                    name, vg_id, seqno = vg_text.text_head(text)
                    if name == vg:
                        copies.append((vg_id, seqno, text))
                area_sizes[uuid] = found.area_sizes
            except vg_text.MetadataUnreadable as err:
                log.debug("committed metadata of %s from %s: %s", vg, path, err)
                unreadable[uuid] = str(err)
                continue
            present[uuid] = (path, copies)
        every = [c for _, copies in present.values() for c in copies]
        if not every:
            # No PV known (a VG not found, devices that cannot be read): `lvs`
            # says so, and the checks of the VG itself report it.
            return None, []
        newest = max(seqno for _, seqno, _ in every)
        texts = {text for _, seqno, text in every if seqno == newest}
        if len(texts) != 1:
            return None, [f"VG {vg}: copies of metadata seqno {newest} differ"]
        (text,) = texts
        cached = self._parsed.get(vg)
        try:
            if cached is not None and cached[0] == text:
                meta = cached[1]
            elif only is not None:  # a partial view: not kept as the VG's
                meta = vg_text.vg_metadata(text, cached[1] if cached is not None else None,
                                                only=only)
            else:  # only the LVs whose sections changed are parsed
                meta = self._parse_whole(vg, text)
        except vg_text.MetadataUnreadable as err:
            return None, [f"VG {vg}: metadata seqno {newest}: {err}"]
        if meta.name != vg:
            return None, [f"VG {vg}: its newest metadata names VG {meta.name}"]
        paths = {uuid: path for path, uuid in pvs}
        problems: list[str] = []
        # A PV that the newest copy does not list is not the VG's: unreadable,
        # it is no problem of the VG's; holding an old copy, it is (lvs warns).
        for uuid in sorted(meta.pv_uuids):
            where = f" ({paths[uuid]})" if uuid in paths else ""
            if uuid in unreadable:
                problems.append(f"PV {uuid}{where} of VG {vg} cannot be read: "
                                f"{unreadable[uuid]}")
            elif uuid in meta.missing_pvs or uuid not in present:
                problems.append(f"PV {uuid}{where} of VG {vg} is missing")
        for uuid, (path, copies) in present.items():
            old = sorted({seqno for vg_id, seqno, _ in copies
                          if seqno != newest or vg_id != meta.uuid})
            if not old:
                continue
            if uuid not in meta.pv_uuids:
                problems.append(f"PV {path} is not in VG {vg} (metadata seqno {newest}) but "
                                f"holds its outdated metadata (seqno {old[0]})")
            else:
                problems.append(f"PV {path} has outdated metadata of VG {vg} (seqno "
                                f"{old[0]}, newest {newest})")
        if not problems:
            # Every area in use of every PV of the VG holds this text (no
            # problem found), and LVM writes the next one to each of them.
            sizes = [size for uuid in meta.pv_uuids for size in area_sizes.get(uuid, ())]
            if sizes:
                with self._lock:
                    self._areas[vg] = MetadataArea(min(sizes), len(text))
        return (None if problems else meta), problems

    def _parse_whole(self, vg: str, text: bytes) -> vg_text.VgMetadata:
        """`text` parsed whole (the sections that changed since the kept parse)
        and kept as `vg`'s. One parse of a VG at a time: readers that meet the
        same new text together (the warm-up after the start, Pools.warm, and
        the first listing) parse it once; the others wait for it and take it."""
        with self._lock:
            parsing = self._parsing.setdefault(vg, threading.Lock())
        with parsing:
            cached = self._parsed.get(vg)
            if cached is not None and cached[0] == text:
                return cached[1]
            meta = vg_text.vg_metadata(text, cached[1] if cached is not None else None)
            self._parsed[vg] = (text, meta)  # text and parse replaced together
            return meta

    def space(self, vg: str) -> VolumeGroup | None:
        """What `Lvm.volume_group()` (one `vgs`) answers: the VG's size and free
        bytes, from the extents its PVs hold and those its LVs map on them.
        None when the metadata does not answer."""
        meta = self.volume_group(vg)
        if meta is None or meta.pe_count <= 0:
            return None
        used = sum(lv.pv_extents for lv in meta.lvs.values())
        extent = meta.extent_size
        return VolumeGroup(vg, meta.pe_count * extent, (meta.pe_count - used) * extent, extent)

    def metadata_area(self, vg: str) -> MetadataArea | None:
        """The tightest metadata area of `vg` as its last read found it (no
        I/O; None when no read of it answered)."""
        with self._lock:
            return self._areas.get(vg)

    def report(self, vg: str, pool: str) -> VgReport | None:
        """What `Lvm.report()` answers for capacity and idempotency checks:
        every LV of `vg` with its size, tags, thin pool and origin, and the
        thin pool `pool` with its usage as the kernel reports it. The thin
        volumes carry no kernel state (shown inactive, with no device): a
        caller that acts on a volume's device reads it another way. None when
        the metadata or the pool's status does not answer."""
        meta = self.volume_group(vg)
        if meta is None:
            return None
        usages = _pool_usages(self.host, vg, [pool] if pool in meta.lvs else [])
        if usages is None:
            return None
        return VgReport(tuple(_listed_lvs(vg, meta, usages, None, self._built_lvs(vg, False))),
                        meta.extent_size,
                        self.metadata_area(vg))

    def listing(self, vgs: Sequence[str]) -> list[LogicalVolume] | None:
        """Every LV of `vgs` as `lvs VG...` lists them, for the calls that
        read many volumes (ListVolumes, ListSnapshots, the state's recovery
        at start): sizes, tags, pools and origins from the metadata; which
        LVs are active, and their devices, from one list of the kernel's
        devices; each thin pool's usage and health from its status. Not
        read, and shown as not: whether a volume is open, and how much of a
        thin volume is mapped (data_percent). None when a VG, its pools or
        the kernel do not answer."""
        metas = []
        for vg in vgs:
            meta = self.volume_group(vg)
            if meta is None:
                return None
            metas.append((vg, meta))
        try:
            devices = self.host.dm_devices()
        except (StorageError, ValueError) as err:
            log.debug("device-mapper device list: %s", err)
            return None
        out: list[LogicalVolume] = []
        for vg, meta in metas:
            pools = [m.name for m in meta.lvs.values() if m.segment_type == "thin-pool"]
            usages = _pool_usages(self.host, vg, pools)
            if usages is None:
                return None
            out += _listed_lvs(vg, meta, usages, devices, self._built_lvs(vg, True))
        return out

    def _built_lvs(self, vg: str, with_devices: bool) -> _BuiltLvs:
        with self._lock:
            return self._built.setdefault((vg, with_devices), _BuiltLvs())

    def thin_pools(self, places: Sequence[tuple[str, str]]
                   ) -> dict[tuple[str, str], LogicalVolume | None] | None:
        """{(vg, pool): the thin pool's LV, None when the VG holds no LV of that
        name} for each of `places`, as Probe asks it, without a process. None
        when a VG or a pool's status does not answer (a missing VG among them:
        `lvs` says which)."""
        out: dict[tuple[str, str], LogicalVolume | None] = {}
        for vg in sorted({vg for vg, _ in places}):
            # Only the pools' sections: Probe and the start need no other LV.
            meta = self.volume_group(vg, only={pool for v, pool in places if v == vg})
            if meta is None:
                return None
            names = [pool for v, pool in places if v == vg and pool in meta.lvs]
            usages = _pool_usages(self.host, vg, names)
            if usages is None:
                return None
            found = {lv.name: lv for lv in _listed_lvs(vg, meta, usages, None)}
            for v, pool in places:
                if v == vg:
                    out[(vg, pool)] = found.get(pool)
        return out

    def thin_volume(self, vg: str, name: str,
                    meta: vg_text.VgMetadata | None = None) -> LogicalVolume | None:
        """Thin LV vg/name with its kernel state, or None: not found (LVM
        has the last word on absence), not a thin volume, or no answer.
        `meta`: the VG's metadata the caller has just read (not read again)."""
        meta = meta or self.volume_group(vg)
        found = meta.lvs.get(name) if meta is not None else None
        if found is None or found.segment_type != "thin" or not found.visible:
            return None
        try:
            device = self.host.dm_device(dm_name(vg, name))
        except (StorageError, ValueError) as err:  # as report(): no answer, ask lvs
            log.debug("device-mapper device of %s/%s: %s", vg, name, err)
            return None
        live = device is not None and device.live
        opened = device is not None and device.open_count > 0
        # lv_attr as lvs prints it for a thin volume: type, permissions,
        # allocation, fixed minor, state, open, target, zeroing, health, skip.
        attr = (f"Vwi-{'a' if live else '-'}{'o' if opened else '-'}tz-"
                f"{'k' if found.activation_skip else '-'}")
        return LogicalVolume(
            name=name, vg=vg, size=found.size, tags=found.tags, attr=attr, pool=found.pool,
            origin=found.origin, path=f"/dev/{vg}/{name}", data_percent=None,
            metadata_percent=None, created=found.created, health="",
            kernel_major=device.major if live and device else -1,
            kernel_minor=device.minor if live and device else -1,
            thin_id=found.device_id, uuid=found.uuid)


def _pool_usages(host: Kernel, vg: str, pools: Sequence[str]
                 ) -> dict[str, PoolUsage | None] | None:
    """{pool: its usage, None when it is not active} from each thin pool's
    status; None when one cannot be read or trusted (a failed pool: `lvs`
    tells its health)."""
    out: dict[str, PoolUsage | None] = {}
    for pool in pools:
        try:
            out[pool] = pool_usage(host, vg, pool)
        except (StorageError, ValueError) as err:
            log.debug("thin pool %s/%s status: %s", vg, pool, err)
            return None
    return out


# What _listed_lvs built for one LV: its metadata, its device-mapper name, its
# device's numbers, its pool's usage, its metadata LV's size, and the LV built.
_Built = tuple[vg_text.MetaLv, str, "tuple[int, int] | None", "PoolUsage | None", int,
               LogicalVolume]


class _BuiltLvs:
    """The LVs of a VG that the last listing built, by name (_listed_lvs)."""

    def __init__(self) -> None:
        self.lvs: dict[str, _Built] = {}


def _listed_lvs(vg: str, meta: vg_text.VgMetadata, usages: dict[str, PoolUsage | None],
                devices: dict[str, tuple[int, int]] | None,
                built: _BuiltLvs | None = None) -> list[LogicalVolume]:
    """The visible LVs of `meta` as `lvs` lists them. Thin pools in `usages`
    carry their usage and health (others are shown inactive); with `devices`
    (Kernel.dm_devices()), an LV with a device-mapper device is active, with its
    numbers; without, no LV but a pool is shown active.

    `built`: what the last call for this VG built, replaced by what this one
    did. An LV built from the same metadata object (an unchanged section
    parses into the one MetaLv), device numbers, usage and metadata size is
    taken from it: at thousands of LVs, building each anew is most of a
    listing's cost under emulation, and few change between two listings."""
    last = built.lvs if built is not None else {}
    now: dict[str, _Built] = {}
    lvs = []
    for m in meta.lvs.values():
        if not m.visible:
            continue  # as `lvs VG` (no -a): a pool's _tdata and _tmeta are its own
        before = last.get(m.name)
        name = before[1] if before is not None and before[0] is m else dm_name(vg, m.name)
        numbers = None
        if devices is not None:
            # A stacked pool's device is its -tpool layer, as lvs reports it.
            numbers = (m.segment_type == "thin-pool" and devices.get(f"{name}-tpool")) \
                or devices.get(name)
        usage = usages.get(m.name) if m.segment_type == "thin-pool" else None
        metadata_size = _pool_metadata_size(meta, m)
        if before is not None and before[0] is m and before[2] == numbers \
                and before[3] == usage and before[4] == metadata_size:
            lv = before[5]
        else:
            lv = _listed_lv(vg, m, numbers, usage, metadata_size)
        now[m.name] = (m, name, numbers, usage, metadata_size, lv)
        lvs.append(lv)
    if built is not None:
        built.lvs = now  # one reference replaced: a listing beside this one reads either
    return lvs


def _listed_lv(vg: str, m: vg_text.MetaLv, numbers: tuple[int, int] | None,
               usage: PoolUsage | None, metadata_size: int) -> LogicalVolume:
    """LV `m` as `lvs` lists it, active when it has a device or a usage."""
    active = "a" if numbers is not None or usage is not None else "-"
    if m.segment_type == "thin":
        attr = f"Vwi-{active}-tz-{'k' if m.activation_skip else '-'}"
    elif m.segment_type == "thin-pool":
        attr = f"twi-{active}-tz{_pool_health(usage)[0]}-"
    else:
        attr = f"-wi-{active}-----"
    return LogicalVolume(
        name=m.name, vg=vg, size=m.size, tags=m.tags, attr=attr, pool=m.pool,
        origin=m.origin,
        path="" if m.segment_type == "thin-pool" else f"/dev/{vg}/{m.name}",
        data_percent=_percent(usage.data_used, usage.data_total) if usage else None,
        metadata_percent=_percent(usage.metadata_used, usage.metadata_total)
        if usage else None,
        created=m.created,
        health=_pool_health(usage)[1] if m.segment_type == "thin-pool" else "",
        kernel_major=numbers[0] if numbers is not None else -1,
        kernel_minor=numbers[1] if numbers is not None else -1,
        metadata_size=metadata_size, thin_id=m.device_id, uuid=m.uuid,
        chunk_size=m.chunk_size)


def _pool_health(usage: PoolUsage | None) -> tuple[str, str]:
    """(lv_attr's health character, lv_health_status) of a thin pool, as lvs
    derives them from its status (lvm2's report.c; a failed pool gives no
    usage here, and the caller asks lvs)."""
    if usage is None:
        return "-", ""
    if usage.out_of_data_space:
        return "D", "out_of_data"
    if usage.read_only:
        return "M", "metadata_read_only"
    return "-", ""


def _percent(used: int, total: int) -> float:
    """As lvs shows it: a percentage with two decimals."""
    return round(100.0 * used / total, 2) if total else 0.0


def _pool_metadata_size(meta: vg_text.VgMetadata, lv: vg_text.MetaLv) -> int:
    """A thin pool's metadata LV's size (lv_metadata_size); 0 for other LVs."""
    if lv.segment_type != "thin-pool" or not lv.metadata_lv:
        return 0
    found = meta.lvs.get(lv.metadata_lv)
    return found.size if found is not None else 0
