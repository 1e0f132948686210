"""The Prometheus endpoint of the CSI plugin (`serve --metrics-address`).

Two kinds of figures, in one registry of the plugin's own (never the global
one, so nothing else in the process leaks into it):

- events, counted as they happen through hooks that know nothing of
  Prometheus: the server's interceptor (RPCs), the runner (external
  commands), the pool monitor (autoextends) and the state store (rebuilds);
- the VGs, the thin pool of every device class and their volumes, read at
  scrape time by one collector from the pool monitors' shared readings
  (`PoolMonitor.latest`, one monitor per class), so a scrape costs at most
  one `lvs` per VG (the VG's size and free space come off its PVs), and
  none while the last reading is younger than `MAX_AGE` seconds. Pool and
  volume figures carry a `device_class` label.

Beside them, the process's own figures (`process_*`: CPU, memory, open
files; `python_*`: the interpreter and its garbage collector), and every
series carries the constant label `node`, the node's ID, as TopoLVM's do:
alerts and dashboards then name the node whatever the scrape adds.

The host volume plugin (csi_local.dhv) never imports this module.
"""

from __future__ import annotations

import logging
import platform
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any, overload
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from csi_local import __version__
from csi_local.config import parse_listen_address
from csi_local.errors import StorageError
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import naming
from csi_local.volumes.lifecycle import OPEN_FAILURE_REASONS
from csi_local.volumes.pool import capacity_of
from csi_local.volumes.pool_monitor import PoolMonitor, Reading
from csi_local.volumes.qos_enforcement import QosEnforcer, Reason

log = logging.getLogger(__name__)

NAMESPACE = "csi_local"
MAX_AGE = 5.0  # seconds a reading of the VG serves scrapes before it is refreshed
# From a fast RPC or `lvs` to a slow mkfs or a sync of a busy volume.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           float("inf"))
# Every pool and volume figure names its device class; a VG's figures do not
# (a VG may hold the pools of several classes).
POOL_LABELS = ("device_class", "volume_group", "thin_pool")
VOLUME_LABELS = ("volume_id", "pvc_name", "pvc_namespace", "device_class")


class NodeLabelled(Collector):
    """Every family of `inner`, each sample with the constant label `node`
    added (prometheus_client has no constant labels of its own)."""

    def __init__(self, inner: CollectorRegistry, node: str) -> None:
        self.inner = inner
        self.node = node

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, "node": self.node})
                           for s in family.samples]
            yield out


