"""The CSI volume layer: what a CSI volume or snapshot is in LVM terms (names
and tags), how one is looked up, and how healthy it is. Below both CSI
servicers; the pool's room and growth are in pool.py, shared with the host
volume plugin.

LVM is the source of truth. The volume ID is the LV name, derived from the
CO's request name, so the name-to-LV mapping survives restarts and the loss of
the state file. Tags carry the kind, the content source and the requested
size. The Nomad host volume plugin uses its own tag namespace, so neither
plugin lists or deletes the other's volumes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum

from csi_local.errors import LvNotFound
from csi_local.storage.lvm import LogicalVolume, decode_hex_tag, hex_tag
from csi_local.volumes.format_version import format_tags, require_known
from csi_local.volumes.pool import Pool, Pools

VOLUME_PREFIX = "csi-v-"
SNAPSHOT_PREFIX = "csi-s-"
GROUP_PREFIX = "csi-g-"  # a group snapshot: no LV of its own, a tag on each member
_ID_RE = re.compile(r"csi-[vsg]-[0-9a-f]{32}")

# The StorageClass / VolumeSnapshotClass parameter that names a device class.
DEVICE_CLASS_PARAMETER = "deviceClass"

TAG_KIND = "csi-local.kind"
KIND_VOLUME = "volume"
KIND_SNAPSHOT = "snapshot"
# The format of this version's tags (volumes/format_version.py;
# docs/on-disk-format.md): raise it, and write down what changed, when a tag
# changes in a way an older version would misread. No tag while it is 1.
TAG_FORMAT = "csi-local.format"
FORMAT = 1
TAG_SOURCE = "csi-local.source"  # "<SourceKind>:<id>"
TAG_SIZE = "csi-local.size"  # the size CreateVolume settled on, for convergent retries
# Made by versions before 0.x: never staged. CreateVolume no longer adds it
# (the node asks the thin device whether it holds data); a volume that still
# has it is treated as fresh, and loses it at its first stage.
TAG_FRESH = "csi-local.fresh"
TAG_GROW_FS = "csi-local.grow-fs"  # grown past its source: grow the fs at first stage
# A clone or restore: its file system has its source's UUID, which xfs and
# btrfs refuse to mount twice; a new one is given at the first mount stage.
TAG_NEW_FSID = "csi-local.new-fsid"
# LUKS2 encryption at rest (volumes/encryption.py): set at CreateVolume when
# asked for, carried to snapshots, restores and clones (their data starts
# with the source's LUKS2 header).
TAG_ENCRYPTED = "csi-local.encryption=luks2"
# The CO's names for the volume, hex-encoded, when it passes them (Kubernetes'
# external-provisioner with --extra-create-metadata): shown by metrics and
# `csi-local status`, so an operator sees which claim an LV belongs to.
# A member snapshot of a group snapshot: the group's ID, and how many members
# the group was made with (fewer found: a take that did not finish).
TAG_GROUP = "csi-local.group"
TAG_GROUP_SIZE = "csi-local.group-size"
TAG_PVC_NAME = "csi-local.pvc-name"
TAG_PVC_NAMESPACE = "csi-local.pvc-namespace"
_CO_PARAMETERS = {"csi.storage.k8s.io/pvc/name": TAG_PVC_NAME,
                  "csi.storage.k8s.io/pvc/namespace": TAG_PVC_NAMESPACE}


def new_lv_tags(kind: str) -> list[str]:
    """The tags every new LV of the CSI plugin starts with: its kind (a volume
    or a snapshot) and this version's format."""
    return [f"{TAG_KIND}={kind}", *format_tags(TAG_FORMAT, FORMAT)]


def check_format(lv: LogicalVolume) -> None:
    """FormatTooNew for a volume or snapshot of a newer csi-local's format: what
    every RPC that changes it, or copies it, or answers a retry with it asks
    first (the listings and conditions only read it, and do not)."""
    require_known(lv, TAG_FORMAT, FORMAT, kind(lv) or "LV")


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def volume_id_for(name: str) -> str:
    return VOLUME_PREFIX + _digest(name)


def snapshot_id_for(name: str) -> str:
    return SNAPSHOT_PREFIX + _digest(name)


def group_id_for(name: str) -> str:
    return GROUP_PREFIX + _digest(name)


def member_snapshot_id(group_id: str, source_id: str) -> str:
    """The ID of a group's snapshot of one volume. NUL cannot be in a CO's
    name, so no CreateSnapshot name gives the same ID."""
    return SNAPSHOT_PREFIX + _digest(f"\0{group_id}\0{source_id}")


def is_group_id(text: str) -> bool:
    return bool(_ID_RE.fullmatch(text)) and text.startswith(GROUP_PREFIX)


def group_of(lv: LogicalVolume) -> str | None:
    """The group snapshot a snapshot belongs to, if any."""
    gid = lv.tag_value(TAG_GROUP)
    return gid if gid and is_group_id(gid) else None


def is_volume_id(text: str) -> bool:
    return bool(_ID_RE.fullmatch(text)) and text.startswith(VOLUME_PREFIX)


