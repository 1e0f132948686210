"""The Prometheus endpoint: the collector over a FakeHost, the hooks of the
interceptor, the runner, the pool monitor and the state store, the flag, and
the promise that the host volume plugin never loads any of it."""

from __future__ import annotations

import ast
import functools
import logging
import platform
import signal
import socket
import subprocess
import threading
import time
import types
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from csi_local._gen import csi_pb2 as pb
from csi_local.cli import build_parser, config_from_args
from csi_local.config import Config, ConfigError, parse_listen_address
from csi_local.csi import plugin as plugin_mod
from csi_local.csi.server import ErrorInterceptor
from csi_local.errors import CommandError
from csi_local.host import runner as runner_mod
from csi_local.host.runner import ProcessRunner
from csi_local.ops import metrics as metrics_mod
from csi_local.ops.metrics import Metrics, serve_metrics
from csi_local.storage import vg_text
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.volumes import pool_monitor as monitor_mod
from csi_local.volumes.pool import PoolPolicy, Pools
from csi_local.volumes.pool_monitor import PoolMonitor
from tests.unit.servicers import (
    NO_CONTEXT,
    THREE_CLASSES,
    GiB,
    MiB,
    Node,
    make_class_node,
    make_node,
    mount_cap,
)

PVC = {"csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "ns"}
POOL_LABELS = {"device_class": "default", "volume_group": "vg0", "thin_pool": "pool0"}
NODE = "node-1"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: Metrics, *, process: bool = False) -> Samples:
    """Every sample of the registry, rendered and parsed back as Prometheus
    would, after checking each one's `node` label (which the keys leave out);
    the process's own figures only with `process`."""
    text = generate_latest(metrics.registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        if not process and family.name.startswith(("process_", "python_")):
            continue
        for s in family.samples:
            assert s.labels.get("node") == metrics.node, s
            labels = {k: v for k, v in s.labels.items() if k != "node"}
            key = (s.name, frozenset(labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            **node_args: Any) -> tuple[Node, PoolMonitor, Metrics]:
    node = make_node(tmp_path, monkeypatch, **node_args)
    metrics = Metrics(node=NODE)
    pool = node.backend.pools.default
    monitor = PoolMonitor(pool.lvm, pool, on_extend=metrics.extend_observer(pool.class_name))
    metrics.watch([monitor])
    return node, monitor, metrics


def create(node: Node, name: str, size: int = GiB,
           parameters: dict[str, str] | None = None) -> pb.Volume:
    return node.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[mount_cap()], parameters=parameters), NO_CONTEXT).volume


# the collector -------------------------------------------------------------------


def test_pool_volume_group_and_volumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = PoolPolicy(data_limit=85, metadata_limit=80, autoextend_threshold=70)
    node, _, metrics = watched(tmp_path, monkeypatch, ratio=2.0, policy=policy,
                               vg_size=20 * GiB)
    data = create(node, "pvc-data", GiB, PVC)
    plain = create(node, "pvc-plain", 512 * MiB)
    node.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="snap", source_volume_id=data.volume_id), NO_CONTEXT)
    node.host.lv("pool0").data_percent = 12.5
    node.host.lv("pool0").metadata_percent = 6.25  # 128 of its 2,048 metadata blocks
    node.host.lv(data.volume_id).data_percent = 40.0

    got = scrape(metrics)

    assert value(got, "csi_local_volume_group_up", volume_group="vg0") == 1
    assert value(got, "csi_local_volume_group_size_bytes", volume_group="vg0") == 20 * GiB
    pool = node.host.lv("pool0")
    assert value(got, "csi_local_volume_group_free_bytes", volume_group="vg0") == \
        20 * GiB - pool.size - pool.metadata_size
    # The VG's metadata area: what LVM reports of it (vg_mda_size, vg_mda_free).
    fvg = node.host.vgs["vg0"]
    limit = vg_text.max_text_size(fvg.mda_size)
    used = limit - (limit - fvg.mda_text) // 512 * 512
    assert value(got, "csi_local_volume_group_metadata_area_limit_bytes",
                 volume_group="vg0") == limit
    assert value(got, "csi_local_volume_group_metadata_area_used_bytes",
                 volume_group="vg0") == used
    assert value(got, "csi_local_volume_group_metadata_area_used_ratio",
                 volume_group="vg0") == round(used / limit, 4)
    assert value(got, "csi_local_thin_pool_size_bytes", **POOL_LABELS) == 10 * GiB
    assert value(got, "csi_local_thin_pool_metadata_size_bytes", **POOL_LABELS) == 8 * MiB
    assert value(got, "csi_local_thin_pool_data_used_ratio", **POOL_LABELS) == 0.125
    assert value(got, "csi_local_thin_pool_metadata_used_ratio", **POOL_LABELS) == 0.0625
    assert value(got, "csi_local_thin_pool_healthy", **POOL_LABELS) == 1
    assert value(got, "csi_local_thin_pool_data_limit_ratio", **POOL_LABELS) == 0.85
    assert value(got, "csi_local_thin_pool_metadata_limit_ratio", **POOL_LABELS) == 0.8
    assert value(got, "csi_local_thin_pool_autoextend_threshold_ratio", **POOL_LABELS) == 0.7
    # Volumes and the snapshot count against the pool, over-provisioned 2x.
    provisioned = GiB + 512 * MiB + GiB
    assert value(got, "csi_local_thin_pool_provisioned_bytes", **POOL_LABELS) == provisioned
    capacity = node.controller.GetCapacity(pb.GetCapacityRequest(), NO_CONTEXT)
    assert capacity.available_capacity == 20 * GiB - provisioned
    assert value(got, "csi_local_thin_pool_available_bytes", **POOL_LABELS) == \
        capacity.available_capacity
    assert value(got, "csi_local_volumes", **POOL_LABELS) == 2
    assert value(got, "csi_local_snapshots", **POOL_LABELS) == 1
    labelled = {"volume_id": data.volume_id, "pvc_name": "data", "pvc_namespace": "ns",
                "device_class": "default"}
    unlabelled = {"volume_id": plain.volume_id, "pvc_name": "", "pvc_namespace": "",
                  "device_class": "default"}
    assert value(got, "csi_local_volume_size_bytes", **labelled) == GiB
    assert value(got, "csi_local_volume_size_bytes", **unlabelled) == 512 * MiB
    assert value(got, "csi_local_volume_data_used_ratio", **labelled) == 0.4
    # One series per volume, none for the snapshot or the pool.
    per_volume = [k for k in got if k[0] == "csi_local_volume_size_bytes"]
    assert len(per_volume) == 2
    assert value(got, "csi_local_build_info", version=__import__("csi_local").__version__,
                 python=platform.python_version()) == 1


