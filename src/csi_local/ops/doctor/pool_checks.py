"""Doctor's checks of one device class's storage: its VG, whether every
copy of the VG's metadata agrees, how full its metadata area is, and its
thin pool (there, active, healthy, zeroing, fill, device IDs, a metadata
snapshot held).
"""

from __future__ import annotations

from csi_local import config as config_mod
from csi_local.errors import StorageError, VolumeGroupMissing
from csi_local.host.kernel import Kernel
from csi_local.ops.doctor.system import FAIL, OK, WARN, Check
from csi_local.ops.status.collect import read_only_pool
from csi_local.ops.status.render import human_size
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lv_devices import dm_name
from csi_local.storage.lvm import RECOMMENDED_METADATA_SIZE, LogicalVolume, Lvm, VgReport
from csi_local.storage.thin_mappings import ReservedBy, ThinMetadata, reserved_by_text
from csi_local.volumes.pool import (
    METADATA_AREA_WARN,
    PoolPolicy,
    device_id_problem,
    lvs_that_fit,
    metadata_area_problem,
)


def check_volume_group(lvm: Lvm) -> Check:
    label = f"volume group {lvm.vg}"
    try:
        vg = lvm.volume_group()
    except VolumeGroupMissing:
        return Check(label, FAIL, "not found",
                     f"attach its disks and run vgchange --activate y {lvm.vg}; or create it: "
                     f"pvcreate DISK && vgcreate {lvm.vg} DISK")
    except StorageError as err:
        return Check(label, FAIL, f"cannot be read: {err.message}",
                     "run doctor as root on the node (or in the plugin's container)")
    return Check(label, OK, f"size {human_size(vg.size)}, free {human_size(vg.free)}")


def check_metadata(lvm: Lvm, host: Kernel) -> Check:
    """Whether every copy of the VG's metadata on its PVs agrees and every PV
    is there: else the plugin takes LVM's answer for every read (slower),
    and LVM warns at each command until the VG is repaired."""
    label = f"volume group {lvm.vg} metadata"
    problems = CommittedMetadata(lvm.runner, host).check(lvm.vg, ask_lvm=True)
    if problems:
        return Check(label, WARN, "; ".join(problems),
                     f"attach the missing PV, or run vgreduce --removemissing {lvm.vg}; "
                     f"for outdated copies, vgck --updatemetadata {lvm.vg}")
    return Check(label, OK, "every PV's copy is the newest")


def check_pool(lvm: Lvm, report: VgReport, *, setting: str = "--thin-pool") -> Check:
    """`setting`: where the pool's name is given, for the fix."""
    label = f"thin pool {lvm.vg}/{lvm.pool}"
    lv = report.find(lvm.pool)
    if lv is None:
        return Check(label, FAIL, "not found",
                     f"lvcreate --type thin-pool --extents 90%FREE --name {lvm.pool} {lvm.vg}")
    if not lv.is_thin_pool:
        return Check(label, FAIL, f"exists but is not a thin pool (lv_attr {lv.attr})",
                     f"give {setting} the name of a thin pool, or convert this LV: "
                     f"lvconvert --type thin-pool {lvm.vg}/{lvm.pool}")
    if not lv.active:
        return Check(label, FAIL, "not active: no volume can be created or used",
                     f"lvchange --activate y {lvm.vg}/{lvm.pool}")
    if lv.health:
        return Check(label, FAIL, f"health is {lv.health}",
                     f"see lvs -a {lvm.vg}; a failed pool needs lvconvert --repair "
                     f"{lvm.vg}/{lvm.pool} (lvmthin(7))")
    return Check(label, OK, f"active, size {human_size(lv.size)}")


def check_zeroing(lvm: Lvm, pool: LogicalVolume) -> Check:
    """lv_attr bit 8 of a thin pool is 'z' when new blocks are zeroed (lvs(8))."""
    label = "thin pool zeroing"
    if len(pool.attr) > 7 and pool.attr[7] == "z":
        return Check(label, OK, "on: new blocks are zeroed before use")
    return Check(label, WARN, "off: a new volume's blocks may show data of deleted volumes "
                 "until written (a volume that was never formatted, a raw block volume)",
                 f"lvchange --zero y {lvm.vg}/{lvm.pool}")


def check_fill(lvm: Lvm, pool: LogicalVolume) -> Check:
    label = "thin pool fill"
    policy = PoolPolicy()
    data, meta = pool.data_percent, pool.metadata_percent
    message = f"data {_pct(data)}, metadata {_pct(meta)}"
    full = [w for w, p in (("data", data), ("metadata", meta)) if p is not None and p >= 100]
    problem = read_only_pool(lvm, policy=policy).fill_problem(pool)
    fix = (f"add room: vgextend {lvm.vg} DISK, then lvextend --extents +100%FREE "
           f"{lvm.vg}/{lvm.pool} (--poolmetadatasize +SIZE for metadata); or delete volumes "
           "and snapshots and run fstrim -av")
    if full:
        return Check(label, FAIL, f"{message}: out of {' and '.join(full)} space, writes "
                     "to every volume fail", fix)
    if problem:
        return Check(label, WARN, f"{message}: {problem}; new volumes are refused", fix)
    return Check(label, OK, f"{message} (high-water marks {policy.data_limit:g}% and "
                 f"{policy.metadata_limit:g}%)")