class Metrics:
    """The plugin's registry, its event metrics and the hooks that feed them.
    `registry` is what the endpoint serves: the figures of `own` (the plugin's
    and the process's), with the `node` label."""

    def __init__(self, node: str) -> None:
        # No `_created` series beside every counter and histogram: noise in
        # the text format (this sets a flag of the library, for the process).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.node = node
        self.own = CollectorRegistry()
        r = self.own
        # The library's process and interpreter collectors, registered here
        # (they are stateless readers of /proc and the interpreter).
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeLabelled(r, node))
        self.rpcs = Counter(
            "rpc_requests", "CSI RPCs handled, by method and gRPC status code (OK: success)",
            ["method", "code"], namespace=NAMESPACE, registry=r)
        self.rpc_seconds = Histogram(
            "rpc_duration_seconds", "Time to handle a CSI RPC, by method",
            ["method"], namespace=NAMESPACE, buckets=BUCKETS, registry=r)
        self.command_seconds = Histogram(
            "command_duration_seconds", "Time an external command took, by tool "
            "(lvs, lvcreate, mkfs.ext4, mount, ...)",
            ["tool"], namespace=NAMESPACE, buckets=BUCKETS, registry=r)
        self.command_failures = Counter(
            "command_failures", "External commands that failed (an exit code not "
            "expected, a timeout, or the tool missing), by tool",
            ["tool"], namespace=NAMESPACE, registry=r)
        self.state_rebuilds = Counter(
            "state_rebuilds", "Times the state file was rebuilt from the mount table and "
            "LVM because it was missing or corrupt (a first start counts)",
            namespace=NAMESPACE, registry=r)
        self.autoextends = Counter(
            "pool_autoextend", "Times the plugin extended a device class's thin pool's "
            "data or metadata", ["what", "device_class"], namespace=NAMESPACE, registry=r)
        self.autoextend_bytes = Counter(
            "pool_autoextend_bytes", "Bytes the plugin's autoextends added to a device "
            "class's thin pool's data or metadata", ["what", "device_class"],
            namespace=NAMESPACE, registry=r)
        self.open_failures = Counter(
            "encryption_open_failures", "Times an encrypted volume's dm-crypt device did not "
            f"open at stage or expand, by reason ({', '.join(OPEN_FAILURE_REASONS)})",
            ["reason"], namespace=NAMESPACE, registry=r)
        # Every reason present at 0 from the start: a first failure is then an
        # increase() an alert sees, not a series that appears (at 1) from none.
        for reason in OPEN_FAILURE_REASONS:
            self.open_failures.labels(reason=reason)
        self.qos_unenforced_total = Counter(
            "qos_unenforced", "Times a published volume's IO limits could not be enforced "
            f"on its workload, by reason ({', '.join(Reason)}); the mount stands",
            ["reason"], namespace=NAMESPACE, registry=r)
        for qos_reason in Reason:
            self.qos_unenforced_total.labels(reason=str(qos_reason))
        # No start time of its own: process_start_time_seconds (the process
        # collector's) says when the plugin started. The interpreter's version
        # beside the plugin's: the image's Python is Debian's, and changes
        # with the base image, not with csi-local's version.
        info = Gauge("build_info", "The plugin's version and its Python's (always 1)",
                     ["version", "python"], namespace=NAMESPACE, registry=r)
        info.labels(version=__version__, python=platform.python_version()).set(1)

    # hooks -------------------------------------------------------------------

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """For server.ErrorInterceptor: one RPC's outcome and time."""
        self.rpcs.labels(method=method, code=code).inc()
        self.rpc_seconds.labels(method=method).observe(seconds)

    def observe_command(self, tool: str, seconds: float, ok: bool) -> None:
        """For runner.ProcessRunner: one external command's time and outcome."""
        self.command_seconds.labels(tool=tool).observe(seconds)
        if not ok:
            self.command_failures.labels(tool=tool).inc()

    def observe_extend(self, what: str, size: int, *, device_class: str) -> None:
        """The thin pool of `device_class` grew: its data or metadata, by `size`
        bytes. For monitor.PoolMonitor through extend_observer."""
        self.autoextends.labels(what=what, device_class=device_class).inc()
        self.autoextend_bytes.labels(what=what, device_class=device_class).inc(size)

    def extend_observer(self, device_class: str) -> Callable[[str, int], None]:
        """The `on_extend` hook of the PoolMonitor of `device_class`'s pool."""

        def observe(what: str, size: int) -> None:
            self.observe_extend(what, size, device_class=device_class)

        return observe

    def state_rebuilt(self) -> None:
        self.state_rebuilds.inc()

    def open_failed(self, reason: str) -> None:
        """For VolumeSteps.open_device: an encrypted volume that did not open.
        The reason only: never the volume's key, nor its secret's name."""
        self.open_failures.labels(reason=reason).inc()

    def qos_unenforced(self, reason: str) -> None:
        """For QosEnforcer: a publish whose IO limits did not reach its workload."""
        self.qos_unenforced_total.labels(reason=reason).inc()

    def watch_qos(self, enforcer: QosEnforcer) -> QosCollector:
        """Export each publish's configured and enforced IO limits, from the
        enforcer's last outcomes (no read at scrape time)."""
        collector = QosCollector(enforcer)
        self.own.register(collector)
        return collector

    def watch(self, monitors: Sequence[PoolMonitor], max_age: float = MAX_AGE) -> PoolCollector:
        """Export the VGs, pools and volumes that `monitors` (one per device
        class) read, through one collector: the registry refuses a second one
        (the same metric names). Once, with every class's monitor."""
        collector = PoolCollector(monitors, max_age)
        self.own.register(collector)
        for monitor in monitors:  # present at 0, so increase() works from the start
            for what in ("data", "metadata"):
                self.autoextends.labels(what=what, device_class=monitor.pool.class_name)
                self.autoextend_bytes.labels(what=what, device_class=monitor.pool.class_name)
        return collector


