"""What `csi-local status` reads: every device class's VG and thin pool
(one `vgs` and one `lvs` per VG, through Lvm), the state file as it is
(without its lock), and from them each volume's, snapshot's and host
volume's record, and the possible orphans. The data model the report is
made of is here too; csi_local.ops.status.render prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from csi_local.errors import FormatTooNew, LockDirError, StorageError
from csi_local.host.cgroups import Cgroups
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.host.runner import Runner
from csi_local.nodestate.state_file import STATE_FILE, parse
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import LogicalVolume, Lvm, MetadataArea, VgReport
from csi_local.volumes import encryption, naming, qos
from csi_local.volumes import host_volume_names as dhv_tags
from csi_local.volumes.device_classes import (
    DeviceClass,
    DeviceClasses,
    load_classes,
    single_class,
)
from csi_local.volumes.host_volume_names import LV_PREFIX as DHV_PREFIX
from csi_local.volumes.naming import Condition
from csi_local.volumes.node_records import VolumeRecord
from csi_local.volumes.pool import Pool, PoolPolicy, lvs_that_fit, metadata_area_problem
from csi_local.volumes.qos_enforcement import QosEnforcer

DEFAULT_ORPHAN_AGE = 3600.0
ORPHAN_NOTE = ('"possible" means check with your CO: the node alone cannot tell whether a '
               "volume is still known (kubectl get pv, nomad volume status)")
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
TAG_NAMESPACE = "csi-local."  # every tag of the CSI plugin; csi-local-dhv's differ


def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "30m", "1h", "2d"; ValueError otherwise."""
    m = _DURATION_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h, 2d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def duration_text(seconds: float) -> str:
    """A flag's duration as given: 3600 is "1h", 90 is "90s"."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


class _NoLocks(Locks):
    """The pool's lock, never taken: status only reads (capacity and
    fill_problem need no lock), and a real Locks would create the lock
    directory."""

    def __init__(self) -> None:  # no directory is made or checked
        self.directory = ""
        self.timeout = 0.0

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float | None = None) -> Iterator[None]:
        raise LockDirError("csi-local status and doctor never take a lock")
        yield  # pragma: no cover - makes this a generator


def read_only_pool(lvm: Lvm, ratio: float = 1.0, policy: PoolPolicy | None = None, *,
                   device_class: DeviceClass | None = None) -> Pool:
    """A Pool for reading room and fill, without the lock directory."""
    return Pool(lvm, _NoLocks(), ratio, policy or PoolPolicy(), device_class=device_class)


def node_classes(args: argparse.Namespace, ratio: float = 1.0) -> DeviceClasses:
    """The device classes `status` or `doctor` was given: the configuration
    file's (`--config`; ClassConfigError when it is unreadable or wrong) or
    the one class of `--volume-group` and `--thin-pool`. `ratio` is the
    over-provisioning ratio of a class that sets none."""
    if getattr(args, "config", None):
        return load_classes(args.config, overprovision_ratio=ratio)
    return single_class(args.volume_group, args.thin_pool, overprovision_ratio=ratio)


# the report ---------------------------------------------------------------------


@dataclass(frozen=True)
class Staged:
    path: str
    access_type: str
    fs_type: str


@dataclass(frozen=True)
class Published:
    target: str
    readonly: bool
    # Its volume's IO limits on its workload, read from the cgroups now:
    # "enforced on CGROUP", "not enforced: WHY", or "" when it has none.
    io_limits: str = ""


@dataclass(frozen=True)
class VolumeInfo:
    id: str
    kind: str  # "volume" or "snapshot"
    device_class: str | None  # None: in a thin pool that is no class's
    size: int
    data_percent: float | None
    active: bool
    source: str | None  # "snapshot:csi-s-..." / "volume:csi-v-..."
    co_names: dict[str, str]
    staged: Staged | None
    published: list[Published]
    condition: Condition
    created: int
    age_seconds: int
    possible_orphan: bool
    encrypted: bool = False  # LUKS2 (docs/encryption.md)
    crypt_device: str | None = None  # its dm-crypt device, while open
    # Its configured IO limits ({io.max key: value}, the LV's tags; docs/qos.md).
    io_limits: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HostVolumeInfo:
    lv: str
    id: str | None
    name: str | None
    namespace: str | None
    fs_type: str | None
    size: int
    data_percent: float | None
    condition: Condition
    created: int
    age_seconds: int
    kind: str = "volume"  # or "snapshot" (csi-local-dhv snapshot create)
    source: str | None = None  # a clone's or snapshot's: "volume:<ID>" or "snapshot:<name>"
    device_class: str | None = None  # None: in a thin pool that is no class's
    encrypted: bool = False  # LUKS2 (docs/encryption.md)
    crypt_device: str | None = None  # its dm-crypt device, while open


@dataclass(frozen=True)
class Orphan:
    lv: str
    kind: str  # "unused volume" or "stray LV"
    reason: str
    created: int
    age_seconds: int


@dataclass(frozen=True)
class MetadataAreaInfo:
    """How full the VG's tightest metadata area is (lvm.MetadataArea)."""

    size: int  # bytes, the smallest metadata area in use
    limit: int  # the largest metadata text LVM writes there
    used: int  # bytes of text the VG's metadata takes now
    used_percent: float
    lvs_that_fit: int  # more volumes or snapshots it surely takes (pool.lvs_that_fit)
    problem: str | None = None  # why no more fit (pool.metadata_area_problem)