def test_every_fill_is_a_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One unit for every fill, limit and threshold: a 0-1 `_ratio`
    (Prometheus's base unit), never a `_percent`, so that one alert or
    panel compares them all; LVM's 99.99% reads 0.9999, not 0.9999000000000001."""
    node, _, metrics = watched(tmp_path, monkeypatch)
    volume = create(node, "pvc-data", GiB, PVC)
    node.host.lv("pool0").data_percent = 99.99
    node.host.lv(volume.volume_id).data_percent = 12.34
    got = scrape(metrics)
    assert not {n for n in names(got) if "percent" in n}
    assert not [n for n in metrics_mod.FAMILIES if "percent" in n]
    assert value(got, "csi_local_thin_pool_data_used_ratio", **POOL_LABELS) == 0.9999
    assert value(got, "csi_local_volume_data_used_ratio", volume_id=volume.volume_id,
                 pvc_name="data", pvc_namespace="ns", device_class="default") == 0.1234
    ratios = {k: v for k, v in got.items() if k[0].endswith("_ratio")}
    assert len({k[0] for k in ratios}) == 7
    assert all(0 <= v <= 1 for v in ratios.values())


def test_every_open_failure_reason_is_exported_from_the_start() -> None:
    """Each reason at 0 before any failure, so that increase() sees the first
    one (a series that appears at 1 has no increase), and rate() works on a
    node that never failed."""
    metrics = Metrics(node=NODE)
    got = scrape(metrics)
    reasons = {s["reason"]: value(got, "csi_local_encryption_open_failures_total", **s)
               for s in series(got, "csi_local_encryption_open_failures_total")}
    assert reasons == {"key_refused": 0, "key_missing": 0, "mismatch": 0, "error": 0}
    metrics.open_failed("mismatch")
    assert value(scrape(metrics), "csi_local_encryption_open_failures_total",
                 reason="mismatch") == 1


def test_an_unhealthy_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, metrics = watched(tmp_path, monkeypatch)
    fake_row = node.host._row

    def row(lv: Any, fields: Any, argv: Any) -> dict[str, str]:
        out = fake_row(lv, fields, argv)
        if "lv_health_status" in out and lv.kind == "pool":
            out["lv_health_status"] = "out_of_data"
        return out

    healthy = scrape(metrics)
    monkeypatch.setattr(node.host, "_row", row)
    monkeypatch.setattr(metrics_mod.PoolCollector, "_reading",
                        lambda self, group: group[0].latest(max_age=0))
    got = scrape(metrics)
    assert value(got, "csi_local_thin_pool_healthy", **POOL_LABELS) == 0
    assert value(got, "csi_local_thin_pool_health_status", status="out_of_data",
                 **POOL_LABELS) == 1
    # A fixed label set: the same series, healthy or not (a status in a label
    # of its own would end one series and start another at every change).
    assert set(got) == set(healthy)
    statuses = {dict(k[1])["status"]: v for k, v in got.items()
                if k[0] == "csi_local_thin_pool_health_status"}
    assert statuses == {"out_of_data": 1, "metadata_read_only": 0, "failed": 0,
                        "partial": 0, "other": 0}
    assert {dict(k[1])["status"]: v for k, v in healthy.items()
            if k[0] == "csi_local_thin_pool_health_status"} == dict.fromkeys(statuses, 0)


@pytest.mark.usefixtures("reads")
def test_a_scrape_reuses_a_recent_reading(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, metrics = watched(tmp_path, monkeypatch)
    create(node, "pvc-a", GiB, PVC)
    # A reading: one `lvs`, and the VG's room from its committed metadata, else a `vgs`.
    vgs_read = 0 if node.host.pv_metadata else 1
    lvs, vgs = len(node.host.commands("lvs")), len(node.host.commands("vgs"))
    scrape(metrics)
    assert (len(node.host.commands("lvs")), len(node.host.commands("vgs"))) == (
        lvs + 1, vgs + vgs_read)
    first = scrape(metrics)  # within 5 s: no LVM at all
    assert (len(node.host.commands("lvs")), len(node.host.commands("vgs"))) == (
        lvs + 1, vgs + vgs_read)
    assert value(first, "csi_local_volumes", **POOL_LABELS) == 1

    create(node, "pvc-b", GiB)
    lvs, vgs = len(node.host.commands("lvs")), len(node.host.commands("vgs"))
    real_time = time.time
    monkeypatch.setattr(monitor_mod, "time", types.SimpleNamespace(time=lambda: real_time() + 6))
    later = scrape(metrics)  # older than 5 s: read once more
    assert (len(node.host.commands("lvs")), len(node.host.commands("vgs"))) == (
        lvs + 1, vgs + vgs_read)
    assert value(later, "csi_local_volumes", **POOL_LABELS) == 2


def test_a_missing_volume_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, metrics = watched(tmp_path, monkeypatch, with_vg=False)
    got = scrape(metrics)
    assert value(got, "csi_local_volume_group_up", volume_group="vg0") == 0
    lvm_families = {"csi_local_volume_group_size_bytes", "csi_local_thin_pool_size_bytes",
                    "csi_local_thin_pool_available_bytes", "csi_local_volumes",
                    "csi_local_volume_size_bytes", "csi_local_thin_pool_healthy",
                    "csi_local_volume_group_metadata_area_used_ratio"}
    assert not names(got) & lvm_families
    # What needs no LVM is still there for alerts.
    assert value(got, "csi_local_thin_pool_data_limit_ratio", **POOL_LABELS) == 0.9


def test_a_volume_group_without_its_pool(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, metrics = watched(tmp_path, monkeypatch, with_pool=False)
    got = scrape(metrics)
    assert value(got, "csi_local_volume_group_up", volume_group="vg0") == 1
    assert "csi_local_volume_group_size_bytes" in names(got)
    assert "csi_local_thin_pool_size_bytes" not in names(got)
    assert value(got, "csi_local_volumes", **POOL_LABELS) == 0


def test_autoextends_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = PoolPolicy(autoextend_threshold=70, autoextend_percent=20)
    node, monitor, metrics = watched(tmp_path, monkeypatch, policy=policy, vg_size=20 * GiB)
    before = scrape(metrics)
    assert value(before, "csi_local_pool_autoextend_total", what="data",
                 device_class="default") == 0
    assert value(before, "csi_local_pool_autoextend_bytes_total", what="metadata",
                 device_class="default") == 0
    node.host.lv("pool0").data_percent = 75.0
    monitor.check()
    got = scrape(metrics)
    assert value(got, "csi_local_pool_autoextend_total", what="data",
                 device_class="default") == 1
    assert value(got, "csi_local_pool_autoextend_bytes_total", what="data",
                 device_class="default") == 2 * GiB
    assert value(got, "csi_local_pool_autoextend_total", what="metadata",
                 device_class="default") == 0
    assert value(got, "csi_local_thin_pool_size_bytes", **POOL_LABELS) == 12 * GiB


# device classes -------------------------------------------------------------------------

CLASSES = THREE_CLASSES  # two VGs; vg-hdd holds the pools of two classes
FAST = {"device_class": "fast", "volume_group": "vg-nvme", "thin_pool": "pool"}
BIG = {"device_class": "big", "volume_group": "vg-hdd", "thin_pool": "pool"}
COLD = {"device_class": "cold", "volume_group": "vg-hdd", "thin_pool": "cold"}


def class_watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  **node_args: Any) -> tuple[Node, dict[str, PoolMonitor], Metrics]:
    """A node with CLASSES, its monitors by class, as the plugin wires them."""
    node = make_class_node(tmp_path, monkeypatch, CLASSES, **node_args)
    metrics = Metrics(node=NODE)
    monitors = {pool.class_name: PoolMonitor(pool.lvm, pool,
                                             on_extend=metrics.extend_observer(pool.class_name))
                for pool in node.backend.pools}
    metrics.watch(list(monitors.values()))
    return node, monitors, metrics


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for n, labels in samples if n == name]


@pytest.mark.usefixtures("reads")
def test_every_class_is_exported_once_with_its_label(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, metrics = class_watched(tmp_path, monkeypatch)
    fast = create(node, "pvc-fast", GiB, PVC)  # no deviceClass: the default class
    big = create(node, "pvc-big", 2 * GiB, {"deviceClass": "big"})
    cold = create(node, "pvc-cold", 512 * MiB, {"deviceClass": "cold"})
    node.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="snap", source_volume_id=big.volume_id), NO_CONTEXT)
    node.host.lv("pool", vg="vg-hdd").data_percent = 30.0
    lvs, vgs = len(node.host.commands("lvs")), len(node.host.commands("vgs"))

    got = scrape(metrics)  # one collector, every family once: no duplicate series

    # One `lvs` and one `vgs` per VG, not per class (no `vgs` where the VG's
    # committed metadata tells its room).
    assert (len(node.host.commands("lvs")), len(node.host.commands("vgs"))) == (
        lvs + 2, vgs + (0 if node.host.pv_metadata else 2))
    for name in ("csi_local_thin_pool_size_bytes", "csi_local_thin_pool_available_bytes",
                 "csi_local_thin_pool_data_limit_ratio", "csi_local_volumes",
                 "csi_local_snapshots"):
        found = [frozenset(labels.items()) for labels in series(got, name)]
        assert sorted(found, key=sorted) == sorted(
            (frozenset(c.items()) for c in (FAST, BIG, COLD)), key=sorted), name
    assert sorted(s["volume_group"] for s in series(got, "csi_local_volume_group_up")) == \
        ["vg-hdd", "vg-nvme"]
    assert sorted(s["volume_group"] for s in series(got, "csi_local_volume_group_size_bytes")) \
        == ["vg-hdd", "vg-nvme"]
    assert value(got, "csi_local_thin_pool_data_used_ratio", **BIG) == 0.3
    assert value(got, "csi_local_thin_pool_data_used_ratio", **COLD) == 0.0
    # Each pool's own arithmetic: big is over-provisioned 2x, its snapshot counts.
    assert value(got, "csi_local_thin_pool_provisioned_bytes", **BIG) == 4 * GiB
    assert value(got, "csi_local_thin_pool_available_bytes", **BIG) == 20 * GiB - 4 * GiB
    assert value(got, "csi_local_thin_pool_available_bytes", **FAST) == 10 * GiB - GiB
    assert value(got, "csi_local_thin_pool_available_bytes", **COLD) == 10 * GiB - 512 * MiB
    assert value(got, "csi_local_thin_pool_healthy", **COLD) == 1
    counts = {c["device_class"]: (value(got, "csi_local_volumes", **c),
                                  value(got, "csi_local_snapshots", **c))
              for c in (FAST, BIG, COLD)}
    assert counts == {"fast": (1, 0), "big": (1, 1), "cold": (1, 0)}
    # A volume of each class carries its class.
    assert value(got, "csi_local_volume_size_bytes", volume_id=fast.volume_id, pvc_name="data",
                 pvc_namespace="ns", device_class="fast") == GiB
    assert value(got, "csi_local_volume_size_bytes", volume_id=big.volume_id, pvc_name="",
                 pvc_namespace="", device_class="big") == 2 * GiB
    assert value(got, "csi_local_volume_size_bytes", volume_id=cold.volume_id, pvc_name="",
                 pvc_namespace="", device_class="cold") == 512 * MiB
    assert len(series(got, "csi_local_volume_size_bytes")) == 3