def check_metadata_area(lvm: Lvm, report: VgReport) -> Check:
    """How full the VG's tightest metadata area is: LVM refuses any change
    once the VG's metadata text outgrows it (see pool.metadata_area_problem)."""
    label = f"volume group {lvm.vg} metadata area"
    area = report.metadata_area
    if area is None:
        return Check(label, WARN, "not checked: LVM reports no metadata area in use", "")
    message = (f"{100 * area.used_ratio:.1f}% full: {area.used} of {area.limit} bytes of "
               f"text (smallest area in use: {human_size(area.size)}); room for "
               f"at least {lvs_that_fit(area)} more volumes or snapshots")
    size = RECOMMENDED_METADATA_SIZE
    fix = (f"add a PV made with `pvcreate --metadatasize {size}` (vgextend {lvm.vg} DISK), then "
           "`pvchange --metadataignore y` the small area's PV or move off it (pvmove, "
           f"vgreduce); prepare new nodes with `pvcreate --metadatasize {size}`")
    if metadata_area_problem(lvm.vg, area) is not None:
        return Check(label, FAIL, f"{message}: new volumes and snapshots are refused", fix)
    if area.used_ratio >= METADATA_AREA_WARN:
        return Check(label, WARN, f"{message} (above {100 * METADATA_AREA_WARN:g}%)", fix)
    return Check(label, OK, message)


def check_device_ids(lvm: Lvm, report: VgReport) -> Check:
    """Whether the thin pool can still give a new thin volume a device ID."""
    label = "thin pool device IDs"
    problem = device_id_problem(lvm.pool, report)
    if problem is not None:
        return Check(label, FAIL, problem, "delete the volume or snapshot with the highest "
                     f"thin_id (lvs -o lv_name,thin_id {lvm.vg})")
    return Check(label, OK, "a new thin volume gets an ID")


def check_metadata_snapshot(lvm: Lvm, host: Kernel, state_dir: str) -> Check:
    """Whether the pool holds a metadata snapshot, and whose (the mark
    storage/thin_mappings.py keeps in the state directory says which one
    csi-local reserved)."""
    label = "thin pool metadata snapshot"
    meta = ThinMetadata(lvm.runner, host, lvm.vg, lvm.pool, state_dir)
    try:
        whose = meta.reserved_by()
    except StorageError as err:
        return Check(label, WARN, f"not checked: {err.message}", "")
    if whose is ReservedBy.NONE:
        return Check(label, OK, "none held")
    release = (f"when no thin_dump, thin_delta or backup tool reads it: dmsetup message "
               f"{dm_name(lvm.vg, lvm.pool)}-tpool 0 release_metadata_snap (the pool's "
               "device without -tpool when no volume is active)")
    fix = {ReservedBy.PLUGIN: "restart csi-local, which releases it",
           ReservedBy.UNSURE: release, ReservedBy.OTHER: release}[whose]
    return Check(label, WARN, f"{reserved_by_text(whose)}; while it is held, every metadata "
                 "change is copied on write, and changed-block reads (GetMetadataAllocated, "
                 "GetMetadataDelta) fail with UNAVAILABLE", fix)


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:.1f}%"


def vg_and_pool_checks(lvm: Lvm, host: Kernel, setting: str = "--thin-pool", *,
                       state_dir: str = config_mod.DEFAULT_STATE_DIR) -> list[Check]:
    """One class's: its VG, then its pool, zeroing and fill."""
    vg_check = check_volume_group(lvm)
    if vg_check.status != OK:
        return [vg_check, Check(f"thin pool {lvm.vg}/{lvm.pool}", FAIL,
                                "not checked: the volume group cannot be read", vg_check.fix)]
    return [vg_check, check_metadata(lvm, host),
            *_pool_checks(lvm, host, setting, state_dir=state_dir)]


def _pool_checks(lvm: Lvm, host: Kernel, setting: str = "--thin-pool", *,
                 state_dir: str = config_mod.DEFAULT_STATE_DIR) -> list[Check]:
    try:
        report = lvm.report()
    except StorageError as err:
        return [Check(f"thin pool {lvm.vg}/{lvm.pool}", FAIL, f"cannot be read: {err.message}",
                      "")]
    pool_check = check_pool(lvm, report, setting=setting)
    pool = report.find(lvm.pool)
    checks = [pool_check, check_metadata_area(lvm, report)]
    if pool is not None and pool.is_thin_pool:
        checks.append(check_device_ids(lvm, report))
        checks.append(check_zeroing(lvm, pool))
        if pool.active:
            checks.append(check_fill(lvm, pool))
            checks.append(check_metadata_snapshot(lvm, host, state_dir))
    return checks
