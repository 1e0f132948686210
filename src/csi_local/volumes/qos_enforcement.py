"""IO limits on this node: each published volume's limits (its LV's tags,
volumes/qos.py) written into the `io.max` of the workload it is published
for, for the device the workload does IO to (docs/qos.md).

The workload is named by the publish's target path (node_records: kubelet's
pod UID, Nomad's allocation ID), so an unpublish, a restart and a reconcile
find the same cgroup without a record of it. Its cgroup:

- Kubernetes, a pod's cgroup as kubelet makes it (pkg/kubelet/cm:
  pod_container_manager_linux.go names it "pod" + UID under its QoS class's
  cgroup, Guaranteed pods directly under kubepods; cgroup_manager_linux.go's
  ConvertCgroupNameToSystemd turns each step into a slice, the UID's "-"
  into "_"): with the systemd driver
  `kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid_>.slice`,
  with cgroupfs `kubepods[/<qos>]/pod<uid>`. The limit is the pod's: its
  containers share it.
- Nomad, each task's scope of the allocation (client/lib/cgroupslib,
  editor.go's pathCG2: `nomad.slice/<partition>/<alloc id>.<task>.scope`, the
  partition `share.slice` or `reserve.slice` for tasks with reserved cores).
  Nomad makes no cgroup of the allocation's own: each task gets the limit.

The device is the volume's top device (encryption.TopDevice): its dm-crypt
device when it is open, else the thin LV. IO limits never fail a publish or
an unpublish: whatever stops them (cgroup v1, no such cgroup, no io
controller, a write the kernel refuses) is logged, counted (`on_unenforced`)
and shown by `csi-local status` as "not enforced: <why>".

Changes converge: a reconcile round (every --qos-reconcile-interval seconds,
and once at start) rereads the tags of every published volume from the VGs'
committed metadata (no process) and rewrites io.max where it differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from csi_local.errors import CgroupError, LockBusy, StorageError
from csi_local.host.cgroups import Cgroups, Device
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import encryption, qos
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.node_records import (
    K8S_BLOCK_PUBLISH,
    K8S_PUBLISH,
    NOMAD_PUBLISH,
    VolumeRecord,
)
from csi_local.volumes.periodic import Periodic
from csi_local.volumes.pool import Pools

log = logging.getLogger(__name__)

_K8S_QOS = ("guaranteed", "burstable", "besteffort")
NOMAD_PARENT = "nomad.slice"  # Nomad's default cgroup_parent on cgroup v2
NOMAD_PARTITIONS = ("share.slice", "reserve.slice")
_UNLIMITED = qos.NO_LIMITS.io_max()


class Reason(StrEnum):
    """Why a volume's limits are not enforced on a workload (the metric's label)."""

    NO_WORKLOAD = "no_workload"  # a target path of no known CO's shape
    CGROUP_V1 = "cgroup_v1"
    NO_CGROUP = "no_cgroup"
    NO_IO_CONTROLLER = "no_io_controller"
    WRITE_FAILED = "write_failed"


@dataclass(frozen=True)
class Workload:
    kind: str  # "pod" or "allocation"
    id: str

    def __str__(self) -> str:
        return f"{self.kind} {self.id}"


def workload_of(target: str) -> Workload | None:
    """The workload a publish at `target` is for, from the path's shape."""
    for pattern in (K8S_PUBLISH, K8S_BLOCK_PUBLISH):
        match = pattern.search(target)
        if match:
            return Workload("pod", match.group("pod"))
    match = NOMAD_PUBLISH.search(target)
    return Workload("allocation", match.group("alloc")) if match else None


def pod_cgroup_candidates(uid: str) -> list[str]:
    """Where kubelet puts pod `uid`'s cgroup, with either driver and in each
    QoS class (a publish does not know the pod's class)."""
    escaped = uid.replace("-", "_")  # systemd: "-" is a step of the hierarchy
    out = []
    for klass in _K8S_QOS:
        if klass == "guaranteed":
            out += [f"kubepods.slice/kubepods-pod{escaped}.slice", f"kubepods/pod{uid}"]
        else:
            out += [f"kubepods.slice/kubepods-{klass}.slice/kubepods-{klass}-pod{escaped}.slice",
                    f"kubepods/{klass}/pod{uid}"]
    return out


