"""`csi-local status` and `csi-local doctor` as an operator runs them, against a
real VG: a staged and published volume, a snapshot, an unused volume, a host
volume and a stray LV; then a deactivated thin pool and a missing VG (doctor's
missing-VG branch is covered by the unit tests: every CLI start costs half a
minute under the VM's emulation). The human outputs are printed (README quotes
them)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import LoopVG, PluginProcess, mount_cap, run
from tests.integration.test_node import publish, stage, unpublish, unstage

pytestmark = [pytest.mark.integration, pytest.mark.report]
MiB = 1 << 20
CO = {"csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "shop"}
DHV = "dhv-" + "0123456789abcdef" * 2


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = run(sys.executable, "-m", "csi_local", *argv, check=False)
    print(f"[csi-local {argv[0]}: {time.monotonic() - started:.1f}s]")
    return proc


def status(vg: LoopVG, p: PluginProcess, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli("status", "--volume-group", vg.name, "--thin-pool", vg.pool,
               "--state-dir", str(p.state_dir), *extra)


def doctor(vg: LoopVG, p: PluginProcess, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli("doctor", "--volume-group", vg.name, "--thin-pool", vg.pool,
               "--state-dir", str(p.state_dir), "--lock-dir", str(p.workdir / "locks"),
               "--endpoint", p.endpoint, *extra)


def show(title: str, proc: subprocess.CompletedProcess[str]) -> None:
    print(f"--- {title} (exit {proc.returncode}) ---\n{proc.stdout}{proc.stderr}")


def lvs(vg: LoopVG) -> dict[str, dict[str, Any]]:
    out = run("lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o",
              "lv_name,lv_size,lv_attr,lv_tags,data_percent", vg.name).stdout
    return {r["lv_name"]: r for r in json.loads(out)["report"][0]["lv"]}


@pytest.mark.report
def test_status_and_doctor_on_a_real_node(plugin_factory: Any, vg: LoopVG) -> None:
    p: PluginProcess = plugin_factory()
    data = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name="data", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap()], parameters=CO)).volume.volume_id
    idle = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name="idle", capacity_range=pb.CapacityRange(required_bytes=32 * MiB),
        volume_capabilities=[mount_cap()])).volume.volume_id
    staging, target = p.path("stage-data"), p.path("target-data")
    stage(p, data, staging)
    publish(p, data, staging, target)
    with open(f"{target}/file", "wb") as f:
        f.write(b"x" * 8 * MiB)
    snap = p.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="snap", source_volume_id=data)).snapshot.snapshot_id
    run("lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}", "--virtualsize", "8m",
        "--name", "leftover", "--addtag", "csi-local.kind=volume")
    run("lvcreate", "--yes", "--thin", f"{vg.name}/{vg.pool}", "--virtualsize", "16m",
        "--name", DHV, "--addtag", "csi-local-dhv.kind=volume",
        "--addtag", "csi-local-dhv.id=cache", "--addtag", "csi-local-dhv.fs=ext4",
        "--addtag", f"csi-local-dhv.name={b'build-cache'.hex()}",
        "--addtag", f"csi-local-dhv.namespace={b'default'.hex()}")
    time.sleep(2)  # older than --orphan-age 1s below

    # status --json matches LVM and the state file -----------------------------------
    proc = status(vg, p, "--json", "--orphan-age", "1s")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    real = lvs(vg)
    vgs = json.loads(run("vgs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o",
                         "vg_size,vg_free,vg_mda_size,vg_mda_free", vg.name).stdout
                     )["report"][0]["vg"][0]
    # One PV, one metadata copy, nothing missing: no metadata problem. The
    # metadata area as LVM reports it (its free space in whole sectors).
    area = got["volume_group"].pop("metadata_area")
    assert got["volume_group"] == {"name": vg.name, "size": int(vgs["vg_size"]),
                                   "free": int(vgs["vg_free"]), "metadata_problems": []}
    assert area["size"] == int(vgs["vg_mda_size"]) and area["problem"] is None
    left = area["limit"] - area["used"]
    assert left - 512 < int(vgs["vg_mda_free"]) <= left
    assert area["lvs_that_fit"] > 0
    pool = got["thin_pool"]
    assert pool["found"] and pool["active"] and pool["size"] == int(real[vg.pool]["lv_size"])
    assert pool["data_percent"] == pytest.approx(float(real[vg.pool]["data_percent"]))
    thin_total = sum(int(r["lv_size"]) for n, r in real.items() if n != vg.pool)
    assert pool["available"] <= pool["size"] - thin_total
    volumes = {v["id"]: v for v in got["volumes"]}
    assert set(volumes) == {data, idle}
    v = volumes[data]
    assert v["size"] == int(real[data]["lv_size"]) and v["active"]
    assert v["data_percent"] == pytest.approx(float(real[data]["data_percent"]))
    assert v["co_names"] == {"pvc_name": "data", "pvc_namespace": "shop"}
    assert v["staged"] == {"path": staging, "access_type": "mount", "fs_type": "ext4"}
    # A volume of no QoS class: no limits, so none to enforce (docs/qos.md).
    assert v["published"] == [{"target": target, "readonly": False, "io_limits": ""}]
    assert v["io_limits"] == {}
    assert v["condition"]["abnormal"] is False and not v["possible_orphan"]
    assert volumes[idle]["possible_orphan"] and volumes[idle]["staged"] is None
    (s,) = got["snapshots"]
    assert s["id"] == snap and s["source"] == f"volume:{data}" and not s["active"]
    assert s["condition"]["abnormal"] is False
    (h,) = got["host_volumes"]
    assert (h["lv"], h["id"], h["name"], h["namespace"], h["fs_type"]) == (
        DHV, "cache", "build-cache", "default", "ext4")
    orphans = {o["lv"]: o["kind"] for o in got["possible_orphans"]}
    assert orphans == {idle: "unused volume", "leftover": "stray LV"}
    listed = set(volumes) | {snap, DHV, "leftover"}
    assert listed == set(real) - {vg.pool}

    # The default --orphan-age (1h) flags no fresh volume.
    human = status(vg, p)
    assert human.returncode == 0, human.stderr
    show("csi-local status", human)
    assert f"{idle}" in human.stdout and "Possible orphans: 1" in human.stdout
    assert "leftover" in human.stdout and "shop/data" in human.stdout

    # doctor passes on a node that works ----------------------------------------------
    dr = doctor(vg, p)
    show("csi-local doctor", dr)
    dj = doctor(vg, p, "--json")
    checks = {c["name"]: c for c in json.loads(dj.stdout)["checks"]}
    for name in ("kernel module dm_thin_pool", "device-mapper", "lvm tools", "tools",
                 f"volume group {vg.name}", f"thin pool {vg.name}/{vg.pool}",
                 "thin pool zeroing", "thin pool fill", "CSI socket",
                 f"volume group {vg.name} metadata", "thin pool metadata snapshot"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks[f"state directory {p.state_dir}"]["status"] == "ok"
    assert checks[f"lock directory {p.workdir / 'locks'}"]["status"] == "ok"
    assert dr.returncode == dj.returncode == 0, dr.stdout

    # a deactivated pool fails doctor; status still shows it ---------------------------
    unpublish(p, data, target)
    unstage(p, data, staging)
    p.stop()
    run("lvchange", "--activate", "n", vg.name)
    try:
        broken = doctor(vg, p)
        show("csi-local doctor, thin pool deactivated, plugin stopped", broken)
        assert broken.returncode == 1
        bj = json.loads(doctor(vg, p, "--json").stdout)
        failed = {c["name"]: c for c in bj["checks"] if c["status"] == "FAIL"}
        assert set(failed) == {f"thin pool {vg.name}/{vg.pool}"}, failed
        assert failed[f"thin pool {vg.name}/{vg.pool}"]["fix"] == \
            f"lvchange --activate y {vg.name}/{vg.pool}"
        socket_check = next(c for c in bj["checks"] if c["name"] == "CSI socket")
        assert socket_check["status"] == "warn"
        down = status(vg, p)
        show("csi-local status, thin pool deactivated", down)
        assert down.returncode == 0, down.stderr
        assert f"Thin pool {vg.name}/{vg.pool}: size " in down.stdout
        assert "NOT ACTIVE" in down.stdout
    finally:
        run("lvchange", "--activate", "y", f"{vg.name}/{vg.pool}")

    # a missing VG: status exits 1 with a message on stderr ------------------------------
    gone = cli("status", "--volume-group", "nosuchvg", "--thin-pool", "pool",
               "--state-dir", str(p.state_dir))
    show("csi-local status, missing VG", gone)
    assert gone.returncode == 1 and gone.stdout == ""
    assert "volume group nosuchvg not found" in gone.stderr
