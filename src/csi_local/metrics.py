"""The Prometheus endpoint of the CSI plugin (`serve --metrics-address`).

Two kinds of figures, in one registry of the plugin's own (never the global
one, so nothing else in the process leaks into it):

- events, counted as they happen through hooks that know nothing of
  Prometheus: the server's interceptor (RPCs), the runner (external
  commands), the pool monitor (autoextends) and the state store (rebuilds);
- the VG, its thin pool and its volumes, read at scrape time by a collector
  from the pool monitor's shared reading (`PoolMonitor.latest`), so a scrape
  costs at most one `lvs` and one `vgs`, and none while the last reading is
  younger than `MAX_AGE` seconds.

The host volume plugin (csi_local.dhv) never imports this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from csi_local import __version__
from csi_local import volumes as vols
from csi_local.config import parse_listen_address
from csi_local.errors import StorageError
from csi_local.lvm import LogicalVolume
from csi_local.monitor import PoolMonitor, Reading
from csi_local.pool import capacity_of

log = logging.getLogger(__name__)

NAMESPACE = "csi_local"
MAX_AGE = 5.0  # seconds a reading of the VG serves scrapes before it is refreshed
# From a fast RPC or `lvs` to a slow mkfs or a sync of a busy volume.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           float("inf"))
POOL_LABELS = ("volume_group", "thin_pool")
VOLUME_LABELS = ("volume_id", "pvc_name", "pvc_namespace")


class Metrics:
    """The plugin's registry, its event metrics and the hooks that feed them."""

    def __init__(self) -> None:
        # No `_created` series beside every counter and histogram: noise in
        # the text format (this sets a flag of the library, for the process).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        r = self.registry
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
            "pool_autoextend", "Times the plugin extended the thin pool's data or metadata",
            ["what"], namespace=NAMESPACE, registry=r)
        self.autoextend_bytes = Counter(
            "pool_autoextend_bytes", "Bytes the plugin's autoextends added to the thin "
            "pool's data or metadata", ["what"], namespace=NAMESPACE, registry=r)
        for what in ("data", "metadata"):  # present at 0, so increase() works from the start
            self.autoextends.labels(what=what)
            self.autoextend_bytes.labels(what=what)
        started = Gauge("start_time_seconds", "When the plugin started, in seconds since "
                        "the epoch", namespace=NAMESPACE, registry=r)
        started.set(time.time())
        info = Gauge("build_info", "The plugin's version (always 1)", ["version"],
                     namespace=NAMESPACE, registry=r)
        info.labels(version=__version__).set(1)

    # hooks -------------------------------------------------------------------

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """For server.ErrorInterceptor: one RPC's outcome and time."""
        self.rpcs.labels(method=method, code=code).inc()
        self.rpc_seconds.labels(method=method).observe(seconds)

    def observe_command(self, tool: str, seconds: float, ok: bool) -> None:
        """For runner.ShRunner: one external command's time and outcome."""
        self.command_seconds.labels(tool=tool).observe(seconds)
        if not ok:
            self.command_failures.labels(tool=tool).inc()

    def observe_extend(self, what: str, size: int) -> None:
        """For monitor.PoolMonitor: the pool's data or metadata grew by `size` bytes."""
        self.autoextends.labels(what=what).inc()
        self.autoextend_bytes.labels(what=what).inc(size)

    def state_rebuilt(self) -> None:
        self.state_rebuilds.inc()

    def watch(self, monitor: PoolMonitor, max_age: float = MAX_AGE) -> PoolCollector:
        """Export the VG, pool and volumes that `monitor` reads."""
        collector = PoolCollector(monitor, max_age)
        self.registry.register(collector)
        return collector


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=list(labels))


