"""The plugin's watch on its thin pools: one monitor per device class, each a
background thread that reads its class's pool every few seconds (off the PVs
and the kernel, no process), extends the pool when it crosses the autoextend
threshold, and keeps the last reading of the VG for the metrics endpoint.

Why a thread: the pool fills through writes to volumes, which never pass
through the plugin, and dmeventd (LVM's own autoextend) does not run in the
plugin's container. Why one reading shared: a metrics scrape must never add
LVM calls of its own (`latest()` answers from the last reading, refreshing
it only when it is older than asked, one reader at a time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from csi_local.errors import StorageError
from csi_local.storage.lvm import Lvm, VgReport, VolumeGroup
from csi_local.volumes.periodic import Periodic
from csi_local.volumes.pool import Pool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    """The VG and its LVs as LVM reported them at `taken` (time.time())."""

    report: VgReport
    vg: VolumeGroup
    taken: float


class PoolMonitor:
    """Reads the VG of one class's pool every `interval` seconds (and on
    demand), autoextends that pool."""

    def __init__(self, lvm: Lvm, pool: Pool, interval: float = 10.0,
                 on_extend: Callable[[str, int], None] | None = None) -> None:
        self.lvm = lvm
        self.pool = pool
        self.interval = interval
        self.on_extend = on_extend  # (what: "data"|"metadata", bytes added), for metrics
        self._reading: Reading | None = None
        self._read_lock = threading.Lock()
        self._watch = Periodic(f"pool-monitor-{pool.class_name}", self.check, interval)

    def recent(self, max_age: float = 5.0) -> Reading | None:
        """The last reading if it is at most `max_age` seconds old, else None;
        never reads LVM (the metrics share one reading of a VG among the
        monitors of the classes it holds)."""
        reading = self._reading
        if reading is not None and time.time() - reading.taken <= max_age:
            return reading
        return None

    def latest(self, max_age: float = 5.0) -> Reading | None:
        """The last reading, refreshed first when older than `max_age` seconds;
        None when the VG cannot be read (missing, LVM failing)."""
        reading = self.recent(max_age)
        if reading is not None:
            return reading
        with self._read_lock:  # one refresh at a time; others use its result
            reading = self.recent(max_age)
            if reading is not None:
                return reading
            try:
                # The volumes' fill needs `lvs` (the committed metadata knows no
                # kernel state of thin volumes); the VG's size and free space
                # come off its PVs when they answer, so a scrape costs one process.
                reading = Reading(self.lvm.report(), self._space(), time.time())
            except StorageError as err:
                log.debug("pool monitor of class %s: cannot read volume group %s: %s",
                          self.pool.class_name, self.lvm.vg, err.message)
                return None
            self._reading = reading
            return reading

    def _space(self) -> VolumeGroup:
        committed = self.pool.committed
        found = committed.space(self.lvm.vg) if committed is not None else None
        return found if found is not None else self.lvm.volume_group()

    def check(self) -> None:
        """One round: read the pool's fill, autoextend when it needs it. The
        fill comes from the committed metadata and the pool's kernel status
        when they answer (no process: a node that is idle starts none);
        autoextend itself reads LVM afresh, under the pool's lock."""
        try:
            report = self.pool.report(committed=True)
        except StorageError as err:
            log.debug("pool monitor of class %s: cannot read volume group %s: %s",
                      self.pool.class_name, self.lvm.vg, err.message)
            return
        if not self.pool.needs_extension(report):
            return
        try:
            added = self.pool.autoextend()
        except StorageError as err:
            log.error("thin pool %s: autoextend failed: %s", self.pool.name, err.message)
            return
        for what, size in added:
            if self.on_extend is not None:
                self.on_extend(what, size)
        if added:
            self.latest(max_age=0.0)

    def start(self) -> None:
        """Start the periodic watch, when autoextend is on. Without autoextend
        nothing needs a periodic reading: metrics read on demand (`latest`),
        and every LVM call costs the node a process start."""
        if self.pool.policy.autoextend_threshold:
            self._watch.start()

    def stop(self) -> None:
        self._watch.stop()
