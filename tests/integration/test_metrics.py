"""The Prometheus endpoint of a real plugin process (`serve --metrics-address`):
real RPCs (one failing), scraped over HTTP and parsed as Prometheus parses
them; the pool's figures against what `lvs` and `vgs` say. Prints an excerpt
of the real /metrics (the `report` marker shows it even when the test passes)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import LoopVG, PluginProcess, expect_code, mount_cap, run
from tests.integration.test_node import stage, unstage

pytestmark = [pytest.mark.integration, pytest.mark.report]
MiB = 1 << 20
CO = {"csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "shop"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=60) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return str(reply.read().decode())


NODE = "node-1"  # PluginProcess's --node-id


def parse(text: str) -> Samples:
    """The samples, each checked for the constant `node` label, which the
    keys leave out."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("node") == NODE, s
            labels = {k: v for k, v in s.labels.items() if k != "node"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def parse_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}"
    return samples[key]


def report(vg: LoopVG, command: str, fields: str) -> list[dict[str, str]]:
    out = run(command, "--reportformat", "json", "--units", "b", "--nosuffix", "-o", fields,
              vg.name).stdout
    rows: list[dict[str, str]] = json.loads(out)["report"][0]["lv" if command == "lvs" else "vg"]
    return rows


def excerpt(text: str) -> str:
    """The exposition without most histogram buckets (kept for mkfs.ext4)."""
    keep = []
    for line in text.splitlines():
        if "_bucket{" in line and 'tool="mkfs.ext4"' not in line:
            continue
        keep.append(line)
    return "\n".join(keep)