class QosCollector(Collector):
    """csi_local_volume_io_limit: each published volume's configured limits
    (one series per limit set, by io.max key: bytes or operations per
    second); csi_local_volume_io_limit_enforced: 1 where a publish's workload
    holds them, 0 where it does not (see the log, `csi-local status`)."""

    def __init__(self, enforcer: QosEnforcer) -> None:
        self.enforcer = enforcer

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily(
            f"{NAMESPACE}_volume_io_limit", "A published volume's configured IO limit, by "
            "io.max key (rbps, wbps: bytes/s; riops, wiops: operations/s)",
            labels=["volume_id", "limit"])
        enforced = GaugeMetricFamily(
            f"{NAMESPACE}_volume_io_limit_enforced", "1 when a publish's workload cgroup "
            "holds the volume's IO limits, 0 when they are not enforced",
            labels=["volume_id", "target"])
        seen: set[str] = set()
        for (volume_id, target), outcome in sorted(self.enforcer.last.items()):
            if not outcome.limits:
                continue
            if volume_id not in seen:
                seen.add(volume_id)
                for key, value in outcome.limits.items():
                    if value is not None:
                        limit.add_metric([volume_id, key], value)
            enforced.add_metric([volume_id, target], 1.0 if outcome.enforced else 0.0)
        yield limit
        yield enforced


VG_LABELS = ("volume_group",)
# Every family the collector exports: name (without the namespace) -> help, labels.
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "thin_pool_data_limit_ratio": (
        "New volumes and snapshots are refused at or above this data fill (0-1)", POOL_LABELS),
    "thin_pool_metadata_limit_ratio": (
        "New volumes and snapshots are refused at or above this metadata fill (0-1)",
        POOL_LABELS),
    "thin_pool_autoextend_threshold_ratio": (
        "The plugin extends the thin pool at or above this fill (0-1; 0: never)",
        POOL_LABELS),
    "volume_group_up": (
        "1 when the plugin could read the volume group (the figures of it, its pools and "
        "their volumes are exported only then), 0 otherwise", VG_LABELS),
    "volume_group_size_bytes": ("Size of the volume group", VG_LABELS),
    "volume_group_metadata_consistent": (
        "1 when every PV of the volume group is present and holds its newest metadata; "
        "0 when one is missing or holds an outdated or differing copy (the plugin then "
        "asks LVM for every answer; csi-local doctor names the PV)", VG_LABELS),
    "volume_group_free_bytes": (
        "Unallocated space in the volume group (what its thin pools can be extended by)",
        VG_LABELS),
    "volume_group_metadata_area_used_bytes": (
        "Bytes of text the volume group's metadata takes in each of its metadata areas",
        VG_LABELS),
    "volume_group_metadata_area_limit_bytes": (
        "The largest metadata text LVM writes into the volume group's smallest metadata "
        "area in use (half the area less a sector); past it every LVM change of the VG "
        "fails", VG_LABELS),
    "volume_group_metadata_area_used_ratio": (
        "How full the volume group's smallest metadata area is (used / limit); new volumes "
        "and snapshots are refused when one more no longer surely fits", VG_LABELS),
    "thin_pool_size_bytes": ("Size of the thin pool's data", POOL_LABELS),
    "thin_pool_metadata_size_bytes": ("Size of the thin pool's metadata", POOL_LABELS),
    "thin_pool_data_used_ratio": ("How full the thin pool's data is (0-1)", POOL_LABELS),
    "thin_pool_metadata_used_ratio": ("How full the thin pool's metadata is (0-1)",
                                      POOL_LABELS),
    "thin_pool_provisioned_bytes": (
        "Virtual sizes of every thin LV in the pool, added up", POOL_LABELS),
    "thin_pool_available_bytes": (
        "Room for new volumes, over-provisioning included, as GetCapacity reports it while "
        "the pool is below its high-water marks", POOL_LABELS),
    "thin_pool_healthy": (
        "1 when LVM reports no health problem of the thin pool (lv_health_status empty), "
        "else 0", POOL_LABELS),
    "thin_pool_health_status": (
        "1 for the thin pool's lv_health_status, 0 for the others (each pool has every "
        "status, so the series stay; other: a status not listed)",
        (*POOL_LABELS, "status")),
    "volumes": ("CSI volumes in the device class's thin pool", POOL_LABELS),
    "snapshots": ("CSI snapshots in the device class's thin pool", POOL_LABELS),
    "encrypted_volumes": ("CSI volumes in the device class's thin pool that are encrypted "
                          "(LUKS2)", POOL_LABELS),
    "volume_size_bytes": ("Virtual size of a CSI volume", VOLUME_LABELS),
    "volume_data_used_ratio": (
        "How much of a CSI volume's virtual size the thin pool has allocated (0-1; absent "
        "while the volume is inactive)", VOLUME_LABELS),
}


# LVM's lv_health_status of a thin pool (lvm2's report.c), a fixed set so that
# a pool's series do not come and go with its health; "other" for any else.
HEALTH_STATUSES = ("out_of_data", "metadata_read_only", "failed", "partial", "other")


