"""The thin pool both plugins carve volumes from: its room, and the one lock
around every change of it.

The CSI plugin (CreateVolume, CreateSnapshot, expansion) and the Nomad host
volume plugin (create, grow) share one pool and one lock directory, so they
share this: the over-provisioning arithmetic, the "is there room" check, and
the rule that a check and the lvcreate or lvextend it allows happen under
the pool lock, against one report read under it.

The guard: thin provisioning fails every volume at once when the pool's data
or metadata fills up, so new volumes and snapshots are refused above a
high-water mark (PoolPolicy), long before that. Autoextend grows the pool
from the VG's free extents when it crosses a threshold; the plugin does it
itself because dmeventd, LVM's own autoextend, does not run in a container.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from csi_local.errors import (
    NoRoom,
    NoRoomForVolumes,
    PoolUnusable,
    UnknownDeviceClass,
    VolumeGroupMissing,
)
from csi_local.host import stopwatch
from csi_local.host.locks import Locks
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import (
    RECOMMENDED_METADATA_SIZE,
    LogicalVolume,
    Lvm,
    MetadataArea,
    VgReport,
    find_in_vgs,
    list_vgs,
)
from csi_local.volumes import sizes
from csi_local.volumes.device_classes import DeviceClass, DeviceClasses
from csi_local.volumes.known_vgs import KnownVolumeGroups
from csi_local.volumes.lock_keys import pool_key

if TYPE_CHECKING:
    from csi_local.host.runner import Runner
    from csi_local.storage.vg_text import VgMetadata

log = logging.getLogger(__name__)

# What one more thin LV or snapshot of either plugin adds to its VG's
# metadata text, at most. Its section: LVM's fixed lines (about 450 bytes,
# with numbers of 20 digits and a host name of 64 bytes) around a name of
# 127 bytes at most and the plugins' tags, whose free text is bounded
# (hex_tag: 512 bytes each; IDs 128): under 1,600 bytes in all. The change
# also rewrites the text's description line, which names the command that
# made it (the lvcreate with the same tags again; a removal's is short):
# up to COMMAND_TEXT_MAX more. A volume with the CSI sidecar's PVC tags
# adds about 500 bytes (README, "Sizes and capacity").
LV_TEXT_MAX = 2560
COMMAND_TEXT_MAX = 2560
# dm-thin's device IDs are 24 bits; LVM gives a new thin LV the pool's
# highest ID plus one and fails past this (lvm2's thin_manip.c), however
# many IDs below are free.
THIN_DEVICE_ID_MAX = (1 << 24) - 1
# Where status and doctor warn that the metadata area is filling up.
METADATA_AREA_WARN = 0.8


def lvs_that_fit(area: MetadataArea) -> int:
    """How many more thin LVs or snapshots the VG's metadata area surely takes,
    each made by one command (the largest each plugin makes)."""
    return max(0, (area.free - COMMAND_TEXT_MAX) // LV_TEXT_MAX)


def metadata_area_problem(vg: str, area: MetadataArea | None, count: int = 1) -> str | None:
    """Why `count` more LVs do not fit in VG `vg`'s metadata area, or None
    (also when the area is not known: LVM itself then has the last word)."""
    if area is None or lvs_that_fit(area) >= count:
        return None
    return (f"the metadata area of volume group {vg} is {100 * area.used_ratio:.1f}% full "
            f"({area.used} of the {area.limit} bytes of text its smallest area, "
            f"{area.size} bytes, holds), with room for {lvs_that_fit(area)} more volumes "
            f"or snapshots, {count} needed; give the VG a bigger metadata area: "
            f"`pvcreate --metadatasize {RECOMMENDED_METADATA_SIZE}` when preparing a PV, or "
            "now add such a PV "
            "(`vgextend`) and set the small area aside (`pvchange --metadataignore y` on "
            "its PV) or move off it (`pvmove`, `vgreduce`); existing volumes keep working")


def device_id_problem(pool_name: str, report: VgReport, count: int = 1) -> str | None:
    """Why `count` more thin LVs cannot get a device ID in thin pool
    `pool_name`, or None."""
    top = max((lv.thin_id for lv in report.lvs if lv.pool == pool_name and lv.thin_id >= 0),
              default=0)
    if top + count <= THIN_DEVICE_ID_MAX:
        return None
    return (f"thin pool {pool_name} has given out device ID {top}, and LVM gives a new thin "
            f"volume the highest ID plus one, up to {THIN_DEVICE_ID_MAX}: no room for {count} "
            "more volumes or snapshots until the volume with the highest ID is deleted")


@dataclass(frozen=True)
class PoolPolicy:
    """The high-water marks and autoextend settings (percentages of the pool)."""

    data_limit: float = 90.0  # no new volume or snapshot at or above this data fill
    metadata_limit: float = 90.0
    autoextend_threshold: float = 0.0  # extend at or above this fill; 0: never
    autoextend_percent: float = 20.0  # by this share of the current size

    def __post_init__(self) -> None:
        for name in ("data_limit", "metadata_limit"):
            if not 0 < getattr(self, name) <= 100:
                raise ValueError(f"{name} must be a percentage in (0, 100]")
        if not 0 <= self.autoextend_threshold < 100:
            raise ValueError("the autoextend threshold must be a percentage in [0, 100) "
                             "(0: off)")
        if self.autoextend_threshold and not 0 < self.autoextend_percent <= 1000:
            raise ValueError("the autoextend percent must be in (0, 1000]")
        if self.autoextend_threshold >= min(self.data_limit, self.metadata_limit):
            raise ValueError("the autoextend threshold must be below the high-water marks, "
                             "or new volumes are refused before the pool grows")


@dataclass(frozen=True)
class PoolCapacity:
    pool_size: int
    provisioned: int
    ratio: float
    extent_size: int

    @property
    def available(self) -> int:
        """Bytes a new volume may still take, a whole number of extents."""
        room = math.floor(self.pool_size * self.ratio) - self.provisioned
        return max(0, room // self.extent_size * self.extent_size)


def capacity_of(report: VgReport, pool_name: str, ratio: float) -> PoolCapacity:
    """The pool's size times the over-provisioning ratio, less every thin LV's
    virtual size (volumes and snapshots of both plugins, and any other user
    of the pool alike)."""
    pool = report.find(pool_name)
    if pool is None:
        raise VolumeGroupMissing(f"thin pool {pool_name} not found in the volume group")
    if not pool.is_thin_pool:
        raise PoolUnusable(f"LV {pool_name} is not a thin pool")
    provisioned = sum(lv.size for lv in report.lvs if lv.pool == pool_name and lv.is_thin_volume)
    return PoolCapacity(pool.size, provisioned, ratio, report.extent_size)


class Pool:
    """One VG's thin pool, its over-provisioning ratio, and the pool lock."""

    def __init__(self, lvm: Lvm, locks: Locks, ratio: float,
                 policy: PoolPolicy | None = None, *,
                 device_class: DeviceClass | None = None) -> None:
        self.lvm = lvm
        self.locks = locks
        self.ratio = ratio
        self.policy = policy or PoolPolicy()
        self.device_class = device_class or DeviceClass("default", lvm.vg, lvm.pool, ratio)
        # Set by Pools: where report(committed=True) reads without a process.
        self.committed: CommittedMetadata | None = None
        # Set by Pools: the record of the VGs this node has had.
        self.known_vgs: KnownVolumeGroups | None = None

    @property
    def class_name(self) -> str:
        return self.device_class.name

    @property
    def default_fs_type(self) -> str:
        return self.device_class.default_fs_type

    @property
    def encrypted_by_default(self) -> bool:
        return self.device_class.encrypted

    @property
    def name(self) -> str:
        return f"{self.lvm.vg}/{self.lvm.pool}"

    def chunk_size(self, report: VgReport) -> int:
        """The thin pool's chunk size in `report`, bytes (0: not reported)."""
        found = report.find(self.lvm.pool)
        return found.chunk_size if found is not None else 0

    def report(self, *, committed: bool = False) -> VgReport:
        """The VG's report: one `lvs`, or with `committed` the VG's committed
        metadata and the pool's kernel status when they answer (no process;
        the thin volumes then carry no kernel state, see CommittedMetadata)."""
        if committed and self.committed is not None:
            found = self.committed.report(self.lvm.vg, self.lvm.pool)
            if found is not None:
                return found
        return self.lvm.report()

    def capacity(self, report: VgReport | None = None) -> PoolCapacity:
        """The pool's capacity, from `report` or a fresh one (one `lvs`)."""
        return capacity_of(report or self.lvm.report(), self.lvm.pool, self.ratio)

    def require_room(self, report: VgReport, size: int) -> None:
        """NoRoom unless `size` more bytes fit. Call it inside `reserved()`."""
        cap = self.capacity(report)
        if size > cap.available:
            raise NoRoom(
                f"thin pool {self.name} has room for {cap.available} more bytes, {size} "
                f"requested (over-provisioning ratio {self.ratio})"
            )

    def fill_problem(self, pool: LogicalVolume | None) -> str | None:
        """Why the pool is too full for new volumes (at or above a high-water
        mark), or None."""
        if pool is None:
            return None
        found = []
        data, meta = pool.data_percent, pool.metadata_percent
        if data is not None and data >= self.policy.data_limit:
            found.append(f"data {data:.1f}% full (limit {self.policy.data_limit:g}%)")
        if meta is not None and meta >= self.policy.metadata_limit:
            found.append(f"metadata {meta:.1f}% full (limit {self.policy.metadata_limit:g}%)")
        if not found:
            return None
        return f"thin pool {self.name} is above its high-water mark: {', '.join(found)}"

    def metadata_problem(self) -> str | None:
        """Why the VG's committed metadata could not be believed at its last
        read (a PV missing, a copy outdated or differing; see
        CommittedMetadata.problems), or None. No I/O: what the read that
        served this call found."""
        if self.committed is None:
            return None
        problems = self.committed.problems(self.lvm.vg)
        return "; ".join(problems) if problems else None

    def count_problem(self, report: VgReport, count: int = 1) -> str | None:
        """Why `count` more LVs cannot be made whatever their size (the VG's
        metadata area, the pool's device IDs), or None."""
        return (metadata_area_problem(self.lvm.vg, report.metadata_area, count)
                or device_id_problem(self.lvm.pool, report, count))

    def creation_problem(self, report: VgReport, count: int = 1) -> str | None:
        """Why no new volume or snapshot may be made now, whatever its size (a
        high-water mark, count_problem), or None: what GetCapacity reports 0 for."""
        problem = self.fill_problem(report.find(self.lvm.pool))
        if problem is not None:
            return (f"{problem}; no new volumes or snapshots until it is extended or "
                    "emptied (existing volumes keep working)")
        return self.count_problem(report, count)

    def admit(self, report: VgReport, size: int, count: int = 1) -> None:
        """`count` new volumes or snapshots of `size` bytes in all may be made:
        the pool is below its high-water marks and has room, and the VG's
        metadata area and the pool's device IDs take them (NoRoom otherwise),
        before LVM would fail part-way. Inside `reserved()`."""
        problem = self.fill_problem(report.find(self.lvm.pool))
        if problem is not None:
            raise NoRoom(f"{problem}; no new volumes or snapshots until it is extended or "
                         "emptied (existing volumes keep working)")
        problem = self.count_problem(report, count)
        if problem is not None:
            raise NoRoomForVolumes(problem)
        self.require_room(report, size)

    def needs_extension(self, report: VgReport) -> bool:
        """Whether the pool's data or metadata is at or above the autoextend threshold."""
        threshold = self.policy.autoextend_threshold
        pool = report.find(self.lvm.pool)
        if not threshold or pool is None:
            return False
        return any(p is not None and p >= threshold
                   for p in (pool.data_percent, pool.metadata_percent))

    def autoextend(self) -> list[tuple[str, int]]:
        """Grow the pool's data and metadata, each by autoextend_percent of its
        size when at or above the threshold, within the VG's free space.
        Returns what grew: [("data"|"metadata", bytes)]. Under the pool lock,
        against a fresh report, so concurrent callers (the other plugin too)
        extend once."""
        grown: list[tuple[str, int]] = []
        with self.reserved() as report:
            pool = report.find(self.lvm.pool)
            threshold = self.policy.autoextend_threshold
            if pool is None or not threshold:
                return grown
            free = self.lvm.volume_group().free
            extent = report.extent_size
            share = self.policy.autoextend_percent / 100
            wanted = {
                "data": pool.size if (pool.data_percent or 0) >= threshold else 0,
                "metadata": (pool.metadata_size
                             if (pool.metadata_percent or 0) >= threshold else 0),
            }
            adds: dict[str, int] = {}
            for what, base in wanted.items():
                if not base:
                    continue
                add = min(sizes.round_up(math.ceil(base * share), extent),
                          free // extent * extent)
                if add <= 0:
                    log.error("thin pool %s: %s at or above %s%% full, and the VG has no free "
                              "extents to extend it", self.name, what, threshold)
                    continue
                adds[what] = add
                free -= add
            if adds:
                self.lvm.extend_pool(adds.get("data", 0), adds.get("metadata", 0))
                for what, add in adds.items():
                    log.warning("thin pool %s: %s extended by %d bytes (autoextend at %g%%)",
                                self.name, what, add, threshold)
                    grown.append((what, add))
        return grown

    @contextlib.contextmanager
    def reserved(self, timeout: float | None = None, *,
                 committed: bool = False) -> Iterator[VgReport]:
        """Hold the pool lock and read the VG once. Whatever is checked against
        the report and then made or grown inside the block cannot be
        overtaken by another create, in this process or the other plugin.
        `committed`: see report(); read after the lock is taken, it is as
        fresh as an `lvs` then."""
        with contextlib.ExitStack() as stack:
            with stopwatch.phase("pool lock"):
                stack.enter_context(
                    self.locks.hold(pool_key(self.lvm.vg, self.lvm.pool), timeout=timeout))
            with stopwatch.phase("report"):
                report = self.report(committed=committed)
            if self.known_vgs is not None:
                # Every volume and snapshot is made in here: its VG is on record
                # before it holds one, so its absence is never taken for "never had".
                self.known_vgs.add(self.lvm.vg)
            yield report

    def create_thin(self, report: VgReport, name: str, size: int,
                    tags: list[str]) -> LogicalVolume:
        """A new thin LV of `size` bytes, if admitted (inside `reserved()`)."""
        self.admit(report, size)
        return self.lvm.create_thin(name, size, tags, read_back=False)

    def grow(self, lv: LogicalVolume, required: int, limit: int, *,
             before: Callable[[], None] | None = None,
             timeout: float | None = None) -> LogicalVolume:
        """`lv` grown to `required` bytes (whole extents), within `limit` (0: none).

        Never shrinks (SizeOutOfRange); a volume already big enough is
        returned as it is, without taking the lock. `before` runs under the
        lock just before lvextend (the host volume plugin tags the LV there,
        so a run killed after lvextend still grows the file system).
        """
        if sizes.grow_target(lv.size, required, limit, 1) == lv.size:
            return lv
        with self.reserved(timeout) as report:
            current = report.find(lv.name) or lv
            size = sizes.grow_target(current.size, required, limit, report.extent_size)
            if size == current.size:
                return current
            self.require_room(report, size - current.size)
            if before is not None:
                before()
            return self.lvm.extend_to(current, size)


class Pools:
    """The pools of every device class of the node, and how an LV is found
    among them: by one report over the classes' VGs, its VG and thin pool
    naming its class (nothing else records it)."""

    def __init__(self, classes: DeviceClasses, runner: Runner, locks: Locks,
                 policy: PoolPolicy | None = None,
                 committed: CommittedMetadata | None = None,
                 known_vgs: KnownVolumeGroups | None = None) -> None:
        self.classes = classes
        # All classes in one VG: one `lvs` of it answers for every class. Fixed
        # for the process, like the classes, so asked once (every create asks).
        self.single_vg = len(classes.volume_groups) == 1
        self.runner = runner
        # Where find_committed reads; None: it never answers (every lookup is an `lvs`).
        self.committed = committed
        # Which missing VGs may hold volumes; None: all of them.
        self.known_vgs = known_vgs
        self._pools = {
            c.name: Pool(Lvm(runner, c.volume_group, c.thin_pool, c.lvcreate_args), locks,
                          c.overprovision_ratio, policy, device_class=c)
            for c in classes.classes
        }
        for pool in self._pools.values():
            pool.committed = committed
            pool.known_vgs = known_vgs

    @classmethod
    def of(cls, pool: Pool) -> Pools:
        """The pools of a node with this one class (tests, tools)."""
        pools = cls(DeviceClasses((pool.device_class,), pool.class_name), pool.lvm.runner,
                    pool.locks, pool.policy)
        pools._pools[pool.class_name] = pool
        return pools

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def default(self) -> Pool:
        return self._pools[self.classes.default]

    @property
    def names(self) -> list[str]:
        return list(self._pools)

    def get(self, name: str | None) -> Pool | None:
        """The pool of class `name` (None or "": the default), None if unknown."""
        return self.default if not name else self._pools.get(name)

    def select(self, name: str | None) -> Pool:
        """As get(), UnknownDeviceClass naming the known classes otherwise."""
        pool = self.get(name)
        if pool is None:
            raise UnknownDeviceClass(f"unknown device class {name!r} (this node has: "
                                     f"{', '.join(sorted(self._pools))})")
        return pool

    def of_lv(self, lv: LogicalVolume) -> Pool | None:
        """The pool (so the class) a thin LV belongs to; None for other LVs."""
        c = self.classes.of_pool(lv.vg, lv.pool)
        return self._pools[c.name] if c is not None else None


    def pool_of_copy(self, source: LogicalVolume, asked: str | None, what: str,
                     parameter: str) -> Pool:
        """The pool of anything made from `source` (a restore, a clone, a
        snapshot): the source's own, since a thin snapshot lives in its
        origin's pool. UnknownDeviceClass when `asked` (the front end's class
        parameter, `parameter`) names another class, or when the source is in
        no class of this node. The one home of this rule for both plugins."""
        pool = self.of_lv(source)
        if pool is None:
            raise UnknownDeviceClass(
                f"{what} is LV {source.vg}/{source.name} in thin pool {source.vg}/"
                f"{source.pool}, which is no device class of this node "
                f"({', '.join(sorted(self.names))}); what is made from it is made in its pool")
        if asked and asked != pool.class_name:
            raise UnknownDeviceClass(
                f"{what} is in device class {pool.class_name!r}, and what is made from it "
                f"stays there (a thin snapshot lives in its origin's pool), but {parameter} "
                f"asks for {asked!r}: leave {parameter} out or set it to "
                f"{pool.class_name!r}")
        return pool

    def locate(self, *names: str, required: Iterable[str] | None = None
               ) -> dict[str, tuple[Pool, LogicalVolume]]:
        """{name: (its pool, its LV)} for those of `names` that are LVs of a
        class's pool, from one `lvs`. VolumeGroupMissing when one of `required`
        (default: all) is not found and a class's VG is missing: it may be
        there, so it must never be called gone."""
        found, missing = self._read(names)
        out = self._owned(found, names)
        wanted = set(names if required is None else required)
        if missing and not wanted <= set(out):
            raise VolumeGroupMissing(
                f"volume group {', '.join(missing)} not found: the node cannot serve those "
                "volumes until it is back")
        return out

    def _read(self, names: Sequence[str]) -> tuple[list[LogicalVolume], list[str]]:
        """The LVs named `names` in the classes' VGs, from one `lvs`, and the
        missing VGs that may hold volumes."""
        if self.single_vg and len(names) == 1:
            pool = next(iter(self._pools.values()))
            missing: list[str] = []
            try:
                lv = pool.lvm.find(names[0])  # one `lvs VG/LV`, as with one class
            except VolumeGroupMissing:
                lv, missing = None, [pool.lvm.vg]
            found = [lv] if lv is not None else []
        else:
            found, missing = find_in_vgs(self.runner, self.classes.volume_groups, names)
        return found, self._known(missing)

    def read_names(self, names: Sequence[str]
                   ) -> tuple[list[tuple[Pool | None, LogicalVolume]], list[str]]:
        """Every LV named in `names` in the classes' VGs, from one `lvs`, each
        with its pool (None: in no class's thin pool; unlike locate(), kept,
        so that placement never passes over it), and the missing VGs that may
        hold others."""
        found, missing = self._read(names)
        return [(self.of_lv(lv), lv) for lv in found], missing

    def _owned(self, lvs: Iterable[LogicalVolume], names: Sequence[str]
               ) -> dict[str, tuple[Pool, LogicalVolume]]:
        """{name: (its pool, its LV)} of those of `lvs` that are named in
        `names` and are a class's LVs (the first of a name)."""
        out: dict[str, tuple[Pool, LogicalVolume]] = {}
        for lv in lvs:
            owner = self.of_lv(lv)
            if owner is not None and lv.name in names and lv.name not in out:
                out[lv.name] = (owner, lv)
        return out

    def lookup(self, names: Sequence[str]
               ) -> tuple[dict[str, tuple[Pool, LogicalVolume]], list[str]]:
        """{name: (its pool, its LV)} for those of `names` that are a class's
        LVs, and the missing VGs that may hold the others; for a few names
        among many LVs (the state's records at start), without listing the
        rest. Each from the committed metadata when it answers
        (find_committed), the others from one `lvs` selecting them by name
        (LVM has the last word on absence). Unlike locate(), a missing VG
        raises nothing: the caller decides what it means."""
        out: dict[str, tuple[Pool, LogicalVolume]] = {}
        # Each VG read once, not per name, and only these LVs' sections parsed.
        metas = self._committed_vgs(only=names) if names else None
        for name in names:
            hit = self._find_in(metas, name) if metas is not None else None
            if hit is not None:
                out[name] = hit
        rest = [name for name in names if name not in out]
        if not rest:
            return out, []
        found, missing = self._read(rest)
        out.update(self._owned(found, rest))
        return out, missing

    def find(self, name: str) -> tuple[Pool, LogicalVolume] | None:
        return self.locate(name).get(name)

    def find_committed(self, name: str) -> tuple[Pool, LogicalVolume] | None:
        """find() of a thin volume that exists, without a process: from the
        classes' VGs' committed metadata and the kernel. None when that does
        not answer for certain (no reader, a VG unreadable, the name in no VG
        or in more than one, not a class's thin volume): then ask find()."""
        metas = self._committed_vgs()
        return self._find_in(metas, name) if metas is not None else None

    def _committed_vgs(self, only: Sequence[str] | None = None
                       ) -> list[tuple[str, VgMetadata]] | None:
        """Each class's VG with its committed metadata (one read of each; `only`:
        of just the LVs of these names, CommittedMetadata.volume_group); None
        when there is no reader or a VG does not answer."""
        if self.committed is None:
            return None
        metas = []
        for vg in self.classes.volume_groups:
            meta = self.committed.volume_group(vg, only=only)
            if meta is None:
                return None
            metas.append((vg, meta))
        return metas

    def _find_in(self, metas: list[tuple[str, VgMetadata]], name: str
                 ) -> tuple[Pool, LogicalVolume] | None:
        """find_committed() of `name` in the VGs' metadata `metas`."""
        assert self.committed is not None  # metas came from it
        hits = [(vg, meta) for vg, meta in metas if name in meta.lvs]
        if len(hits) != 1:
            return None
        ((hit_vg, hit_meta),) = hits
        lv = self.committed.thin_volume(hit_vg, name, hit_meta)
        owner = self.of_lv(lv) if lv is not None else None
        return (owner, lv) if owner is not None and lv is not None else None

    def scan(self) -> tuple[list[tuple[Pool | None, LogicalVolume]], list[str]]:
        """Every LV of the classes' VGs with its pool (None: not a class's thin
        LV, e.g. a pool itself or another user's LV), from one `lvs`; and the
        VGs that are missing."""
        if self.single_vg:
            pool = next(iter(self._pools.values()))
            try:
                lvs = pool.lvm.list()
                missing = []
            except VolumeGroupMissing:
                lvs, missing = [], [pool.lvm.vg]
        else:
            lvs, missing = list_vgs(self.runner, self.classes.volume_groups)
        return [(self.of_lv(lv), lv) for lv in lvs], self._known(missing)

    def _known(self, missing: list[str]) -> list[str]:
        """The missing VGs that may hold volumes: those this node has had. A
        pool the node never had holds none, so it fails no listing or lookup."""
        return self.known_vgs.known(missing) if self.known_vgs is not None else missing

    def note_volume_groups(self) -> None:
        """Record which classes' VGs are here (at start; see KnownVolumeGroups)."""
        if self.known_vgs is None:
            return
        _, missing = self.read_thin_pools()
        self.known_vgs.seed([vg for vg in self.classes.volume_groups if vg not in missing],
                            missing)

    def listing(self) -> tuple[list[tuple[Pool | None, LogicalVolume]], list[str]]:
        """scan(), for the calls that read many volumes but need neither
        whether one is open nor how much of it is mapped: from the committed
        metadata and the kernel, without a process, when they answer
        (CommittedMetadata.listing); else scan()."""
        if self.committed is not None:
            lvs = self.committed.listing(self.classes.volume_groups)
            if lvs is not None:
                return [(self.of_lv(lv), lv) for lv in lvs], []
        return self.scan()

    def warm(self) -> None:
        """Read and parse every class's VG's committed metadata whole, and keep
        it (CommittedMetadata.volume_group, the read listing() starts with).
        The start parses only what it needs (its pools, its staged volumes);
        run beside the first calls after it, this spares the first listing the
        whole parse: it finds the parse kept, or waits for this one to end
        (never parsing twice). Nothing without a reader."""
        if self.committed is None:
            return
        for vg in self.classes.volume_groups:
            self.committed.volume_group(vg)

    def read_thin_pools(self) -> tuple[dict[str, LogicalVolume | None], list[str]]:
        """{class name: its thin pool's LV, None when its VG holds no LV of that
        name}, and the VGs that are missing. Probe runs this every few
        seconds: from the committed metadata and the pools' status when they
        answer, else one `lvs` selecting the pools, however many classes."""
        if self.committed is not None:
            got = self.committed.thin_pools([(p.lvm.vg, p.lvm.pool) for p in self])
            if got is not None:
                return {p.class_name: got[(p.lvm.vg, p.lvm.pool)] for p in self}, []
        names = sorted({p.lvm.pool for p in self})
        found, missing = find_in_vgs(self.runner, self.classes.volume_groups, names)
        by_place = {(lv.vg, lv.name): lv for lv in found}
        return {p.class_name: by_place.get((p.lvm.vg, p.lvm.pool)) for p in self}, missing

    def thin_pool_lvs(self, lvs: list[tuple[Pool | None, LogicalVolume]]
                      ) -> dict[str, LogicalVolume]:
        """{class name: its thin pool's LV} among `lvs` (a class whose pool is
        missing is not in it)."""
        out = {}
        for pool in self:
            for _, lv in lvs:
                if lv.vg == pool.lvm.vg and lv.name == pool.lvm.pool:
                    out[pool.class_name] = lv
        return out
