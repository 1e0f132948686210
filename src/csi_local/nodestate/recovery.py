"""Node state after a restart: rebuilt from the mount table when the state file
is lost, reconciled with it when the file survived.

Only what a CO asked for is recorded. A device of ours can be mounted in
places no CO request made: kubelet binds a block volume's device under
`.../volumeDevices/<pv>/dev/<pod-uid>` to keep it attached, a subPath is a
bind of a subdirectory, and after a reboot nothing is mounted at all. Such
mounts must never count as publishes, or NodeUnstageVolume and DeleteVolume
would be refused forever. So mounts are attributed by the staging and target
path shapes of the known COs (kubelet, Nomad), and only for paths of no known
shape by mount order (the first mount of the device is the staging mount).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace

from csi_local.errors import StorageError
from csi_local.host.kernel import Kernel
from csi_local.host.mounts import Mount, mount_node
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import encryption, naming
from csi_local.volumes.node_records import (
    K8S_BLOCK_PUBLISH,
    K8S_PUBLISH,
    NOMAD_PUBLISH,
    AccessType,
    Publish,
    Staging,
    VolumeRecord,
    block_staging_path,
)
from csi_local.volumes.pool import Pools

log = logging.getLogger(__name__)

# kubelet (pkg/volume/csi): staging paths of file-system and block volumes,
# and kubelet's own binds; the publish paths are node_records'.
_K8S_STAGE = re.compile(r"/plugins/kubernetes\.io/csi/(?!volumeDevices/)[^/]+/[^/]+/globalmount\Z")
_K8S_BLOCK_STAGE = re.compile(r"/plugins/kubernetes\.io/csi/volumeDevices/staging/[^/]+\Z")
# kubelet's own: the device bound under volumeDevices/<pv>/dev/<pod-uid>, the
# pod's volumeDevices links, and subPath binds. Never a CO request to us.
_K8S_OWN = re.compile(
    r"/plugins/kubernetes\.io/csi/volumeDevices/(?!staging/|publish/)[^/]+/dev/[^/]+\Z"
    r"|/pods/[^/]+/volumeDevices/"
    r"|/pods/[^/]+/volume-subpaths/"
)
# Nomad (client/pluginmanager/csimanager): <mount dir>/staging/[<namespace>/]<volume>/<usage>.
_NOMAD_STAGE = re.compile(
    r"/staging/(?:[^/]+/)?[^/]+/[a-z]+-(?:file-system|block-device)-[a-z-]+\Z")

STAGING, PUBLISH, FOREIGN, UNKNOWN = "staging", "publish", "foreign", "unknown"


def classify(path: str, *, block_node: bool, volume_id: str) -> str:
    """What a mount of one of our devices at `path` is, by its path's shape.

    `block_node`: the mount is the device node bound onto a file (block access).
    """
    if _K8S_OWN.search(path):
        return FOREIGN
    if block_node:
        parent = os.path.dirname(path)
        if block_staging_path(path, volume_id) is not None:
            return STAGING  # our own shape (node_records.block_stage_file)
        if _K8S_BLOCK_STAGE.search(parent) or _NOMAD_STAGE.search(parent):
            return FOREIGN  # another file in a staging directory is not ours
        if K8S_BLOCK_PUBLISH.search(path) or NOMAD_PUBLISH.search(path):
            return PUBLISH
        return UNKNOWN
    if _K8S_STAGE.search(path) or _NOMAD_STAGE.search(path):
        return STAGING
    if K8S_PUBLISH.search(path) or NOMAD_PUBLISH.search(path):
        return PUBLISH
    return UNKNOWN


def _record_from_mounts(lv: LogicalVolume, found: list[Mount]) -> VolumeRecord | None:
    staging: Staging | None = None
    pubs: dict[str, Publish] = {}
    unknown: list[tuple[Mount, bool]] = []
    for m in found:
        block_node = mount_node(m) is not None  # the device node bound onto a file
        if not block_node and m.root != "/":
            continue  # a bind of a subdirectory (a subPath): never a CO request to us
        kind = classify(m.mount_point, block_node=block_node, volume_id=lv.name)
        if kind == STAGING and staging is None:
            staging = _staging(m, block_node, lv.name)
        elif kind == PUBLISH:
            pubs[m.mount_point] = Publish(readonly=m.read_only, flags_known=False)
        elif kind == UNKNOWN:
            unknown.append((m, block_node))
    # Paths of no known shape (a test CO, csi-sanity): the first mount of the
    # device, in mount order, is the staging mount; later ones are publishes.
    for m, block_node in unknown:
        if staging is None and not block_node:
            staging = _staging(m, block_node, lv.name)
        elif staging is not None:
            pubs[m.mount_point] = Publish(readonly=m.read_only, flags_known=False)
    if staging is None and not pubs:
        return None
    return VolumeRecord(lv.name, staging, pubs)


def _staging(m: Mount, block_node: bool, volume_id: str) -> Staging:
    if block_node:
        path = block_staging_path(m.mount_point, volume_id)
        assert path is not None  # classify() took it for a stage of this shape
        return Staging(path=path, access_type=AccessType.BLOCK)
    return Staging(path=m.mount_point, access_type=AccessType.MOUNT, fs_type=m.fs_type,
                   flags_known=False)


def _csi_lvs(pools: Pools) -> tuple[list[LogicalVolume], list[str]] | None:
    """The CSI volumes of every class, and the VGs that are missing."""
    try:
        found, missing = pools.listing()
    except StorageError as err:
        log.error("cannot list LVs to recover the node state: %s", err.message)
        return None
    if missing:
        log.error("volume group %s not found: the state of its volumes cannot be recovered "
                  "or checked", ", ".join(missing))
    return [lv for pool, lv in found if pool is not None and naming.is_csi_volume(lv)], missing


def _record_lvs(pools: Pools, names: list[str]
                ) -> tuple[dict[str, LogicalVolume], list[str]] | None:
    """The CSI volumes among `names` by name, and the VGs that are missing;
    None when LVM cannot be read. Only these LVs are looked up (Pools.lookup),
    never the node's every volume: a state file names a few of thousands."""
    # Only a volume ID can name a CSI volume: anything else is no LV of ours,
    # and never reaches a command.
    ids = [name for name in names if naming.is_volume_id(name)]
    try:
        found, missing = pools.lookup(ids) if ids else ({}, [])
    except StorageError as err:
        log.error("cannot read LVM to check the node state: %s", err.message)
        return None
    if missing:
        log.error("volume group %s not found: the state of its volumes cannot be checked",
                  ", ".join(missing))
    return {name: lv for name, (_, lv) in found.items() if naming.is_csi_volume(lv)}, missing


