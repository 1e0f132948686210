"""The thin pool both plugins carve volumes from: its room, and the one lock
around every change of it.

The CSI plugin (CreateVolume, CreateSnapshot, expansion) and the Nomad host
volume plugin (create, grow) share one pool and one lock directory, so they
share this: the over-provisioning arithmetic, the "is there room" check, and
the rule that a check and the lvcreate or lvextend it allows happen under
the pool lock, against one report read under it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from csi_local import sizes
from csi_local.errors import NoRoom, PoolUnusable, VolumeGroupMissing
from csi_local.locks import POOL_KEY, Locks
from csi_local.lvm import LogicalVolume, Lvm, VgReport


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

    def __init__(self, lvm: Lvm, locks: Locks, ratio: float) -> None:
        self.lvm = lvm
        self.locks = locks
        self.ratio = ratio

    @property
    def name(self) -> str:
        return f"{self.lvm.vg}/{self.lvm.pool}"

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

    @contextlib.contextmanager
    def reserved(self, timeout: float | None = None) -> Iterator[VgReport]:
        """Hold the pool lock and read the VG once. Whatever is checked against
        the report and then made or grown inside the block cannot be
        overtaken by another create, in this process or the other plugin."""
        with self.locks.hold(POOL_KEY, timeout=timeout):
            yield self.lvm.report()

    def create_thin(self, report: VgReport, name: str, size: int,
                    tags: list[str]) -> LogicalVolume:
        """A new thin LV of `size` bytes, if it fits (inside `reserved()`)."""
        self.require_room(report, size)
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
            return self.lvm.extend(lv.name, size)