def _health_status(health: str) -> str:
    return health if health in HEALTH_STATUSES else "other"


@overload
def _ratio(percent: float) -> float: ...


@overload
def _ratio(percent: None) -> None: ...


def _ratio(percent: float | None) -> float | None:
    """LVM's and the flags' percentages as the 0-1 ratio every fill figure
    uses (Prometheus's convention, as volume_group_metadata_area_used_ratio),
    rounded so that 12.34% reads 0.1234, not 0.12340000000000001."""
    return None if percent is None else round(percent / 100, 6)


def _gauge(name: str) -> GaugeMetricFamily:
    doc, labels = FAMILIES[name]
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=list(labels))


def _pool_labels(monitor: PoolMonitor) -> list[str]:
    return [monitor.pool.class_name, monitor.lvm.vg, monitor.lvm.pool]


class PoolCollector(Collector):
    """The VGs, the thin pools of the device classes and their CSI volumes, at
    scrape time. Each family is yielded once, with a sample per class (or per
    VG): two families of one name would be two HELP lines in the text format.
    A VG is read once per scrape however many classes it holds."""

    def __init__(self, monitors: Sequence[PoolMonitor], max_age: float = MAX_AGE) -> None:
        if not monitors:
            raise ValueError("no pool monitor to export")
        self.monitors = list(monitors)
        self.max_age = max_age
        # Each VG's committed metadata, read off its PVs without a process.
        self.committed = {m.lvm.vg: m.pool.committed for m in self.monitors
                          if m.pool.committed is not None}

    def describe(self) -> Iterator[Metric]:
        """The names, without reading LVM: the registry refuses a second
        collector (or metric) of the same names at registration."""
        for name in FAMILIES:
            yield _gauge(name)

    def _by_vg(self) -> dict[str, list[PoolMonitor]]:
        groups: dict[str, list[PoolMonitor]] = {}
        for monitor in self.monitors:
            groups.setdefault(monitor.lvm.vg, []).append(monitor)
        return groups

    def _reading(self, group: list[PoolMonitor]) -> Reading | None:
        """One reading of a VG for all its classes: the newest recent one any of
        their monitors has (autoextend rounds keep theirs fresh), else one
        refresh through the first monitor."""
        recent = [r for m in group if (r := m.recent(self.max_age)) is not None]
        if recent:
            return max(recent, key=lambda r: r.taken)
        return group[0].latest(max_age=self.max_age)

    def collect(self) -> Iterator[Metric]:
        # The high-water marks need no LVM: alerts can compare against them always.
        for name, attr in (("data_limit_ratio", "data_limit"),
                           ("metadata_limit_ratio", "metadata_limit"),
                           ("autoextend_threshold_ratio", "autoextend_threshold")):
            family = _gauge(f"thin_pool_{name}")
            for monitor in self.monitors:
                family.add_metric(_pool_labels(monitor),
                                  _ratio(getattr(monitor.pool.policy, attr)))
            yield family
        readings = {vg: self._reading(group) for vg, group in self._by_vg().items()}
        up = _gauge("volume_group_up")
        for vg, reading in readings.items():
            up.add_metric([vg], 1 if reading is not None else 0)
        yield up
        read = {vg: r for vg, r in readings.items() if r is not None}
        if not read:
            return
        for name, attr in (("size_bytes", "size"), ("free_bytes", "free")):
            family = _gauge(f"volume_group_{name}")
            for vg, reading in read.items():
                family.add_metric([vg], getattr(reading.vg, attr))
            yield family
        # Only for a VG just read: one that is missing has no PV to disagree,
        # and check() finding no problem in it is no reading of consistency.
        consistent = _gauge("volume_group_metadata_consistent")
        for vg in sorted(read.keys() & self.committed.keys()):
            consistent.add_metric([vg], 0 if self.committed[vg].check(vg) else 1)
        if consistent.samples:
            yield consistent
        areas = {vg: r.report.metadata_area for vg, r in read.items()
                 if r.report.metadata_area is not None}
        for name in ("used_bytes", "limit_bytes", "used_ratio"):
            family = _gauge(f"volume_group_metadata_area_{name}")
            for vg, area in areas.items():
                family.add_metric([vg], {"used_bytes": area.used, "limit_bytes": area.limit,
                                         "used_ratio": round(area.used_ratio, 4)}[name])
            yield family
        readable = [(m, read[m.lvm.vg]) for m in self.monitors if m.lvm.vg in read]
        yield from self._pools(readable)
        yield from self._volumes(readable)

    def _pools(self, readable: list[tuple[PoolMonitor, Reading]]) -> Iterator[Metric]:
        figures = ("size_bytes", "metadata_size_bytes", "data_used_ratio", "metadata_used_ratio",
                   "provisioned_bytes", "available_bytes")
        families = {name: _gauge(f"thin_pool_{name}") for name in figures}
        health = _gauge("thin_pool_healthy")
        status = _gauge("thin_pool_health_status")
        for monitor, reading in readable:
            pool_lv = reading.report.find(monitor.lvm.pool)
            if pool_lv is None or not pool_lv.is_thin_pool:
                continue
            try:
                capacity = capacity_of(reading.report, monitor.lvm.pool, monitor.pool.ratio)
            except StorageError:
                continue
            labels = _pool_labels(monitor)
            values: dict[str, float | None] = {
                "size_bytes": pool_lv.size,
                "metadata_size_bytes": pool_lv.metadata_size,
                "data_used_ratio": _ratio(pool_lv.data_percent),
                "metadata_used_ratio": _ratio(pool_lv.metadata_percent),
                "provisioned_bytes": capacity.provisioned,
                "available_bytes": capacity.available,
            }
            for name, value in values.items():
                if value is not None:  # an inactive pool reports no fill
                    families[name].add_metric(labels, value)
            health.add_metric(labels, 0 if pool_lv.health else 1)
            current = _health_status(pool_lv.health) if pool_lv.health else None
            for name in HEALTH_STATUSES:
                status.add_metric([*labels, name], 1 if name == current else 0)
        for family in (*families.values(), health, status):
            if family.samples:
                yield family

    def _volumes(self, readable: list[tuple[PoolMonitor, Reading]]) -> Iterator[Metric]:
        counts = {"volumes": _gauge("volumes"), "snapshots": _gauge("snapshots"),
                  "encrypted_volumes": _gauge("encrypted_volumes")}
        size, data = _gauge("volume_size_bytes"), _gauge("volume_data_used_ratio")
        for monitor, reading in readable:
            # The reading is the whole VG's: only this class's pool's LVs.
            mine = [lv for lv in reading.report.lvs if lv.pool == monitor.lvm.pool]
            volumes = [lv for lv in mine if naming.is_csi_volume(lv)]
            snapshots = [lv for lv in mine if naming.is_csi_snapshot(lv)]
            counts["volumes"].add_metric(_pool_labels(monitor), len(volumes))
            counts["snapshots"].add_metric(_pool_labels(monitor), len(snapshots))
            counts["encrypted_volumes"].add_metric(
                _pool_labels(monitor), sum(naming.TAG_ENCRYPTED in lv.tags for lv in volumes))
            for lv in volumes:
                labels = _volume_labels(lv, monitor.pool.class_name)
                size.add_metric(labels, lv.size)
                if lv.data_percent is not None:
                    data.add_metric(labels, _ratio(lv.data_percent))
        yield from counts.values()
        yield size
        yield data