def rebuild_state(pools: Pools, host: Kernel) -> dict[str, VolumeRecord]:
    """Staging and publish records recovered from the kernel's mount table."""
    table = host.mounts()
    listed = _csi_lvs(pools)
    lvs = listed[0] if listed is not None else []
    records: dict[str, VolumeRecord] = {}
    for lv in lvs:
        if lv.kernel_major < 0:
            continue
        # An encrypted volume is mounted through its dm-crypt device.
        top = encryption.top_device(host, lv)
        rec = _record_from_mounts(lv, host.mounts_of(top.major, top.minor, table))
        if rec is not None:
            records[lv.name] = rec
    return records


def reconcile_state(pools: Pools, host: Kernel,
                    records: dict[str, VolumeRecord]) -> dict[str, VolumeRecord]:
    """The records of a surviving state file, less what is no longer mounted.

    After a reboot (or an unmount behind the plugin's back) a record may name
    a staging or publish that is gone; kept, it would refuse DeleteVolume and
    NodeUnstageVolume forever. A record is kept only while the volume's
    device is still mounted where it says. When LVM cannot be read the
    records are kept as they are: nothing can be verified, and nothing is lost.
    Only the records' LVs are read (and nothing at all without records).
    """
    if not records:
        return records
    listed = _record_lvs(pools, list(records))
    if listed is None:
        return records
    by_name, missing = listed
    table = host.mounts()
    out: dict[str, VolumeRecord] = {}
    for vid, rec in records.items():
        lv = by_name.get(vid)
        if lv is None and missing:
            out[vid] = rec  # perhaps in the missing VG: nothing can be verified
            continue
        if lv is None or lv.kernel_major < 0:
            continue  # the LV is gone or inactive: nothing of it can be mounted

        top = encryption.top_device(host, lv)  # an encrypted one's dm-crypt device

        def mounted(path: str, top: encryption.TopDevice = top) -> bool:
            return any(host.shows_device(m, top.major, top.minor)
                       for m in host.mounts_at(path, table))

        staging = rec.staging
        if staging is not None and not mounted(staging.mount_point(vid)):
            staging = None
        pubs = {t: p for t, p in rec.publishes.items() if mounted(t)}
        kept = replace(rec, staging=staging, publishes=pubs)
        if not kept.empty:
            out[vid] = kept
    return out