@dataclass(frozen=True)
class VolumeGroupInfo:
    name: str
    size: int
    free: int
    # Why its committed metadata cannot be believed (a PV missing, a copy
    # outdated or differing: see CommittedMetadata.check); () when it can.
    metadata_problems: tuple[str, ...] = ()
    # None: LVM reported no metadata area in use.
    metadata_area: MetadataAreaInfo | None = None


def metadata_area_info(vg: str, area: MetadataArea | None) -> MetadataAreaInfo | None:
    if area is None:
        return None
    return MetadataAreaInfo(area.size, area.limit, area.used,
                            round(100 * area.used_ratio, 1), lvs_that_fit(area),
                            metadata_area_problem(vg, area))


@dataclass(frozen=True)
class PoolInfo:
    name: str
    found: bool
    size: int = 0
    data_percent: float | None = None
    metadata_percent: float | None = None
    active: bool = False
    health: str = ""
    available: int = 0  # room for new volumes, by the over-provisioning arithmetic
    overprovision_ratio: float = 1.0
    fill_problem: str | None = None
    problem: str | None = None  # missing, not a thin pool
    # Why no more volume fits whatever its size (its VG's metadata area, its
    # device IDs: Pool.count_problem); GetCapacity reports 0 then.
    count_problem: str | None = None


@dataclass(frozen=True)
class ClassInfo:
    """A device class: its VG (None when it cannot be read, `error` says why)
    and its thin pool."""

    name: str
    default: bool
    volume_group: VolumeGroupInfo | None
    thin_pool: PoolInfo
    error: str | None = None


@dataclass(frozen=True)
class StateInfo:
    path: str
    error: str | None  # None: read (or absent, which means nothing is staged)
    records: int


@dataclass(frozen=True)
class Status:
    # The default class's VG and pool, as before device classes: what a script
    # of a one-class node reads. Every class's are in `classes`.
    volume_group: VolumeGroupInfo | None
    thin_pool: PoolInfo
    state: StateInfo
    default_class: str
    classes: list[ClassInfo]
    config: str | None = None  # the configuration file of the classes; None: the flags
    volumes: list[VolumeInfo] = field(default_factory=list)
    snapshots: list[VolumeInfo] = field(default_factory=list)
    host_volumes: list[HostVolumeInfo] = field(default_factory=list)
    possible_orphans: list[Orphan] = field(default_factory=list)
    orphan_age_seconds: float = DEFAULT_ORPHAN_AGE
    orphan_note: str = ORPHAN_NOTE


