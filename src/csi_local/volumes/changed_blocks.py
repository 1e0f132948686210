"""Changed-block tracking of CSI snapshots: the byte ranges of a snapshot that
hold data, and the byte ranges that differ between two snapshots of one
volume. Below the SnapshotMetadata servicer; the pool's mappings are read by
storage/thin_mappings.py, and the snapshots found by volumes/naming.py.

A thin snapshot's mappings are frozen when it is taken (csi-local never
activates a snapshot object, so nothing writes to it), so the ranges are
exact at the pool's chunk size: a chunk is reported when a write touched it,
never because a neighbour changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from csi_local.errors import (
    CommandError,
    LvNotFound,
    MetadataUnavailable,
    OffsetPastEnd,
    SnapshotsNotComparable,
)
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume
from csi_local.storage.thin_mappings import Mapping, ReservedBy, ThinMetadata, reserved_by_text
from csi_local.volumes.lock_keys import metadata_key
from csi_local.volumes.naming import (
    Source,
    get_snapshot,
    is_csi_snapshot,
    is_snapshot_id,
    source_of,
)
from csi_local.volumes.pool import Pool, Pools

if TYPE_CHECKING:
    from csi_local.host.kernel import Kernel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Extent:
    """`length` bytes from byte `offset`."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class BlockMap:
    """What a snapshot's (or a pair's) mappings say, in bytes: the volume's
    capacity and the extents, sorted, merged, inside the capacity. The
    extents are made from the mapping's runs as they are asked for, so that
    a million of them are never held as objects."""

    capacity: int
    mapping: Mapping

    def extents(self) -> Iterator[Extent]:
        return to_extents(self.mapping, self.capacity)

    def starting_at(self, offset: int) -> Iterator[Extent]:
        """The extents that end after `offset`, the first cut to start at it (a
        resumed stream goes on exactly where the last one stopped)."""
        for e in self.extents():
            if e.end <= offset:
                continue
            yield Extent(offset, e.end - offset) if e.offset < offset else e


def to_extents(mapping: Mapping, capacity: int) -> Iterator[Extent]:
    """Chunk runs as byte extents; the last chunk may reach past the volume's
    end (a capacity that is not a multiple of the chunk size) and is cut there."""
    size = mapping.chunk_size
    for begin, length in mapping.runs.pairs():
        offset = begin * size
        end = min((begin + length) * size, capacity)
        if end > offset:
            yield Extent(offset, end - offset)


class ChangedBlocks:
    def __init__(self, pools: Pools, locks: Locks, state_dir: str, host: Kernel) -> None:
        self.pools = pools
        self.locks = locks
        self.host = host  # the pools' status, by ioctl
        self.state_dir = state_dir  # where the marks of held metadata snapshots are

    def _reader(self, pool: Pool) -> ThinMetadata:
        return ThinMetadata(pool.lvm.runner, self.host, pool.lvm.vg, pool.lvm.pool,
                            self.state_dir)

    def _read(self, pool: Pool, read: Callable[[ThinMetadata], Mapping]) -> Mapping:
        """`read` inside the pool's metadata snapshot, taken and released here;
        its readers take turns (the kernel keeps one per pool)."""
        meta = self._reader(pool)
        with self.locks.hold(metadata_key(pool.lvm.vg, pool.lvm.pool)), meta.snapshot():
            return read(meta)

    def allocated(self, snapshot_id: str, starting_offset: int = 0) -> BlockMap:
        """The ranges of the snapshot that hold data; LvNotFound for an unknown
        one, OffsetPastEnd for a `starting_offset` past its end (both before
        anything is read)."""
        pool, lv = get_snapshot(self.pools, snapshot_id)
        _check_offset(starting_offset, lv)
        _thin_id(lv)
        mapping = self._read(pool, lambda meta: meta.allocated(lv.thin_id))
        return BlockMap(lv.size, mapping)

    def delta(self, base_id: str, target_id: str, starting_offset: int = 0) -> BlockMap:
        """The ranges where `target_id` differs from `base_id`: written over,
        written new, or discarded since the base. Both must be snapshots of one
        volume, the target not older than the base."""
        names = [n for n in dict.fromkeys((base_id, target_id)) if is_snapshot_id(n)]
        found = self.pools.locate(*names) if names else {}  # both from one `lvs`
        base_pool, base = _snapshot(found, base_id)
        _target_pool, target = _snapshot(found, target_id)
        origin, target_origin = source_of(base), source_of(target)
        if origin is None or origin != target_origin or (base.vg, base.pool) != (
                target.vg, target.pool):
            raise SnapshotsNotComparable(
                f"snapshots {base_id} and {target_id} are not of the same volume "
                f"({_of(origin)} and {_of(target_origin)})")
        if target.created < base.created:
            raise SnapshotsNotComparable(
                f"the target snapshot {target_id} is older than the base {base_id}: the "
                "target must be the later one")
        _check_offset(starting_offset, target)
        _thin_id(base)
        _thin_id(target)
        mapping = self._read(base_pool, lambda meta: meta.delta(base.thin_id, target.thin_id))
        return BlockMap(target.size, mapping)

    def release_leftovers(self) -> None:
        """At start-up: release the metadata snapshot a reader of this plugin
        reserved and was killed before it released (the kernel keeps it until
        told; meanwhile every metadata change is copied on write), and only
        that one (the mark storage/thin_mappings.py keeps says which). One
        another program reserved is theirs: reported, never released. Best effort: a
        pool that is not active is checked at the next start."""
        for pool in self.pools:
            meta = self._reader(pool)
            where = f"{pool.lvm.vg}/{pool.lvm.pool}"
            try:
                with self.locks.hold(metadata_key(pool.lvm.vg, pool.lvm.pool), timeout=5.0):
                    whose = meta.release_leftover()
            except (MetadataUnavailable, CommandError) as err:
                log.debug("thin pool %s: no held metadata snapshot checked: %s", where, err)
                continue
            except Exception:
                log.exception("checking thin pool %s for a held metadata snapshot failed",
                              where)
                continue
            if whose is ReservedBy.PLUGIN:
                log.warning("released the metadata snapshot of thin pool %s that this plugin "
                            "reserved (left by a reader that did not finish)", where)
            elif whose is not ReservedBy.NONE:
                log.warning("thin pool %s: %s; left held. Changed-block reads of this pool "
                            "fail with UNAVAILABLE until it is released", where,
                            reserved_by_text(whose))

def _snapshot(found: dict[str, tuple[Pool, LogicalVolume]],
              snapshot_id: str) -> tuple[Pool, LogicalVolume]:
    """The CSI snapshot `snapshot_id` among what one `lvs` found (as get_snapshot)."""
    hit = found.get(snapshot_id)
    if hit is None or not is_csi_snapshot(hit[1]):
        raise LvNotFound(f"snapshot {snapshot_id!r} not found")
    return hit


def _of(origin: Source | None) -> str:
    return f"of volume {origin.id}" if origin is not None else "of no known volume"


def _check_offset(offset: int, lv: LogicalVolume) -> None:
    # Equal to the size is the end of a finished stream, resumed: nothing more.
    if offset > lv.size:
        raise OffsetPastEnd(f"starting_offset {offset} is past the end of the snapshot "
                            f"({lv.size} bytes)")


def _thin_id(lv: LogicalVolume) -> None:
    if lv.thin_id < 0:
        raise MetadataUnavailable(f"LVM reports no thin device ID for {lv.vg}/{lv.name}")
