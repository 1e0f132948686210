"""What a CSI volume or snapshot is in LVM terms: names, tags and capacity.

LVM is the source of truth. The volume ID is the LV name, derived from the
CO's request name, so the name-to-LV mapping survives restarts and the loss of
the state file. Tags carry the kind, the content source and the requested
size. The Nomad host volume plugin uses its own tag namespace, so neither
plugin lists or deletes the other's volumes.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from csi_local.errors import FailedPrecondition, ResourceExhausted
from csi_local.lvm import LogicalVolume, Lvm, VgReport, VolumeGroupNotFound

VOLUME_PREFIX = "csi-v-"
SNAPSHOT_PREFIX = "csi-s-"
_ID_RE = re.compile(r"^csi-[vs]-[0-9a-f]{32}$")

TAG_KIND = "csi-local.kind"
KIND_VOLUME = "volume"
KIND_SNAPSHOT = "snapshot"
TAG_SOURCE = "csi-local.source"  # "volume:<id>" or "snapshot:<id>"
TAG_SIZE = "csi-local.size"  # the size CreateVolume settled on, for convergent retries
TAG_FRESH = "csi-local.fresh"  # never staged: stray signatures may be wiped
TAG_GROW_FS = "csi-local.grow-fs"  # grown past its source: grow the fs at first stage
# A clone or restore: its file system has its source's UUID, which xfs and
# btrfs refuse to mount twice; a new one is given at the first mount stage.
TAG_NEW_FSID = "csi-local.new-fsid"


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def volume_id_for(name: str) -> str:
    return VOLUME_PREFIX + _digest(name)


def snapshot_id_for(name: str) -> str:
    return SNAPSHOT_PREFIX + _digest(name)


def is_volume_id(text: str) -> bool:
    return bool(_ID_RE.match(text)) and text.startswith(VOLUME_PREFIX)


def is_snapshot_id(text: str) -> bool:
    return bool(_ID_RE.match(text)) and text.startswith(SNAPSHOT_PREFIX)


def kind(lv: LogicalVolume) -> str | None:
    return lv.tag_value(TAG_KIND)


def is_csi_volume(lv: LogicalVolume) -> bool:
    return kind(lv) == KIND_VOLUME and is_volume_id(lv.name)


def is_csi_snapshot(lv: LogicalVolume) -> bool:
    return kind(lv) == KIND_SNAPSHOT and is_snapshot_id(lv.name)


@dataclass(frozen=True)
class Source:
    kind: str  # "volume" or "snapshot"
    id: str

    def tag(self) -> str:
        return f"{TAG_SOURCE}={self.kind}:{self.id}"


def source_of(lv: LogicalVolume) -> Source | None:
    raw = lv.tag_value(TAG_SOURCE)
    if not raw or ":" not in raw:
        return None
    k, _, i = raw.partition(":")
    return Source(k, i)


def requested_size(lv: LogicalVolume) -> int:
    raw = lv.tag_value(TAG_SIZE)
    return int(raw) if raw and raw.isdigit() else lv.size


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
    """The arithmetic GetCapacity, CreateVolume, CreateSnapshot and expansion
    share (and the host volume plugin): the pool's size times the
    over-provisioning ratio, less every thin LV's virtual size (volumes,
    snapshots and other users of the pool alike)."""
    pool = report.find(pool_name)
    if pool is None:
        raise VolumeGroupNotFound(f"thin pool {pool_name} not found in the volume group")
    if not pool.is_thin_pool:
        raise FailedPrecondition(f"LV {pool_name} is not a thin pool")
    provisioned = sum(lv.size for lv in report.lvs if lv.pool == pool_name and lv.is_thin_volume)
    return PoolCapacity(pool.size, provisioned, ratio, report.extent_size)


def pool_capacity(lvm: Lvm, ratio: float) -> PoolCapacity:
    """capacity_of a fresh report (one `lvs` call)."""
    return capacity_of(lvm.report(), lvm.pool, ratio)


def require_room(report: VgReport, lvm: Lvm, ratio: float, size: int) -> None:
    """RESOURCE_EXHAUSTED unless `size` more bytes fit the pool. Hold the pool
    lock, with `report` read under it, until the LV is made or grown."""
    cap = capacity_of(report, lvm.pool, ratio)
    if size > cap.available:
        raise ResourceExhausted(
            f"thin pool {lvm.vg}/{lvm.pool} has room for {cap.available} bytes, {size} "
            f"requested (over-provisioning ratio {ratio})"
        )