class PoolCollector(Collector):
    """The VG, its thin pool and the CSI volumes, at scrape time."""

    def __init__(self, monitor: PoolMonitor, max_age: float = MAX_AGE) -> None:
        self.monitor = monitor
        self.max_age = max_age

    def collect(self) -> Iterator[Metric]:
        lvm, policy = self.monitor.lvm, self.monitor.pool.policy
        pool_labels = [lvm.vg, lvm.pool]
        # The high-water marks need no LVM: alerts can compare against them always.
        for name, value, doc in (
            ("data_limit_percent", policy.data_limit,
             "New volumes and snapshots are refused at or above this data fill"),
            ("metadata_limit_percent", policy.metadata_limit,
             "New volumes and snapshots are refused at or above this metadata fill"),
            ("autoextend_threshold_percent", policy.autoextend_threshold,
             "The plugin extends the thin pool at or above this fill (0: never)"),
        ):
            family = _gauge(f"thin_pool_{name}", doc, POOL_LABELS)
            family.add_metric(pool_labels, value)
            yield family
        reading = self.monitor.latest(max_age=self.max_age)
        up = _gauge("volume_group_up", "1 when the plugin could read its volume group "
                    "(the figures below are exported only then), 0 otherwise",
                    ["volume_group"])
        up.add_metric([lvm.vg], 1 if reading is not None else 0)
        yield up
        if reading is None:
            return
        yield from self._volume_group(reading)
        yield from self._pool(reading, pool_labels)
        yield from self._volumes(reading)

    def _volume_group(self, reading: Reading) -> Iterator[Metric]:
        labels = [reading.vg.name]
        for name, value, doc in (
            ("size_bytes", reading.vg.size, "Size of the volume group"),
            ("free_bytes", reading.vg.free, "Unallocated space in the volume group "
             "(what the thin pool can be extended by)"),
        ):
            family = _gauge(f"volume_group_{name}", doc, ["volume_group"])
            family.add_metric(labels, value)
            yield family

    def _pool(self, reading: Reading, labels: list[str]) -> Iterator[Metric]:
        pool_lv = reading.report.find(self.monitor.lvm.pool)
        if pool_lv is None or not pool_lv.is_thin_pool:
            return
        try:
            capacity = capacity_of(reading.report, self.monitor.lvm.pool,
                                   self.monitor.pool.ratio)
        except StorageError:
            return
        figures: list[tuple[str, float | None, str]] = [
            ("size_bytes", pool_lv.size, "Size of the thin pool's data"),
            ("metadata_size_bytes", pool_lv.metadata_size, "Size of the thin pool's metadata"),
            ("data_percent", pool_lv.data_percent, "How full the thin pool's data is"),
            ("metadata_percent", pool_lv.metadata_percent,
             "How full the thin pool's metadata is"),
            ("provisioned_bytes", capacity.provisioned,
             "Virtual sizes of every thin LV in the pool, added up"),
            ("available_bytes", capacity.available,
             "Room for new volumes, over-provisioning included, as GetCapacity reports it "
             "while the pool is below its high-water marks"),
        ]
        for name, value, doc in figures:
            if value is None:  # an inactive pool reports no fill
                continue
            family = _gauge(f"thin_pool_{name}", doc, POOL_LABELS)
            family.add_metric(labels, value)
            yield family
        health = _gauge("thin_pool_healthy", "1 when LVM reports no health problem of the "
                        "thin pool; health_status is LVM's lv_health_status "
                        "(out_of_data, metadata_read_only, failed, ...)",
                        [*POOL_LABELS, "health_status"])
        health.add_metric([*labels, pool_lv.health], 0 if pool_lv.health else 1)
        yield health

    def _volumes(self, reading: Reading) -> Iterator[Metric]:
        volumes = [lv for lv in reading.report.lvs if vols.is_csi_volume(lv)]
        snapshots = [lv for lv in reading.report.lvs if vols.is_csi_snapshot(lv)]
        for name, count, doc in (
                ("volumes", len(volumes), "CSI volumes in the volume group"),
                ("snapshots", len(snapshots), "CSI snapshots in the volume group")):
            family = _gauge(name, doc)
            family.add_metric([], count)
            yield family
        size = _gauge("volume_size_bytes", "Virtual size of a CSI volume", VOLUME_LABELS)
        data = _gauge("volume_data_percent", "How much of a CSI volume's virtual size the "
                      "thin pool has allocated (absent while the volume is inactive)",
                      VOLUME_LABELS)
        for lv in volumes:
            labels = _volume_labels(lv)
            size.add_metric(labels, lv.size)
            if lv.data_percent is not None:
                data.add_metric(labels, lv.data_percent)
        yield size
        yield data


def _volume_labels(lv: LogicalVolume) -> list[str]:
    names = vols.co_names(lv)
    return [lv.name, names.get("pvc_name", ""), names.get("pvc_namespace", "")]


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


def serve_metrics(metrics: Metrics, address: str) -> MetricsServer:
    """Serve `metrics` on `address` ("host:port" or ":port", every IPv4 address);
    OSError when the address cannot be bound."""
    host, port = parse_listen_address(address)
    httpd, thread = start_http_server(port, host or "0.0.0.0", registry=metrics.registry)  # noqa: S104
    log.info("serving metrics on %s/metrics", address)
    return MetricsServer(httpd, thread)