def test_metrics_of_a_real_node(plugin_factory: Any, vg: LoopVG) -> None:
    port = free_port()
    # A port alone: every address, IPv6 and IPv4 (scraped over both below).
    p: PluginProcess = plugin_factory("--metrics-address", f":{port}")
    assert p.node_id == NODE
    data = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name="data", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap()], parameters=CO)).volume.volume_id
    scratch = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name="scratch", capacity_range=pb.CapacityRange(required_bytes=32 * MiB),
        volume_capabilities=[mount_cap()])).volume.volume_id
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, p.controller.CreateVolume,
                pb.CreateVolumeRequest(name="no-capabilities"))
    staging = p.path("stage-data")
    stage(p, data, staging)  # mkfs.ext4 and mount
    with open(f"{staging}/payload", "wb") as f:
        f.write(b"\x5a" * (8 * MiB))
    run("sync", "-f", f"{staging}/payload")
    expect_code(grpc.StatusCode.FAILED_PRECONDITION, p.controller.DeleteVolume,
                pb.DeleteVolumeRequest(volume_id=data))  # still staged
    unstage(p, data, staging)  # no writes from here on (ext4's lazy init stops)
    p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=scratch))

    first_started = time.monotonic()
    text = fetch(port)
    got = parse(text)
    # Two more at once, within 5 s of the first: the first of them shows the
    # lvs that the first scrape ran (the command histogram is
    # rendered before the pool's figures), the second that it ran none.
    second = parse(fetch(port))
    third_started = time.monotonic()
    third = parse(fetch(port))
    lv_rows = {r["lv_name"]: r for r in report(
        vg, "lvs", "lv_name,lv_size,data_percent,metadata_percent,lv_metadata_size")}
    vg_row = report(vg, "vgs", "vg_name,vg_size,vg_free")[0]
    capacity = p.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity
    print(f"\n--- GET http://127.0.0.1:{port}/metrics (excerpt) ---\n{excerpt(text)}")

    # RPCs by method and code, and their latencies.
    rpc = "csi_local_rpc_requests_total"
    assert value(got, rpc, method="CreateVolume", code="OK") == 2
    assert value(got, rpc, method="CreateVolume", code="INVALID_ARGUMENT") == 1
    assert value(got, rpc, method="NodeStageVolume", code="OK") == 1
    assert value(got, rpc, method="NodeUnstageVolume", code="OK") == 1
    assert value(got, rpc, method="DeleteVolume", code="OK") == 1
    assert value(got, rpc, method="DeleteVolume", code="FAILED_PRECONDITION") == 1
    assert value(got, rpc, method="Probe", code="OK") >= 1
    assert value(got, "csi_local_rpc_duration_seconds_count", method="CreateVolume") == 3
    assert value(got, "csi_local_rpc_duration_seconds_sum", method="NodeStageVolume") > 0

    # External commands by tool.
    cmd = "csi_local_command_duration_seconds_count"
    assert value(got, cmd, tool="lvcreate") == 2
    assert value(got, cmd, tool="mkfs.ext4") == 1
    # Stage mounts by a system call: no mount(8) to count.
    assert (cmd, frozenset({("tool", "mount")})) not in got
    assert value(got, cmd, tool="lvremove") == 1
    assert value(got, "csi_local_command_duration_seconds_sum", tool="mkfs.ext4") > 0
    assert value(got, "csi_local_command_duration_seconds_bucket", tool="mkfs.ext4",
                 le="+Inf") == 1
    # A scrape runs one process, an lvs (the volumes' fill), and none again
    # within 5 s; the VG's size and free space come off its PVs, with no vgs.
    # (The RPCs above ran none: they read the committed metadata.)
    assert value(second, cmd, tool="lvs") == got.get((cmd, frozenset({("tool", "lvs")})), 0) + 1
    for scrape in (got, second, third):
        assert (cmd, frozenset({("tool", "vgs")})) not in scrape
    # (Checked only when the third scrape began within the cache's 5 s: on a
    # loaded emulated machine three HTTP requests can take longer.)
    if third_started - first_started < 4.5:
        assert value(third, cmd, tool="lvs") == value(second, cmd, tool="lvs")
    else:
        print(f"scrapes took {third_started - first_started:.1f}s: cache not checked")

    # The VG, the pool and the volumes, as LVM reports them.
    # The flags' pool is the device class "default".
    pool_labels = {"device_class": "default", "volume_group": vg.name, "thin_pool": vg.pool}
    pool = lv_rows[vg.pool]
    assert value(got, "csi_local_volume_group_up", volume_group=vg.name) == 1
    assert value(got, "csi_local_volume_group_size_bytes", volume_group=vg.name) == \
        int(vg_row["vg_size"])
    assert value(got, "csi_local_volume_group_free_bytes", volume_group=vg.name) == \
        int(vg_row["vg_free"])
    assert value(got, "csi_local_thin_pool_size_bytes", **pool_labels) == int(pool["lv_size"])
    assert value(got, "csi_local_thin_pool_metadata_size_bytes", **pool_labels) == \
        int(pool["lv_metadata_size"])
    # Fills as 0-1 ratios of LVM's percentages.
    assert value(got, "csi_local_thin_pool_data_used_ratio", **pool_labels) == \
        round(float(pool["data_percent"]) / 100, 6)
    assert value(got, "csi_local_thin_pool_metadata_used_ratio", **pool_labels) == \
        round(float(pool["metadata_percent"]) / 100, 6)
    assert float(pool["data_percent"]) > 0
    assert value(got, "csi_local_thin_pool_healthy", **pool_labels) == 1
    assert value(got, "csi_local_thin_pool_health_status", status="out_of_data",
                 **pool_labels) == 0
    assert value(got, "csi_local_thin_pool_data_limit_ratio", **pool_labels) == 0.9
    assert value(got, "csi_local_thin_pool_available_bytes", **pool_labels) == capacity
    assert value(got, "csi_local_thin_pool_provisioned_bytes", **pool_labels) == \
        int(lv_rows[data]["lv_size"])
    assert value(got, "csi_local_volumes", **pool_labels) == 1
    assert value(got, "csi_local_snapshots", **pool_labels) == 0
    labels = {"device_class": "default", "volume_id": data, "pvc_name": "data",
              "pvc_namespace": "shop"}
    assert value(got, "csi_local_volume_size_bytes", **labels) == int(lv_rows[data]["lv_size"])
    assert value(got, "csi_local_volume_data_used_ratio", **labels) == \
        round(float(lv_rows[data]["data_percent"]) / 100, 6)
    assert float(lv_rows[data]["data_percent"]) > 0
    assert value(got, "csi_local_state_rebuilds_total") == 1  # a first start
    # The process's own figures, from the real /proc.
    assert value(got, "process_resident_memory_bytes") > 10 * MiB
    assert value(got, "process_cpu_seconds_total") > 0
    assert value(got, "process_open_fds") > 0
    assert any(name == "python_info" for name, _ in got)
    # The same endpoint over IPv6.
    assert "csi_local_volume_group_up" in parse_names(fetch(port, "[::1]"))
    assert value(got, "process_start_time_seconds") > 0