def _volume_labels(lv: LogicalVolume, device_class: str) -> list[str]:
    names = naming.co_names(lv)
    return [lv.name, names.get("pvc_name", ""), names.get("pvc_namespace", ""), device_class]


class MetricsServer:
    """The HTTP endpoint (/metrics, any path in fact) on threads of its own."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self.httpd = httpd
        self.thread = thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5.0)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape never holds the plugin's exit


class _DualStackServer(_Server):
    """On "::" with IPV6_V6ONLY off: every IPv6 address and, as mapped
    addresses, every IPv4 one, whatever the host's net.ipv6.bindv6only."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape is no event for the plugin's log."""


def _ipv6_available() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def serve_metrics(metrics: Metrics, address: str) -> MetricsServer:
    """Serve `metrics` on `address`: "host:port", "[v6]:port", or ":port" for
    every address, IPv6 and IPv4 (IPv4 only where the kernel has no IPv6).
    OSError when the address cannot be bound."""
    host, port = parse_listen_address(address)
    app = make_wsgi_app(metrics.registry)
    server_class: type[_Server]
    if host:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("_Server", (_Server,), {"address_family": family})
        host = str(sockaddr[0])
    elif _ipv6_available():
        server_class, host = _DualStackServer, "::"
    else:
        server_class, host = _Server, "0.0.0.0"  # noqa: S104 - every address was asked for
    httpd = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    log.info("serving metrics on %s/metrics", address)
    return MetricsServer(httpd, thread)