def read_state(state_dir: str) -> tuple[dict[str, VolumeRecord] | None, StateInfo]:
    """The state file's records, without its lock; None when it cannot be read.
    A missing file is no records (nothing was ever staged, or the plugin
    rebuilds it at start)."""
    path = os.path.join(state_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            records = parse(f.read(), path)
    except FileNotFoundError:
        return {}, StateInfo(path, None, 0)
    except FormatTooNew as err:  # a newer csi-local's: the plugin does not start on it
        return None, StateInfo(path, err.message, 0)
    except OSError as err:
        return None, StateInfo(path, f"cannot read it: {err.strerror or err}", 0)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return None, StateInfo(path, f"corrupt ({err}); the plugin sets it aside and "
                               "rebuilds it at its next start", 0)
    return records, StateInfo(path, None, len(records))


def _condition(lv: LogicalVolume, pool_lv: LogicalVolume | None, pool_name: str,
               fill_problem: str | None, metadata_problem: str | None = None) -> Condition:
    if naming.is_csi_snapshot(lv) and not lv.active:
        # A snapshot is inactive by design (activation skip): its health is its pool's.
        lv = dataclasses.replace(lv, attr=lv.attr[:4] + "a" + lv.attr[5:])
    return naming.condition(lv, pool_lv, pool_name, fill_problem, metadata_problem)


def _source(lv: LogicalVolume) -> str | None:
    src = naming.source_of(lv)
    return f"{src.kind}:{src.id}" if src else None


def collect(runner: Runner, vg: str, pool: str, state_dir: str, *, ratio: float = 1.0,
            orphan_age: float = DEFAULT_ORPHAN_AGE, now: float | None = None) -> Status:
    """The status of a node with one class, `vg`/`pool` (the flags')."""
    return collect_classes(runner, single_class(vg, pool, overprovision_ratio=ratio),
                           state_dir, orphan_age=orphan_age, now=now)


@dataclass
class _PoolContext:
    """What a volume's condition needs of its thin pool."""

    name: str
    lv: LogicalVolume | None
    fill: str | None = None
    metadata: str | None = None  # its VG's metadata problems


def collect_classes(runner: Runner, classes: DeviceClasses, state_dir: str, *,
                    orphan_age: float = DEFAULT_ORPHAN_AGE,
                    now: float | None = None, host: Kernel | None = None,
                    cgroups: Cgroups | None = None) -> Status:
    """The node's status over every device class: one `vgs` and one `lvs` per
    VG. A VG that cannot be read is shown as its classes' error; when none
    can, its error is raised (VolumeGroupMissing or another StorageError)."""
    now = time.time() if now is None else now
    pools = {c.name: read_only_pool(Lvm(runner, c.volume_group, c.thin_pool),
                                    c.overprovision_ratio, device_class=c)
             for c in classes.classes}
    infos: dict[str, ClassInfo] = {}
    host = host if host is not None else Kernel()
    committed = CommittedMetadata(runner, host)
    reports: list[VgReport] = []
    contexts: dict[tuple[str, str], _PoolContext] = {}
    failure: StorageError | None = None
    for vg in classes.volume_groups:
        members = [c for c in classes.classes if c.volume_group == vg]
        lvm = pools[members[0].name].lvm
        try:
            group = lvm.volume_group()
            report = lvm.report()
        except StorageError as err:
            failure = failure or err
            for c in members:
                pool = pools[c.name]
                infos[c.name] = ClassInfo(
                    c.name, c.name == classes.default, None,
                    PoolInfo(pool.name, False, overprovision_ratio=pool.ratio,
                             problem="not read: the volume group cannot be read"),
                    err.message)
            continue
        reports.append(report)
        vg_info = VolumeGroupInfo(group.name, group.size, group.free,
                                  committed.check(vg, ask_lvm=True),
                                  metadata_area_info(vg, report.metadata_area))
        for c in members:
            pool_info, pool_lv, fill = _pool_info(pools[c.name], report)
            infos[c.name] = ClassInfo(c.name, c.name == classes.default, vg_info, pool_info)
            contexts[(vg, c.thin_pool)] = _PoolContext(
                pools[c.name].name, pool_lv, fill, "; ".join(vg_info.metadata_problems) or None)
    if not reports and failure is not None:
        raise failure
    records, state_info = read_state(state_dir)
    default = infos[classes.default]
    status = Status(default.volume_group, default.thin_pool, state_info, classes.default,
                    [infos[c.name] for c in classes.classes], classes.source or None,
                    orphan_age_seconds=orphan_age)
    enforcer = QosEnforcer(cgroups if cgroups is not None else Cgroups(), host)
    for report in reports:
        for lv in report.lvs:
            _add_lv(status, classes, contexts, report, lv, records, orphan_age, now, host,
                    enforcer)
    return status


def _crypt_device(host: Kernel, lv: LogicalVolume) -> str | None:
    """The LV's open dm-crypt device (found by its name: one stat), if any."""
    top = encryption.top_device(host, lv)
    return top.path if top.encrypted else None


def _add_lv(status: Status, classes: DeviceClasses,
            contexts: dict[tuple[str, str], _PoolContext], report: VgReport,
            lv: LogicalVolume, records: dict[str, VolumeRecord] | None, orphan_age: float,
            now: float, host: Kernel, enforcer: QosEnforcer) -> None:
    age = max(0, int(now) - lv.created) if lv.created else 0
    owner = classes.of_pool(lv.vg, lv.pool) if lv.pool else None
    # A thin LV of a pool that is no class's (a class taken out of the file)
    # is shown too, against its own pool, without a class.
    pool = contexts.get((lv.vg, lv.pool)) or _PoolContext(
        f"{lv.vg}/{lv.pool}", report.find(lv.pool) if lv.pool else None)
    device_class = owner.name if owner is not None else None
    if naming.is_csi_volume(lv) or naming.is_csi_snapshot(lv):
        info = _volume_info(lv, device_class, records, pool, age, orphan_age)
        limits = qos.limits_of(lv)
        published = info.published
        if limits:
            # Read, never written: what the node plugin's last round left.
            published = [dataclasses.replace(
                p, io_limits=enforcer.check(lv, p.target).describe()) for p in published]
        info = dataclasses.replace(
            info, encrypted=naming.TAG_ENCRYPTED in lv.tags,
            crypt_device=_crypt_device(host, lv), published=published,
            io_limits={k: v for k, v in limits.items() if v is not None})
        (status.volumes if info.kind == "volume" else status.snapshots).append(info)
        if info.possible_orphan:
            status.possible_orphans.append(Orphan(
                lv.name, "unused volume",
                f"neither staged nor published on this node, and older than "
                f"{duration_text(orphan_age)}", lv.created, age))
    elif lv.name.startswith(DHV_PREFIX) and lv.tag_value(dhv_tags.TAG_KIND):
        kind = lv.tag_value(dhv_tags.TAG_KIND) or "volume"
        status.host_volumes.append(HostVolumeInfo(
            lv=lv.name, kind=kind, source=lv.tag_value(dhv_tags.TAG_SOURCE),
            id=lv.tag_value(dhv_tags.TAG_SNAPSHOT if kind == dhv_tags.KIND_SNAPSHOT
                            else dhv_tags.TAG_ID),
            name=dhv_tags.decode_hex_tag(lv.tag_value(dhv_tags.TAG_NAME)),
            namespace=dhv_tags.decode_hex_tag(lv.tag_value(dhv_tags.TAG_NAMESPACE)),
            fs_type=lv.tag_value(dhv_tags.TAG_FS), size=lv.size,
            data_percent=lv.data_percent,
            condition=_condition(lv, pool.lv, pool.name, pool.fill, pool.metadata),
            created=lv.created, age_seconds=age, device_class=device_class,
            encrypted=dhv_tags.TAG_ENCRYPTED in lv.tags, crypt_device=_crypt_device(host, lv)))
    elif any(t.startswith(TAG_NAMESPACE) for t in lv.tags):
        status.possible_orphans.append(Orphan(lv.name, "stray LV", _stray_reason(lv),
                                              lv.created, age))


def _pool_info(pool: Pool, report: VgReport) -> tuple[PoolInfo, LogicalVolume | None,
                                                       str | None]:
    lv = report.find(pool.lvm.pool)
    if lv is None:
        return PoolInfo(pool.name, False, overprovision_ratio=pool.ratio,
                        problem=f"thin pool {pool.name} not found"), None, None
    if not lv.is_thin_pool:
        return PoolInfo(pool.name, True, lv.size, active=lv.active,
                        overprovision_ratio=pool.ratio,
                        problem=f"{pool.name} is not a thin pool"), None, None
    fill = pool.fill_problem(lv)
    return PoolInfo(pool.name, True, lv.size, lv.data_percent, lv.metadata_percent, lv.active,
                    lv.health, pool.capacity(report).available, pool.ratio, fill,
                    count_problem=pool.count_problem(report)), lv, fill


def _volume_info(lv: LogicalVolume, device_class: str | None,
                 records: dict[str, VolumeRecord] | None, pool: _PoolContext, age: int,
                 orphan_age: float) -> VolumeInfo:
    kind = "volume" if naming.is_csi_volume(lv) else "snapshot"
    rec = (records or {}).get(lv.name)
    staged = None
    published: list[Published] = []
    if rec is not None:
        if rec.staging is not None:
            s = rec.staging
            staged = Staged(s.path, str(s.access_type), s.fs_type)
        published = [Published(t, p.readonly) for t, p in sorted(rec.publishes.items())]
    unused = staged is None and not published
    orphan = (kind == "volume" and records is not None and unused and age > orphan_age)
    return VolumeInfo(
        id=lv.name, kind=kind, device_class=device_class, size=lv.size,
        data_percent=lv.data_percent, active=lv.active, source=_source(lv),
        co_names=naming.co_names(lv), staged=staged, published=published,
        condition=_condition(lv, pool.lv, pool.name, pool.fill, pool.metadata),
        created=lv.created,
        age_seconds=age, possible_orphan=orphan)


def _stray_reason(lv: LogicalVolume) -> str:
    kind = naming.kind(lv)
    if naming.is_volume_id(lv.name) or naming.is_snapshot_id(lv.name):
        return (f"named like a CSI {'volume' if naming.is_volume_id(lv.name) else 'snapshot'}"
                f" but tagged {naming.TAG_KIND}={kind or '(none)'}")
    return "carries csi-local tags but its name is not a CSI volume or snapshot ID"