def test_a_class_whose_volume_group_is_missing(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, metrics = class_watched(tmp_path, monkeypatch)
    create(node, "pvc-fast", GiB)
    node.host.set_vg_present("vg-hdd", False)
    got = scrape(metrics)
    assert value(got, "csi_local_volume_group_up", volume_group="vg-hdd") == 0
    assert value(got, "csi_local_volume_group_up", volume_group="vg-nvme") == 1
    # The other class is exported in full; the missing VG's classes only by
    # what needs no LVM.
    assert series(got, "csi_local_thin_pool_size_bytes") == [FAST]
    assert series(got, "csi_local_volumes") == [FAST]
    assert series(got, "csi_local_volume_group_size_bytes") == [{"volume_group": "vg-nvme"}]
    assert len(series(got, "csi_local_thin_pool_metadata_limit_ratio")) == 3


def test_autoextends_are_counted_by_class(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    policy = PoolPolicy(autoextend_threshold=70, autoextend_percent=20)
    node, monitors, metrics = class_watched(tmp_path, monkeypatch, policy=policy)
    node.host.vgs["vg-hdd"].size += 10 * GiB  # room to grow
    before = scrape(metrics)
    assert {(s["what"], s["device_class"]) for s in
            series(before, "csi_local_pool_autoextend_total")} == {
        (w, c) for w in ("data", "metadata") for c in ("fast", "big", "cold")}
    node.host.lv("pool", vg="vg-hdd").data_percent = 75.0
    for monitor in monitors.values():
        monitor.check()
    got = scrape(metrics)
    assert value(got, "csi_local_pool_autoextend_total", what="data", device_class="big") == 1
    assert value(got, "csi_local_pool_autoextend_bytes_total", what="data",
                 device_class="big") == 2 * GiB
    assert value(got, "csi_local_pool_autoextend_total", what="data", device_class="fast") == 0
    assert value(got, "csi_local_pool_autoextend_total", what="data", device_class="cold") == 0
    assert value(got, "csi_local_thin_pool_size_bytes", **BIG) == 12 * GiB
    assert value(got, "csi_local_thin_pool_size_bytes", **COLD) == 10 * GiB


def test_one_collector_for_every_class(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """prometheus_client refuses a second collector of the same names: the
    plugin registers one over all its monitors."""
    _, monitors, metrics = class_watched(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        metrics.watch([monitors["fast"]])
    with pytest.raises(ValueError, match="no pool monitor"):
        metrics.watch([])


# the RPC hook -----------------------------------------------------------------------


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code.name)


def _through_interceptor(interceptor: ErrorInterceptor, method: str,
                         fn: Callable[[Any, Any], Any], request: Any) -> str:
    """Call `fn` as the server would, through the interceptor: the code sent."""
    details = types.SimpleNamespace(method=f"/csi.v1.Controller/{method}")
    handler = interceptor.intercept_service(
        lambda _: grpc.unary_unary_rpc_method_handler(fn),
        cast(grpc.HandlerCallDetails, details))
    assert handler is not None and handler.unary_unary is not None
    try:
        handler.unary_unary(request, cast(grpc.ServicerContext, _Context()))
    except _Aborted as aborted:
        return str(aborted)
    return "OK"


def test_rpcs_are_counted_by_method_and_code(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, metrics = watched(tmp_path, monkeypatch)
    interceptor = ErrorInterceptor(metrics.observe_rpc)
    good = pb.CreateVolumeRequest(name="pvc", volume_capabilities=[mount_cap()],
                                  capacity_range=pb.CapacityRange(required_bytes=GiB))
    no_caps = pb.CreateVolumeRequest(name="pvc")

    def broken(request: Any, context: Any) -> Any:
        raise RuntimeError("a bug")

    assert _through_interceptor(interceptor, "CreateVolume", node.controller.CreateVolume,
                                good) == "OK"
    assert _through_interceptor(interceptor, "CreateVolume", node.controller.CreateVolume,
                                good) == "OK"
    assert _through_interceptor(interceptor, "CreateVolume", node.controller.CreateVolume,
                                no_caps) == "INVALID_ARGUMENT"
    assert _through_interceptor(interceptor, "DeleteVolume", broken,
                                pb.DeleteVolumeRequest()) == "INTERNAL"
    got = scrape(metrics)
    assert value(got, "csi_local_rpc_requests_total", method="CreateVolume", code="OK") == 2
    assert value(got, "csi_local_rpc_requests_total", method="CreateVolume",
                 code="INVALID_ARGUMENT") == 1
    assert value(got, "csi_local_rpc_requests_total", method="DeleteVolume",
                 code="INTERNAL") == 1
    assert value(got, "csi_local_rpc_duration_seconds_count", method="CreateVolume") == 3
    assert value(got, "csi_local_rpc_duration_seconds_bucket", method="CreateVolume",
                 le="+Inf") == 3
    assert value(got, "csi_local_rpc_duration_seconds_count", method="DeleteVolume") == 1
    assert not any(name.endswith("_created") for name in names(got))


def test_a_failing_observer_never_fails_an_rpc(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    node = make_node(tmp_path, monkeypatch)

    def observer(method: str, code: str, seconds: float) -> None:
        raise RuntimeError("metrics broke")

    req = pb.CreateVolumeRequest(name="pvc", volume_capabilities=[mount_cap()])
    assert _through_interceptor(ErrorInterceptor(observer), "CreateVolume",
                                node.controller.CreateVolume, req) == "OK"
    assert _through_interceptor(ErrorInterceptor(), "CreateVolume",
                                node.controller.CreateVolume, req) == "OK"


# the command hook (ProcessRunner over a fake Popen: no process) ------------------------


class _FakePopen:
    """subprocess.Popen for one argv: the exit code is the first argument;
    "hang" runs until the runner's timeout kills it."""

    def __init__(self, argv: tuple[str, ...], **kwargs: Any) -> None:
        self.args = argv[1:]
        self.returncode: int | None = None
        self.killed = threading.Event()

    def communicate(self, input: str | None = None) -> tuple[str, str]:
        if self.args and self.args[0] == "hang":
            self.killed.wait()
        self.returncode = -9 if self.killed.is_set() else (
            int(self.args[0]) if self.args and self.args[0].isdigit() else 0)
        return "", ""

    def kill(self) -> None:
        self.killed.set()

    def wait(self) -> int:
        return self.returncode or 0


def test_commands_are_timed_and_failures_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(runner_mod, "_kill", _FakePopen.kill)  # no process group to kill

    def resolve(tool: str) -> str:
        if tool == "missing":
            raise CommandError([tool], 127, "", f"{tool}: command not found")
        return f"/usr/sbin/{tool}"

    monkeypatch.setattr(runner_mod, "resolve", resolve)
    metrics = Metrics(node=NODE)
    runner = ProcessRunner(observe=metrics.observe_command)
    runner.run(["lvcreate", "0"])
    runner.run(["/sbin/lvcreate", "0"])  # the tool is argv[0]'s basename
    runner.run(["lvs", "5"], ok_codes=(0, 5))  # an expected exit code is no failure
    with pytest.raises(CommandError):
        runner.run(["mkfs.ext4", "1"])
    with pytest.raises(CommandError) as timed_out:
        runner.run(["mount", "hang"], timeout=0.05)
    assert timed_out.value.timed_out
    with pytest.raises(CommandError):
        runner.run(["missing"])
    got = scrape(metrics)
    assert value(got, "csi_local_command_duration_seconds_count", tool="lvcreate") == 2
    assert value(got, "csi_local_command_duration_seconds_count", tool="lvs") == 1
    assert value(got, "csi_local_command_duration_seconds_count", tool="mkfs.ext4") == 1
    assert value(got, "csi_local_command_failures_total", tool="mkfs.ext4") == 1
    assert value(got, "csi_local_command_failures_total", tool="mount") == 1
    assert value(got, "csi_local_command_failures_total", tool="missing") == 1
    assert ("csi_local_command_failures_total", frozenset({("tool", "lvcreate")})) not in got
    assert ("csi_local_command_failures_total", frozenset({("tool", "lvs")})) not in got


def test_a_failing_command_observer_never_fails_a_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", _FakePopen)
    monkeypatch.setattr(runner_mod, "_kill", _FakePopen.kill)  # no process group to kill
    monkeypatch.setattr(runner_mod, "resolve", lambda tool: f"/usr/sbin/{tool}")

    def observer(tool: str, seconds: float, ok: bool) -> None:
        raise RuntimeError("metrics broke")

    assert ProcessRunner(observe=observer).run(["lvs", "0"]).returncode == 0
    with pytest.raises(CommandError) as err:
        ProcessRunner(observe=observer).run(["lvs", "3"])
    assert err.value.returncode == 3


# the plugin's wiring and the endpoint ----------------------------------------------------


def _config(tmp_path: Path, **kw: Any) -> Config:
    return Config(endpoint=f"unix://{tmp_path}/csi.sock", node_id="n", volume_group="vg0",
                  thin_pool="pool0", state_dir=str(tmp_path / "state"),
                  lock_dir=str(tmp_path / "locks"), **kw)


def test_the_plugin_warms_the_listing_once_serving_and_only_logs_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The VGs' whole parse (Pools.warm) runs in the background once the server
    answers (CsiPlugin.start), never during the build before it; a failure of
    it is logged at debug level and ends nothing."""
    monkeypatch.setattr(plugin_mod, "rebuild_state", lambda lvm, host: {})
    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    monkeypatch.setattr(plugin_mod, "reconcile_state", lambda lvm, host, records: records)
    warmed: list[str] = []

    def warm(pools: Pools) -> None:
        warmed.append(threading.current_thread().name)
        raise CommandError(("pvs",), 5, "", "no answer")

    monkeypatch.setattr(Pools, "warm", warm)
    plugin = plugin_mod.CsiPlugin(_config(tmp_path, lvm_shell=False))
    try:
        assert warmed == []  # not in the start before the socket serves
        with caplog.at_level(logging.DEBUG, logger=plugin_mod.__name__):
            plugin.start()
            for thread in threading.enumerate():
                if thread.name == "warm-listing":
                    thread.join(10)
        assert warmed == ["warm-listing"]
        (record,) = [r for r in caplog.records if "warming" in r.getMessage()]
        assert record.levelno == logging.DEBUG and "no answer" in record.getMessage()
        assert plugin.backend.pools.default.class_name == "default"  # still whole
    finally:
        plugin.close()


def test_the_plugin_wires_its_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No LVM: the state rebuild and reconciliation are stood in for.
    monkeypatch.setattr(plugin_mod, "rebuild_state", lambda lvm, host: {})
    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    monkeypatch.setattr(plugin_mod, "reconcile_state", lambda lvm, host, records: records)
    monkeypatch.setattr(CommittedMetadata, "check", lambda self, vg, **kw: ())  # no pvs
    plugin = plugin_mod.CsiPlugin(_config(tmp_path, metrics_address=":9808"))
    try:
        metrics = plugin.metrics
        assert metrics is not None
        runner = plugin.backend.pools.default.lvm.runner
        assert isinstance(runner, ProcessRunner) and runner.observe == metrics.observe_command
        (monitor,) = plugin.monitors
        assert monitor.on_extend is not None
        monitor.on_extend("data", 4 * MiB)  # counted for the monitor's class
        monkeypatch.setattr(monitor, "latest", lambda max_age: None)  # no lvs
        got = scrape(metrics)
        assert value(got, "csi_local_volume_group_up", volume_group="vg0") == 0
        assert value(got, "csi_local_pool_autoextend_bytes_total", what="data",
                     device_class="default") == 4 * MiB
        # A first start has no state file: rebuilt, and counted.
        assert value(scrape(metrics), "csi_local_state_rebuilds_total") == 1
        # The node's volume steps count failed opens of encrypted volumes.
        assert plugin.node.volumes.steps.on_open_failure == metrics.open_failed
        plugin.node.volumes.steps.on_open_failure("key_refused")
        assert value(scrape(metrics), "csi_local_encryption_open_failures_total",
                     reason="key_refused") == 1
    finally:
        plugin.close()
    again = plugin_mod.CsiPlugin(_config(tmp_path, metrics_address=":9808"))
    try:
        assert again.metrics is not None
        monkeypatch.setattr(again.monitors[0], "latest", lambda max_age: None)
        assert value(scrape(again.metrics), "csi_local_state_rebuilds_total") == 0
    finally:
        again.close()
    off = plugin_mod.CsiPlugin(_config(tmp_path))
    try:
        assert off.metrics is None
        runner = off.backend.pools.default.lvm.runner
        assert isinstance(runner, ProcessRunner) and runner.observe is None
        assert [m.on_extend for m in off.monitors] == [None]
    finally:
        off.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_endpoint_serves_the_registry(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    node, _, metrics = watched(tmp_path, monkeypatch)
    create(node, "pvc-a", GiB, PVC)
    server = serve_metrics(metrics, f"127.0.0.1:{_free_port()}")
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200
            text = reply.read().decode()
    finally:
        server.stop()
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"csi_local_volume_group_up", "csi_local_volumes",
            "csi_local_volume_size_bytes"} <= families


def test_the_process_and_interpreter_figures(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """process_* (from /proc: CPU, memory, open files, start time) and
    python_* (the interpreter, its garbage collector), with the node label."""
    _, _, metrics = watched(tmp_path, monkeypatch)
    got = scrape(metrics, process=True)
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_open_fds", "process_start_time_seconds"):
        assert value(got, name) > 0, name
    # When the plugin started: the process's figure, not one of its own beside it.
    # (the test process's own start, which in the whole test command can be
    # an hour before this test: compared with what psutil says of it)
    started = psutil.Process().create_time()
    assert abs(value(got, "process_start_time_seconds") - started) < 2
    assert value(got, "process_start_time_seconds") <= time.time()
    assert not [n for n in names(got) if n.startswith("csi_local_") and "start_time" in n]
    assert any(name == "python_info" for name, _ in got)
    assert any(name == "python_gc_objects_collected_total" for name, _ in got)


def test_every_series_names_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The constant `node` label on every family, the plugin's and the
    process's, from the node ID the plugin is started with."""
    monkeypatch.setattr(plugin_mod, "rebuild_state", lambda lvm, host: {})
    monkeypatch.setattr(plugin_mod, "reconcile_state", lambda lvm, host, records: records)
    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    plugin = plugin_mod.CsiPlugin(_config(tmp_path, metrics_address=":9808"))
    try:
        assert plugin.metrics is not None
        monkeypatch.setattr(plugin.monitors[0], "latest", lambda max_age: None)
        monkeypatch.setattr(CommittedMetadata, "check", lambda self, vg, ask_lvm=False: ())
        text = generate_latest(plugin.metrics.registry).decode()
    finally:
        plugin.close()
    families = list(text_string_to_metric_families(text))
    assert {f.name for f in families} >= {"csi_local_volume_group_up", "process_cpu_seconds",
                                          "python_info", "csi_local_build_info"}
    for family in families:
        for sample in family.samples:
            assert sample.labels.get("node") == "n", sample


@pytest.mark.parametrize("connect", ["127.0.0.1", "::1"])
def test_a_port_alone_serves_ipv4_and_ipv6(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           connect: str) -> None:
    """":PORT" listens on every address of both families (one socket, IPv6
    with IPV6_V6ONLY off), so a dual-stack or IPv6-only pod network scrapes it."""
    _, _, metrics = watched(tmp_path, monkeypatch)
    server = serve_metrics(metrics, f":{_free_port()}")
    try:
        assert server.httpd.socket.family == socket.AF_INET6
        host = f"[{connect}]" if ":" in connect else connect
        with urllib.request.urlopen(f"http://{host}:{server.port}/metrics",
                                    timeout=10) as reply:
            assert reply.status == 200
            assert b"csi_local_volume_group_up" in reply.read()
    finally:
        server.stop()


# the flag -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "parsed"), [
    (":9808", ("", 9808)),
    ("127.0.0.1:9808", ("127.0.0.1", 9808)),
    ("0.0.0.0:1", ("0.0.0.0", 1)),
    ("[::1]:9808", ("::1", 9808)),
    ("localhost:65535", ("localhost", 65535)),
])
def test_metrics_addresses(tmp_path: Path, text: str, parsed: tuple[str, int]) -> None:
    assert parse_listen_address(text) == parsed
    assert _config(tmp_path, metrics_address=text).metrics_address == text


@pytest.mark.parametrize("text", ["9808", "host:", ":0", ":65536", ":-1", ":http", "a b:80",
                                  "http://host:80", "[::1:80", ":\uff18\uff10"])
def test_bad_metrics_addresses(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="metrics address"):
        _config(tmp_path, metrics_address=text)


def test_the_serve_flag_and_its_environment(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["serve", "--node-id", "n", "--volume-group", "vg0", "--thin-pool", "pool0",
            "--state-dir", str(tmp_path)]
    monkeypatch.delenv("CSI_LOCAL_METRICS_ADDRESS", raising=False)
    assert config_from_args(build_parser().parse_args(base)).metrics_address == ""
    flagged = build_parser().parse_args([*base, "--metrics-address", ":9808"])
    assert config_from_args(flagged).metrics_address == ":9808"
    monkeypatch.setenv("CSI_LOCAL_METRICS_ADDRESS", "127.0.0.1:9100")
    assert config_from_args(build_parser().parse_args(base)).metrics_address == \
        "127.0.0.1:9100"
    monkeypatch.setenv("CSI_LOCAL_METRICS_ADDRESS", "9100")
    with pytest.raises(ConfigError, match="metrics address"):
        config_from_args(build_parser().parse_args(base))


# who may import it ----------------------------------------------------------------------

SRC = Path(__file__).resolve().parents[2] / "src"


@functools.cache  # each module parsed once per run, not once per start that reaches it
def _imports_of(module: str) -> frozenset[str]:
    """Modules `module` imports (lazy ones too), csi_local ones resolved to files."""
    base = SRC.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if SRC.joinpath(*sub.split(".")).with_suffix(".py").exists():
                    found.add(sub)
    return frozenset(found)


def _reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [m for m in _imports_of(module)
                 if m.startswith("csi_local") and not m.startswith("csi_local._gen")]
        seen |= {m for m in _imports_of(module) if not m.startswith("csi_local")}
    return seen


@pytest.mark.parametrize("start", ["csi_local.dhv", "csi_local.dhv.host_volumes",
                                   "csi_local.host.runner", "csi_local.config"])
def test_the_host_volume_plugin_never_loads_metrics(start: str) -> None:
    reached = _reachable(start)
    assert "csi_local.host.runner" in _reachable("csi_local.dhv.host_volumes")
    bad = {m for m in reached if m.startswith("prometheus_client") or m == "csi_local.ops.metrics"}
    assert not bad, f"{start} reaches {sorted(bad)}"


def test_a_busy_metrics_port_stops_the_server_cleanly(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from csi_local.csi import server as server_mod

    monkeypatch.setattr(plugin_mod, "rebuild_state", lambda lvm, host: {})
    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    monkeypatch.setattr(plugin_mod, "reconcile_state", lambda lvm, host, records: records)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        # No lvm shell: serve() starts one in the background (runner.start_shell),
        # and the close that follows the refused port does not wait for that
        # start, which would run lvmconfig after this test (no process here).
        config = _config(tmp_path, metrics_address=f"127.0.0.1:{busy.getsockname()[1]}",
                         lvm_shell=False)
        with pytest.raises(server_mod.ServerError, match="cannot serve metrics"):
            server_mod.serve(config)
    assert not Path(config.socket).exists()
    # The state directory was let go: a new plugin can take it.
    plugin_mod.CsiPlugin(_config(tmp_path)).close()


def test_serve_gives_running_rpcs_the_configured_grace_at_sigterm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At SIGTERM serve stops the gRPC server with --shutdown-grace, not a
    fixed grace that a CO's kill timeout may cut short."""
    from csi_local.csi import server as server_mod

    monkeypatch.setattr(plugin_mod, "rebuild_state", lambda lvm, host: {})
    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    monkeypatch.setattr(plugin_mod, "reconcile_state", lambda lvm, host, records: records)
    monkeypatch.setattr(plugin_mod.CsiPlugin, "start", lambda self: None)
    handlers: dict[int, Any] = {}
    monkeypatch.setattr(signal, "signal", lambda signum, handler: handlers.update(
        {signum: handler}))
    graces: list[float | None] = []
    real_build = server_mod.build_server

    def build(plugin: Any, path: str) -> Any:
        real = real_build(plugin, path)
        real_stop = real.stop

        def stop(grace: float | None) -> threading.Event:
            graces.append(grace)
            return real_stop(0)

        monkeypatch.setattr(real, "stop", stop)
        return real

    monkeypatch.setattr(server_mod, "build_server", build)
    config = _config(tmp_path, lvm_shell=False, shutdown_grace=7.5)
    done = threading.Thread(target=server_mod.serve, args=(config,))
    done.start()
    deadline = time.monotonic() + 30
    while signal.SIGTERM not in handlers or not Path(config.socket).exists():
        assert done.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    handlers[signal.SIGTERM](signal.SIGTERM, None)
    done.join(30)
    assert not done.is_alive() and graces == [7.5]


class _Reader:
    """A VG's committed metadata as check() finds it: these problems."""

    def __init__(self, problems: tuple[str, ...] = ()) -> None:
        self.problems = problems

    def check(self, vg: str) -> tuple[str, ...]:
        return self.problems

    def space(self, vg: str) -> None:
        return None  # the monitor asks `vgs`


def test_metadata_consistency_gauge_per_vg(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """1 while every PV holds the VG's newest metadata, 0 (and doctor names
    the PV) when one is missing or outdated: one fixed label, the VG."""
    node = make_class_node(tmp_path, monkeypatch, CLASSES)
    metrics = Metrics(node=NODE)
    readers = {"vg-nvme": _Reader(()),
               "vg-hdd": _Reader(("PV /dev/loop1 has outdated metadata of VG vg-hdd",))}
    for pool in node.backend.pools:
        pool.committed = cast(CommittedMetadata, readers[pool.lvm.vg])
    metrics.watch([PoolMonitor(pool.lvm, pool) for pool in node.backend.pools])
    got = scrape(metrics)
    assert {s["volume_group"]: value(got, "csi_local_volume_group_metadata_consistent", **s)
            for s in series(got, "csi_local_volume_group_metadata_consistent")} == \
        {"vg-nvme": 1, "vg-hdd": 0}


def test_a_missing_volume_group_has_no_metadata_figure(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A VG that cannot be read has no PV to disagree: the committed
    metadata finds no problem in it, which is no reading of consistency.
    Only `up` (0) and the limits, which need no LVM, are exported."""
    node = make_node(tmp_path, monkeypatch, with_vg=False)
    pool = node.backend.pools.default
    pool.committed = cast(CommittedMetadata, _Reader(()))
    metrics = Metrics(node=NODE)
    metrics.watch([PoolMonitor(pool.lvm, pool)])
    got = scrape(metrics)
    assert value(got, "csi_local_volume_group_up", volume_group="vg0") == 0
    # Every family that carries a VG, pool or volume, but the configured limits.
    unread = {n for n in names(got) if n.startswith(("csi_local_volume", "csi_local_thin_pool",
                                                     "csi_local_snapshots",
                                                     "csi_local_encrypted_volumes"))}
    assert unread == {"csi_local_volume_group_up", "csi_local_thin_pool_data_limit_ratio",
                      "csi_local_thin_pool_metadata_limit_ratio",
                      "csi_local_thin_pool_autoextend_threshold_ratio"}