def workload_cgroups(cgroups: Cgroups, workload: Workload) -> list[str]:
    """The cgroups that hold `workload`'s processes, as they are now."""
    if "/" in workload.id or workload.id in (".", ".."):
        return []
    if workload.kind == "pod":
        return [c for c in pod_cgroup_candidates(workload.id) if cgroups.exists(c)][:1]
    prefix = workload.id + "."
    return [f"{NOMAD_PARENT}/{part}/{name}" for part in NOMAD_PARTITIONS
            for name in cgroups.children(f"{NOMAD_PARENT}/{part}")
            if name.startswith(prefix) and name.endswith(".scope")]


@dataclass(frozen=True)
class Enforcement:
    """A volume's limits on one publish: what is configured, and whether the
    workload's cgroups hold them."""

    target: str
    limits: qos.Limits
    workload: Workload | None
    cgroups: tuple[str, ...]
    reason: Reason | None  # None: enforced (or nothing to enforce)
    detail: str = ""
    device: Device | None = None  # the volume's top device, when it was looked at

    @property
    def enforced(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        if not self.limits:
            return "no limits"
        if self.reason is None:
            return f"enforced on {', '.join(self.cgroups)}"
        return f"not enforced: {self.detail or self.reason}"


class QosEnforcer:
    """Writes published volumes' limits into their workloads' io.max."""

    def __init__(self, cgroups: Cgroups, host: Kernel,
                 on_unenforced: Callable[[str], None] | None = None) -> None:
        self.cgroups = cgroups
        self.host = host
        self.on_unenforced = on_unenforced
        # The last outcome of each publish, by (volume ID, target): metrics.
        self.last: dict[tuple[str, str], Enforcement] = {}

    def device(self, lv: LogicalVolume) -> Device:
        top = encryption.top_device(self.host, lv)
        return (top.major, top.minor)

    def check(self, lv: LogicalVolume, target: str, *, write: bool = False) -> Enforcement:
        """Whether `lv`'s limits hold for the publish at `target`; with
        `write`, make them hold where they do not. Never raises."""
        limits = qos.limits_of(lv)
        workload = workload_of(target)

        device: Device | None = None

        def outcome(reason: Reason | None, detail: str = "",
                    found: Iterable[str] = ()) -> Enforcement:
            return Enforcement(target, limits, workload, tuple(found), reason, detail, device)

        if workload is None:
            return outcome(Reason.NO_WORKLOAD,
                           f"no known CO's workload at target path {target}")
        if not self.cgroups.unified():
            return outcome(Reason.CGROUP_V1, f"no cgroup v2 hierarchy at {self.cgroups.root}")
        found = workload_cgroups(self.cgroups, workload)
        if not found:
            return outcome(Reason.NO_CGROUP, f"no cgroup of {workload} under "
                           f"{self.cgroups.root}")
        device = self.device(lv)
        if device[0] < 0:
            return outcome(Reason.WRITE_FAILED, "the volume's device is not there")
        want = limits.io_max()
        for cgroup in found:
            current = self.cgroups.io_max(cgroup)
            if current is None:
                return outcome(Reason.NO_IO_CONTROLLER,
                               f"no io controller in cgroup {cgroup}", found)
            have = _line(current.get(device))
            if have == want:
                continue
            if not write:
                return outcome(Reason.WRITE_FAILED, f"cgroup {cgroup} has {have}", found)
            try:
                self.cgroups.set_io_max(cgroup, device, want)
            except CgroupError as err:
                return outcome(Reason.WRITE_FAILED, err.message, found)
            log.info("volume %s: io.max of %s for %d:%d set to %s", lv.name, cgroup,
                     device[0], device[1], want)
        return outcome(None, found=found)

    def apply(self, lv: LogicalVolume, target: str) -> Enforcement:
        """check(write=True), its outcome remembered, logged and counted."""
        result = self.check(lv, target, write=True)
        key = (lv.name, target)
        before = self.last.get(key)
        self.last[key] = result
        if result.limits and not result.enforced and (before is None or before != result):
            log.warning("volume %s published at %s: IO limits (%s) %s", lv.name, target,
                        result.limits.describe(), result.describe())
            if self.on_unenforced is not None and result.reason is not None:
                self.on_unenforced(str(result.reason))
        return result

    def release(self, volume_id: str, target: str, remaining: Iterable[str],
                find: Callable[[], LogicalVolume | None]) -> None:
        """The publish at `target` is gone: lift the limits from its workload's
        cgroups, unless another of the volume's publishes (`remaining`) is
        for the same workload. The device is the one the publish's last
        outcome names, else `find`'s LV's (asked only when the workload has
        a cgroup still). Never raises; a cgroup that went with its workload
        needs nothing."""
        last = self.last.pop((volume_id, target), None)
        workload = workload_of(target)
        if workload is None or any(workload_of(t) == workload for t in remaining):
            return
        try:
            if not self.cgroups.unified():
                return
            found = workload_cgroups(self.cgroups, workload)
            if not found:
                return
            device = last.device if last is not None else None
            if device is None:
                lv = find()
                if lv is None:
                    return
                device = self.device(lv)
            for cgroup in found:
                current = self.cgroups.io_max(cgroup)
                if current is not None and device in current:
                    self.cgroups.set_io_max(cgroup, device, _UNLIMITED)
        except (StorageError, ValueError) as err:
            log.warning("volume %s unpublished from %s: its IO limits stay on %s: %s",
                        volume_id, target, workload, err)

    def forget(self, volume_id: str, targets: Iterable[str]) -> None:
        keep = set(targets)
        for key in [k for k in self.last if k[0] == volume_id and k[1] not in keep]:
            del self.last[key]


def _line(keys: Mapping[str, str] | None) -> str:
    """A device's io.max entry as io_max() renders limits ("max" for none)."""
    keys = keys or {}
    return " ".join(f"{k}={keys.get(k, qos.UNLIMITED)}" for k in qos.KEYS)


class QosReconciler:
    """Every `interval` seconds, and once at start: each published volume's
    limits reread from the committed metadata and made to hold."""

    def __init__(self, enforcer: QosEnforcer, pools: Pools, locks: Locks,
                 records: Callable[[], Mapping[str, VolumeRecord]],
                 interval: float = 10.0) -> None:
        self.enforcer = enforcer
        self.pools = pools
        self.locks = locks
        self.records = records
        self.interval = interval
        self._loop = Periodic("qos-reconcile", self.round, interval)

    def round(self) -> int:
        """One pass over the published volumes; how many io.max it checked."""
        checked = 0
        records = self.records()
        for volume_id, rec in records.items():
            if not rec.publishes:
                self.enforcer.forget(volume_id, ())
        published = sorted(v for v, rec in records.items() if rec.publishes)
        if not published:
            return 0
        try:
            # The committed metadata answers without a process; only LVs it
            # cannot answer for (no reader, a VG unreadable) cost one `lvs`.
            lvs, _ = self.pools.lookup(published)
        except StorageError as err:
            log.debug("QoS reconcile: cannot read the volumes: %s", err.message)
            return 0
        for volume_id in published:
            hit = lvs.get(volume_id)
            if hit is None:
                continue
            try:
                # A publish or unpublish of the volume meanwhile holds its
                # lock: that call does this volume's work; the next round
                # checks it again. Under the lock, the volume's records now.
                with self.locks.hold(volume_key(volume_id), timeout=0.0):
                    now = self.records().get(volume_id)
                    targets = list(now.publishes) if now is not None else []
                    for target in targets:
                        self.enforcer.apply(hit[1], target)
                        checked += 1
                    self.enforcer.forget(volume_id, targets)
            except LockBusy:
                continue
        return checked

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