def is_snapshot_id(text: str) -> bool:
    return bool(_ID_RE.fullmatch(text)) and text.startswith(SNAPSHOT_PREFIX)


def kind(lv: LogicalVolume) -> str | None:
    return lv.tag_value(TAG_KIND)


def is_csi_volume(lv: LogicalVolume) -> bool:
    return kind(lv) == KIND_VOLUME and is_volume_id(lv.name)


def is_csi_snapshot(lv: LogicalVolume) -> bool:
    return kind(lv) == KIND_SNAPSHOT and is_snapshot_id(lv.name)


class SourceKind(StrEnum):
    """What a volume was made from (a snapshot is always of a volume)."""

    VOLUME = "volume"
    SNAPSHOT = "snapshot"


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    id: str

    def tag(self) -> str:
        return f"{TAG_SOURCE}={self.kind}:{self.id}"


def source_of(lv: LogicalVolume) -> Source | None:
    raw = lv.tag_value(TAG_SOURCE)
    if not raw or ":" not in raw:
        return None
    k, _, i = raw.partition(":")
    try:
        return Source(SourceKind(k), i)
    except ValueError:
        return None


def co_name_tags(parameters: dict[str, str] | None) -> list[str]:
    """Tags recording the CO's names for a new volume, from CreateVolume's parameters."""
    tags: list[str] = []
    for key, tag in _CO_PARAMETERS.items():
        value = (parameters or {}).get(key)
        if value:
            tags += hex_tag(tag, value)
    return tags


def co_names(lv: LogicalVolume) -> dict[str, str]:
    """{"pvc_name": ..., "pvc_namespace": ...}, as far as the LV's tags record them."""
    out = {}
    for label, tag in (("pvc_name", TAG_PVC_NAME), ("pvc_namespace", TAG_PVC_NAMESPACE)):
        value = decode_hex_tag(lv.tag_value(tag))
        if value:
            out[label] = value
    return out


def requested_size(lv: LogicalVolume) -> int:
    raw = lv.tag_value(TAG_SIZE)
    return int(raw) if raw and raw.isdigit() else lv.size


def get_volume(pools: Pools, volume_id: str, *,
               committed: bool = False) -> tuple[Pool, LogicalVolume]:
    """The LV of a CSI volume and its class's pool, from one `lvs` over the
    classes' VGs; LvNotFound for an ID that is not one of ours, an LV that
    does not exist, or one that is not a CSI volume. `committed`: from the
    VGs' committed metadata when it answers (no process), for a caller that
    needs no usage figures (data_percent and the like are None then)."""
    if committed and is_volume_id(volume_id):
        hit = pools.find_committed(volume_id)
        if hit is not None and is_csi_volume(hit[1]):
            return hit
    found = pools.find(volume_id) if is_volume_id(volume_id) else None
    if found is None or not is_csi_volume(found[1]):
        raise LvNotFound(f"volume {volume_id!r} not found")
    return found


def get_snapshot(pools: Pools, snapshot_id: str) -> tuple[Pool, LogicalVolume]:
    """The LV of a CSI snapshot and its pool; LvNotFound as for get_volume."""
    found = pools.find(snapshot_id) if is_snapshot_id(snapshot_id) else None
    if found is None or not is_csi_snapshot(found[1]):
        raise LvNotFound(f"snapshot {snapshot_id!r} not found")
    return found


def is_source(lv: LogicalVolume | None, source: Source) -> bool:
    """Whether `lv` is the CSI object `source` names (a snapshot or a volume)."""
    if lv is None or lv.name != source.id:
        return False
    return is_csi_snapshot(lv) if source.kind is SourceKind.SNAPSHOT else is_csi_volume(lv)


@dataclass(frozen=True)
class Condition:
    """A volume's health, as VolumeCondition says it (no transport types here)."""

    abnormal: bool
    message: str


def condition(lv: LogicalVolume | None, pool: LogicalVolume | None,
              pool_name: str, fill_problem: str | None = None,
              metadata_problem: str | None = None) -> Condition:
    """Abnormal, with a reason, when the LV or its thin pool cannot serve I/O,
    or when the pool is above its high-water mark (`fill_problem`, from
    Pool.fill_problem): a warning before it is actually full; or when the
    VG's metadata copies disagree or a PV of it is missing
    (`metadata_problem`, from Pool.metadata_problem)."""
    problems = []
    if lv is None:
        problems.append("logical volume is missing")
    elif not lv.active:
        problems.append("logical volume is not active")
    if pool is None:
        problems.append(f"thin pool {pool_name} is missing")
    else:
        if pool.health:
            problems.append(f"thin pool health is {pool.health}")
        full = []
        if pool.data_percent is not None and pool.data_percent >= 100.0:
            full.append("thin pool is out of data space")
        if pool.metadata_percent is not None and pool.metadata_percent >= 100.0:
            full.append("thin pool is out of metadata space")
        problems += full
        if fill_problem and not full:  # a warning says nothing once the pool is full
            problems.append(fill_problem)
    if metadata_problem:
        problems.append(metadata_problem)
    if problems:
        return Condition(True, "; ".join(problems))
    return Condition(False, "volume is healthy")
