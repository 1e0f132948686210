"""`csi-local status` over a FakeHost: volumes made by the real controller, the
state file read without its lock, host volumes, possible orphans by age, and
the exit codes."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.cli import build_parser
from csi_local.nodestate import state_file as state
from csi_local.ops import status
from csi_local.storage import vg_text
from csi_local.storage.lvm import hex_tag
from csi_local.volumes import host_volume_names as dhv_tags
from csi_local.volumes import naming
from csi_local.volumes.node_records import AccessType, Publish, Staging, VolumeRecord
from csi_local.volumes.pool import COMMAND_TEXT_MAX, LV_TEXT_MAX
from tests.unit.fakehost import FakeHost
from tests.unit.servicers import (
    THREE_CLASSES,
    GiB,
    MiB,
    Node,
    call,
    make_class_node,
    make_node,
    mount_cap,
    vol_id,
)

CO = {"csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "ns"}
T0 = 1_700_000_000  # FakeHost's lv_time of its first LV (the pool)
HOUR = 3600
DHV = "dhv-" + "ab" * 16


def args(state_dir: Path | str, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["status", "--volume-group", "vg0", "--thin-pool", "pool0",
                                      "--state-dir", str(state_dir), *extra])


def run(host: FakeHost, ns: argparse.Namespace, now: float) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = status.run(host, ns, out=out, err=err, now=now)
    return code, out.getvalue(), err.getvalue()


def as_json(host: FakeHost, state_dir: Path | str, now: float, *extra: str) -> Any:
    code, out, _ = run(host, args(state_dir, "--json", *extra), now)
    assert code == 0
    return json.loads(out)


def create(n: Node, name: str, size: int = GiB, params: dict[str, str] | None = None,
           snapshot: str = "") -> str:
    req = pb.CreateVolumeRequest(name=name, capacity_range=pb.CapacityRange(required_bytes=size),
                                 volume_capabilities=[mount_cap()], parameters=params or {})
    if snapshot:
        req.volume_content_source.snapshot.snapshot_id = snapshot
    code, reply = call(n.controller.CreateVolume, req)
    assert code == "OK", reply
    return str(reply.volume.volume_id)


def snapshot(n: Node, name: str, source: str) -> str:
    code, reply = call(n.controller.CreateSnapshot,
                       pb.CreateSnapshotRequest(name=name, source_volume_id=source))
    assert code == "OK", reply
    return str(reply.snapshot.snapshot_id)


def add_dhv(host: FakeHost) -> None:
    host.add_lv(DHV, 512 * MiB, tags=[
        f"{dhv_tags.TAG_KIND}={dhv_tags.KIND_VOLUME}", f"{dhv_tags.TAG_ID}=cache",
        f"{dhv_tags.TAG_FS}=xfs", *hex_tag(dhv_tags.TAG_NAME, "build cache"),
        *hex_tag(dhv_tags.TAG_NAMESPACE, "default")])


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return make_node(tmp_path, monkeypatch)


def test_volumes_snapshots_and_where_they_are_used(node: Node) -> None:
    """A staged and published volume with CO names, its snapshot and a restore,
    read while the plugin's StateStore holds the state directory's lock."""
    data = create(node, "data", params=CO)
    snap = snapshot(node, "snap", data)
    restored = create(node, "restored", snapshot=snap)
    staging, target = node.path("stage"), node.path("target")
    node.state.set_staging(data, Staging(staging, AccessType.MOUNT, "ext4"))
    node.state.add_publish(data, target, Publish(readonly=True))
    node.host.lv(data).data_percent = 12.5
    now = node.host.clock + 10  # everything is seconds old: no possible orphans

    got = as_json(node.host, node.backend.config.state_dir, now)

    area = got["volume_group"].pop("metadata_area")
    assert got["volume_group"] == {"name": "vg0", "size": 11 * GiB,
                                   "free": 11 * GiB - 10 * GiB - 8 * MiB,
                                   "metadata_problems": []}
    fvg = node.host.vgs["vg0"]
    limit = vg_text.max_text_size(fvg.mda_size)
    used = limit - (limit - fvg.mda_text) // 512 * 512  # vg_mda_free: whole sectors
    assert area == {"size": fvg.mda_size, "limit": limit, "used": used,
                    "used_percent": round(100 * used / limit, 1),
                    "lvs_that_fit": (limit - used - COMMAND_TEXT_MAX) // LV_TEXT_MAX,
                    "problem": None}
    pool = got["thin_pool"]
    assert pool["name"] == "vg0/pool0" and pool["found"] and pool["active"]
    assert pool["size"] == 10 * GiB and pool["fill_problem"] is None
    assert pool["available"] == 10 * GiB - 3 * GiB  # two volumes and a snapshot of 1 GiB
    assert got["state"]["error"] is None and got["state"]["records"] == 1
    by_id = {v["id"]: v for v in got["volumes"]}
    assert set(by_id) == {data, restored}
    v = by_id[data]
    assert v["kind"] == "volume" and v["size"] == GiB and v["data_percent"] == 12.5
    assert v["co_names"] == {"pvc_name": "data", "pvc_namespace": "ns"}
    assert v["staged"] == {"path": staging, "access_type": "mount", "fs_type": "ext4"}
    assert v["published"] == [{"target": target, "readonly": True, "io_limits": ""}]
    assert v["io_limits"] == {}
    assert v["condition"] == {"abnormal": False, "message": "volume is healthy"}
    assert v["source"] is None and not v["possible_orphan"]
    assert by_id[restored]["source"] == f"snapshot:{snap}"
    assert by_id[restored]["staged"] is None and by_id[restored]["published"] == []
    (s,) = got["snapshots"]
    assert s["id"] == snap and s["kind"] == "snapshot" and s["source"] == f"volume:{data}"
    # A snapshot is inactive by design; that is not a problem.
    assert not s["active"] and not s["condition"]["abnormal"]
    assert got["host_volumes"] == [] and got["possible_orphans"] == []
    assert got["orphan_age_seconds"] == HOUR and "check with your CO" in got["orphan_note"]

    code, text, _ = run(node.host, args(node.backend.config.state_dir), now)
    assert code == 0
    assert "Volume group vg0: size 11.0 GiB, free 1016.0 MiB" in text
    assert "Thin pool vg0/pool0: size 10.0 GiB, data 0.0%, metadata 0.0%, active; room for " \
           "new volumes 7.0 GiB (over-provisioning ratio 1)" in text
    assert "CSI volumes: 2" in text and "CSI snapshots: 1" in text
    row = next(line for line in text.splitlines() if line.strip().startswith(data))
    assert "1.0 GiB" in row and "12.5%" in row and "ns/data" in row and row.endswith("ok")
    assert f"      staged at {staging} (mount, ext4)" in text
    assert f"      published at {target} (ro)" in text
    assert "Possible orphans: 0" in text


def test_unused_volume_is_a_possible_orphan_once_old(node: Node, tmp_path: Path) -> None:
    used, idle = create(node, "used"), create(node, "idle")
    snap = snapshot(node, "s", idle)
    state_dir = tmp_path / "written"
    state_dir.mkdir()
    (state_dir / state.STATE_FILE).write_text(state.render({
        used: VolumeRecord(used, Staging("/st", AccessType.BLOCK))}))
    created = node.host.lv(idle).created

    young = as_json(node.host, state_dir, created + HOUR - 1)
    assert young["possible_orphans"] == []

    old = as_json(node.host, state_dir, created + 2 * HOUR)
    (orphan,) = old["possible_orphans"]
    assert orphan["lv"] == idle and orphan["kind"] == "unused volume"
    assert orphan["age_seconds"] == 2 * HOUR
    flags = {v["id"]: v["possible_orphan"] for v in old["volumes"]}
    assert flags == {used: False, idle: True}
    assert not old["snapshots"][0]["possible_orphan"]  # snapshots are never staged
    assert snap not in {o["lv"] for o in old["possible_orphans"]}

    # A shorter --orphan-age flags it sooner.
    soon = as_json(node.host, state_dir, created + 120, "--orphan-age", "1m")
    assert [o["lv"] for o in soon["possible_orphans"]] == [idle]

    code, text, _ = run(node.host, args(state_dir), created + 2 * HOUR)
    assert code == 0
    assert "Possible orphans: 1" in text
    line = next(x for x in text.splitlines() if x.strip().startswith(idle) and "unused" in x)
    assert "2h" in line and "older than 1h" in line
    assert '"possible" means check with your CO' in text


def test_stray_lvs_with_csi_tags(node: Node) -> None:
    node.host.add_lv("leftover", GiB, tags=[f"{naming.TAG_KIND}={naming.KIND_VOLUME}"])
    node.host.add_lv(vol_id("mislabelled"), GiB, tags=[f"{naming.TAG_SIZE}=1"])
    node.host.add_lv("unrelated", GiB, tags=["other.tag=1"])
    now = node.host.clock + 3 * 86400

    got = as_json(node.host, node.backend.config.state_dir, now)

    strays = {o["lv"]: o for o in got["possible_orphans"]}
    assert set(strays) == {"leftover", vol_id("mislabelled")}
    assert strays["leftover"]["kind"] == "stray LV"
    assert "not a CSI volume or snapshot ID" in strays["leftover"]["reason"]
    assert "named like a CSI volume" in strays[vol_id("mislabelled")]["reason"]
    assert strays["leftover"]["age_seconds"] >= 3 * 86400
    assert got["volumes"] == [] and got["host_volumes"] == []
    _, text, _ = run(node.host, args(node.backend.config.state_dir), now)
    assert "leftover" in text and "stray LV" in text and " 3d " in text


def test_host_volumes_are_listed(node: Node) -> None:
    add_dhv(node.host)
    got = as_json(node.host, node.backend.config.state_dir, node.host.clock)
    (h,) = got["host_volumes"]
    assert h["lv"] == DHV and h["id"] == "cache" and h["name"] == "build cache"
    assert h["namespace"] == "default" and h["fs_type"] == "xfs" and h["size"] == 512 * MiB
    assert not h["condition"]["abnormal"]
    assert got["possible_orphans"] == [] and got["volumes"] == []  # never a CSI orphan
    _, text, _ = run(node.host, args(node.backend.config.state_dir), node.host.clock)
    assert "Host volumes (csi-local-dhv): 1" in text
    assert "build cache (default)" in text and "xfs" in text


def test_full_pool_and_ratio(node: Node) -> None:
    data = create(node, "data")
    pool = node.host.lv("pool0")
    pool.data_percent, pool.metadata_percent = 95.0, 20.0
    got = as_json(node.host, node.backend.config.state_dir, node.host.clock,
                  "--overprovision-ratio", "2")
    assert got["thin_pool"]["available"] == 20 * GiB - GiB
    assert got["thin_pool"]["overprovision_ratio"] == 2.0
    assert "above its high-water mark" in got["thin_pool"]["fill_problem"]
    (v,) = got["volumes"]
    assert v["id"] == data and v["condition"]["abnormal"]
    assert "data 95.0% full" in v["condition"]["message"]
    _, text, _ = run(node.host, args(node.backend.config.state_dir), node.host.clock)
    assert "  WARNING: thin pool vg0/pool0 is above its high-water mark" in text
    assert "ABNORMAL: thin pool vg0/pool0 is above" in text


def test_missing_pool_is_shown_not_fatal(tmp_path: Path) -> None:
    host = FakeHost(with_pool=False)
    got = as_json(host, tmp_path, T0)
    assert got["thin_pool"]["found"] is False
    assert got["thin_pool"]["problem"] == "thin pool vg0/pool0 not found"
    code, text, _ = run(host, args(tmp_path), T0)
    assert code == 0 and "Thin pool vg0/pool0: PROBLEM: thin pool vg0/pool0 not found" in text


def test_missing_volume_group_exits_1(tmp_path: Path) -> None:
    host = FakeHost(with_vg=False)
    code, out, err = run(host, args(tmp_path), T0)
    assert code == 1 and out == ""
    assert "csi-local status: volume group vg0 not found" in err
    assert [c[0] for c in host.calls] == ["vgs"]  # nothing after the failed read


def test_reads_lvm_once(node: Node) -> None:
    create(node, "data")
    node.host.calls.clear()
    as_json(node.host, node.backend.config.state_dir, node.host.clock)
    # The committed-metadata check's: a `pvs` (it reads the PVs themselves) and a
    # `vgs` for LVM's own warnings of the VG's metadata.
    assert [c[0] for c in node.host.calls] == ["vgs", "lvs", "pvs", "vgs"]


@pytest.mark.parametrize(("content", "error"), [
    ("{not json", "corrupt"),
    ('{"version": 0, "volumes": {}}', "corrupt (unsupported state version 0)"),
    # A newer csi-local's file is not corrupt: the plugin will not start on it.
    ('{"version": 2, "volumes": {}}', "state file "),
])
def test_unreadable_state_file_judges_no_orphans(node: Node, tmp_path: Path, content: str,
                                                 error: str) -> None:
    create(node, "idle")
    state_dir = tmp_path / "bad"
    state_dir.mkdir()
    (state_dir / state.STATE_FILE).write_text(content)
    got = as_json(node.host, state_dir, node.host.clock + 10 * HOUR)
    assert got["state"]["error"].startswith(error)
    if '"version": 2' in content:
        assert "is of format 2, newer than format 1" in got["state"]["error"]
    assert got["possible_orphans"] == []
    _, text, _ = run(node.host, args(state_dir), node.host.clock + 10 * HOUR)
    assert "stagings and publishes unknown" in text
    assert "unused volumes not judged" in text


def test_missing_state_file_means_nothing_staged(node: Node, tmp_path: Path) -> None:
    create(node, "idle")
    got = as_json(node.host, tmp_path / "none", node.host.clock + 2 * HOUR)
    assert got["state"] == {"path": str(tmp_path / "none" / state.STATE_FILE), "error": None,
                            "records": 0}
    assert len(got["possible_orphans"]) == 1


@pytest.mark.parametrize("bad", [
    ["--orphan-age", "soon"], ["--overprovision-ratio", "0.5"], ["--volume-group", "a/b"],
])
def test_bad_flags_exit_2(tmp_path: Path, bad: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        args(tmp_path, *bad)
    assert info.value.code == 2


def test_environment_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSI_LOCAL_VOLUME_GROUP", "vgx")
    monkeypatch.setenv("CSI_LOCAL_THIN_POOL", "poolx")
    monkeypatch.setenv("CSI_LOCAL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("CSI_LOCAL_OVERPROVISION_RATIO", "1.5")
    ns = build_parser().parse_args(["status"])
    assert (ns.volume_group, ns.thin_pool, ns.state_dir) == ("vgx", "poolx", str(tmp_path))
    assert ns.overprovision_ratio == 1.5 and ns.orphan_age == HOUR and not ns.json


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172800), ("1.5h", 5400),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert status.parse_duration(text) == seconds


def test_human_units() -> None:
    assert status.human_size(512) == "512 B"
    assert status.human_size(3 * GiB // 2) == "1.5 GiB"
    assert [status.human_age(s) for s in (5, 600, 3 * HOUR, 3 * 86400)] == ["5s", "10m", "3h",
                                                                             "3d"]


def test_never_takes_the_pool_lock(node: Node) -> None:
    pool = status.read_only_pool(node.backend.pools.default.lvm)
    with pytest.raises(Exception, match="never take a lock"), pool.reserved():
        pass


def test_host_volume_snapshots_and_clones_are_listed_with_their_source(node: Node) -> None:
    add_dhv(node.host)
    snap = "dhv-snap-" + "cd" * 16
    node.host.add_lv(snap, 512 * MiB, active=False, tags=[
        f"{dhv_tags.TAG_KIND}={dhv_tags.KIND_SNAPSHOT}", f"{dhv_tags.TAG_SNAPSHOT}=gold-v1",
        f"{dhv_tags.TAG_SOURCE}=volume:cache", f"{dhv_tags.TAG_FS}=xfs"])
    clone = "dhv-" + "ef" * 16
    node.host.add_lv(clone, 512 * MiB, tags=[
        f"{dhv_tags.TAG_KIND}={dhv_tags.KIND_VOLUME}", f"{dhv_tags.TAG_ID}=db-1",
        f"{dhv_tags.TAG_FS}=xfs", f"{dhv_tags.TAG_SOURCE}=snapshot:gold-v1"])
    got = as_json(node.host, node.backend.config.state_dir, node.host.clock)
    by_lv = {h["lv"]: h for h in got["host_volumes"]}
    assert by_lv[snap]["kind"] == "snapshot" and by_lv[snap]["id"] == "gold-v1"
    assert by_lv[snap]["source"] == "volume:cache"
    assert by_lv[clone]["kind"] == "volume" and by_lv[clone]["source"] == "snapshot:gold-v1"
    assert by_lv[DHV]["kind"] == "volume" and by_lv[DHV]["source"] is None
    assert got["possible_orphans"] == []
    _, text, _ = run(node.host, args(node.backend.config.state_dir), node.host.clock)
    assert "Host volumes (csi-local-dhv): 3" in text and "snapshot:gold-v1" in text


# device classes ---------------------------------------------------------------------

CLASSES = THREE_CLASSES  # two VGs; vg-hdd holds the pools of two classes


@pytest.fixture
def classes_file(tmp_path: Path) -> Path:
    path = tmp_path / "classes.toml"
    path.write_text(CLASSES)
    return path


@pytest.fixture
def cnode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return make_class_node(tmp_path, monkeypatch, CLASSES)


def cargs(config: Path, state_dir: Path | str, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["status", "--config", str(config), "--state-dir",
                                      str(state_dir), *extra])


def test_every_class_and_the_class_of_every_volume(cnode: Node, classes_file: Path) -> None:
    fast = create(cnode, "fast", params=CO)  # no deviceClass: the default class
    big = create(cnode, "big", 2 * GiB, params={"deviceClass": "big"})
    cold = create(cnode, "cold", 512 * MiB, params={"deviceClass": "cold"})
    snap = snapshot(cnode, "snap", big)
    cnode.host.add_lv(DHV, 256 * MiB, vg="vg-hdd", pool="cold", tags=[
        f"{dhv_tags.TAG_KIND}={dhv_tags.KIND_VOLUME}", f"{dhv_tags.TAG_ID}=cache"])
    # A CSI volume in a pool that is no class's (a class taken out of the file).
    cnode.host.add_pool("vg-hdd", "old", GiB)
    gone = cnode.host.add_lv(vol_id("gone"), GiB, vg="vg-hdd", pool="old",
                             tags=[f"{naming.TAG_KIND}={naming.KIND_VOLUME}"]).name
    cnode.host.lv("pool", vg="vg-hdd").data_percent = 95.0  # big is above its mark
    state_dir = cnode.backend.config.state_dir
    now = cnode.host.clock + 10
    cnode.host.calls.clear()

    got = as_json_of(cnode.host, cargs(classes_file, state_dir, "--json"), now)

    # One `vgs` and one `lvs` per VG, however many classes it holds.
    assert [c[0] for c in cnode.host.calls] == ["vgs", "lvs", "pvs", "vgs", "vgs", "lvs", "vgs"]
    assert got["config"] == str(classes_file) and got["default_class"] == "fast"
    classes = {c["name"]: c for c in got["classes"]}
    assert list(classes) == ["fast", "big", "cold"]
    assert [c["default"] for c in got["classes"]] == [True, False, False]
    assert classes["fast"]["volume_group"]["name"] == "vg-nvme"
    assert classes["big"]["volume_group"] == classes["cold"]["volume_group"]
    assert classes["big"]["volume_group"]["name"] == "vg-hdd"
    assert {n: c["thin_pool"]["name"] for n, c in classes.items()} == {
        "fast": "vg-nvme/pool", "big": "vg-hdd/pool", "cold": "vg-hdd/cold"}
    assert classes["fast"]["thin_pool"]["available"] == 10 * GiB - GiB
    assert classes["big"]["thin_pool"]["available"] == 20 * GiB - 4 * GiB  # ratio 2, snapshot
    assert classes["big"]["thin_pool"]["overprovision_ratio"] == 2.0
    assert classes["cold"]["thin_pool"]["available"] == 10 * GiB - 512 * MiB - 256 * MiB
    assert "vg-hdd/pool is above its high-water mark" in classes["big"]["thin_pool"][
        "fill_problem"]
    assert classes["cold"]["thin_pool"]["fill_problem"] is None
    assert all(c["error"] is None for c in got["classes"])
    # The keys of one class stay: the default class's VG and pool.
    assert got["volume_group"] == classes["fast"]["volume_group"]
    assert got["thin_pool"] == classes["fast"]["thin_pool"]
    by_id = {v["id"]: v for v in got["volumes"]}
    assert {i: v["device_class"] for i, v in by_id.items()} == {
        fast: "fast", big: "big", cold: "cold", gone: None}
    # A volume's condition is its own pool's.
    assert "vg-hdd/pool is above" in by_id[big]["condition"]["message"]
    assert not by_id[cold]["condition"]["abnormal"]
    assert not by_id[fast]["condition"]["abnormal"]
    assert not by_id[gone]["condition"]["abnormal"]
    (s,) = got["snapshots"]
    assert s["id"] == snap and s["device_class"] == "big"
    (h,) = got["host_volumes"]
    assert h["lv"] == DHV and h["device_class"] == "cold"

    code, text, err = run(cnode.host, cargs(classes_file, state_dir), now)
    assert code == 0 and err == ""
    lines = text.splitlines()
    assert lines[0] == f"Device classes ({classes_file}): fast, big, cold; default fast"
    assert lines[1] == "Class fast (default):"
    assert lines[2] == "  Volume group vg-nvme: size 11.0 GiB, free 1.0 GiB"
    assert lines[3].startswith("  Thin pool vg-nvme/pool: size 10.0 GiB, data 0.0%")
    assert lines[4] == "    below its high-water marks"
    assert "Class big:" in lines and "Class cold:" in lines
    assert "  Thin pool vg-hdd/pool: size 10.0 GiB, data 95.0%, metadata 0.0%, active; room " \
           "for new volumes 16.0 GiB (over-provisioning ratio 2)" in lines
    assert "    WARNING: thin pool vg-hdd/pool is above its high-water mark: data 95.0% full " \
           "(limit 90%)" in lines
    header = next(x for x in lines if x.strip().startswith("ID "))
    assert header.split()[:3] == ["ID", "CLASS", "SIZE"]
    rows = {x.split()[0]: x.split()[1] for x in lines if x.strip().startswith("csi-")}
    assert rows == {fast: "fast", big: "big", cold: "cold", gone: "-", snap: "big"}
    dhv_row = next(x for x in lines if x.strip().startswith(DHV))
    assert dhv_row.split()[:3] == [DHV, "cold", "volume"]


def as_json_of(host: FakeHost, ns: argparse.Namespace, now: float) -> Any:
    code, out, err = run(host, ns, now)
    assert code == 0, err
    return json.loads(out)


def test_a_class_whose_volume_group_is_missing(cnode: Node, classes_file: Path) -> None:
    fast = create(cnode, "fast")
    cnode.host.set_vg_present("vg-hdd", False)
    state_dir = cnode.backend.config.state_dir
    code, text, err = run(cnode.host, cargs(classes_file, state_dir), cnode.host.clock)
    # The classes that can be read are shown; the exit code says one could not.
    assert code == 1
    assert "Class fast (default):\n  Volume group vg-nvme: size" in text
    assert "Class big:\n  Volume group vg-hdd: PROBLEM: volume group vg-hdd not found" in text
    assert "Class cold:\n  Volume group vg-hdd: PROBLEM: volume group vg-hdd not found" in text
    assert fast in text
    assert err.splitlines() == [
        "csi-local status: class big: volume group vg-hdd not found: the node cannot serve "
        "volumes until it is back",
        "csi-local status: class cold: volume group vg-hdd not found: the node cannot serve "
        "volumes until it is back"]
    code, out, _ = run(cnode.host, cargs(classes_file, state_dir, "--json"), cnode.host.clock)
    got = json.loads(out)
    assert code == 1
    big = next(c for c in got["classes"] if c["name"] == "big")
    assert big["volume_group"] is None and "vg-hdd not found" in big["error"]
    assert big["thin_pool"]["found"] is False
    assert [v["id"] for v in got["volumes"]] == [fast]
    # Nothing readable at all: as with one class, exit 1 and nothing on stdout.
    cnode.host.set_vg_present("vg-nvme", False)
    code, text, err = run(cnode.host, cargs(classes_file, state_dir), cnode.host.clock)
    assert code == 1 and text == "" and "vg-nvme not found" in err


def test_the_default_class_missing_leaves_no_volume_group(cnode: Node,
                                                          classes_file: Path) -> None:
    cnode.host.set_vg_present("vg-nvme", False)
    code, out, _ = run(cnode.host, cargs(classes_file, cnode.backend.config.state_dir,
                                         "--json"), cnode.host.clock)
    got = json.loads(out)
    assert code == 1 and got["volume_group"] is None
    assert got["thin_pool"]["name"] == "vg-nvme/pool" and not got["thin_pool"]["found"]


def test_one_class_from_a_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "one.toml"
    path.write_text('[classes.fast]\nvolume_group = "vg0"\nthin_pool = "pool0"\n'
                    "overprovision_ratio = 3.0\n")
    host = FakeHost()
    code, text, _ = run(host, cargs(path, tmp_path), T0)
    assert code == 0
    assert text.startswith(f"Device classes ({path}): fast; default fast\nClass fast "
                           "(default):\n  Volume group vg0: ")
    assert "(over-provisioning ratio 3)" in text
    # --overprovision-ratio is the ratio of a class that sets none.
    path.write_text('[classes.fast]\nvolume_group = "vg0"\nthin_pool = "pool0"\n')
    got = as_json_of(host, cargs(path, tmp_path, "--json", "--overprovision-ratio", "1.5"), T0)
    assert got["thin_pool"]["overprovision_ratio"] == 1.5


def test_the_flags_are_one_class_named_default(node: Node) -> None:
    data = create(node, "data")
    got = as_json(node.host, node.backend.config.state_dir, node.host.clock)
    assert got["config"] is None and got["default_class"] == "default"
    (only,) = got["classes"]
    assert only["name"] == "default" and only["default"] and only["error"] is None
    assert only["volume_group"] == got["volume_group"]
    assert only["thin_pool"] == got["thin_pool"]
    assert [v["device_class"] for v in got["volumes"]] == ["default"]
    # The table of one class by the flags is as it always was: no class named.
    _, text, _ = run(node.host, args(node.backend.config.state_dir), node.host.clock)
    assert text.startswith("Volume group vg0: size 11.0 GiB, free 1016.0 MiB\nThin pool "
                           "vg0/pool0: size 10.0 GiB")
    assert "CLASS" not in text and "Class " not in text and "default" not in text
    header = next(x for x in text.splitlines() if x.strip().startswith("ID "))
    assert header.split()[:2] == ["ID", "SIZE"]
    assert data in text


def test_a_bad_configuration_file_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[classes.fast]\nvolume_group = "vg0"\nthin_pool = "pool0"\nstripes = 2\n')
    host = FakeHost()
    code, out, err = run(host, cargs(path, tmp_path), T0)
    assert code == 2 and out == ""
    assert err.startswith(f"csi-local status: {path}:4: class 'fast': unknown key 'stripes'")
    assert host.calls == []
    code, out, err = run(host, cargs(tmp_path / "none.toml", tmp_path), T0)
    assert code == 2 and "cannot read the configuration file" in err


@pytest.mark.parametrize(("argv", "env"), [
    (["--config", "/c.toml", "--volume-group", "vg0"], {}),
    (["--config", "/c.toml", "--thin-pool", "pool0"], {}),
    (["--config", "/c.toml"], {"CSI_LOCAL_VOLUME_GROUP": "vg0", "CSI_LOCAL_THIN_POOL": "p"}),
    (["--volume-group", "vg0", "--thin-pool", "pool0"], {"CSI_LOCAL_CONFIG": "/c.toml"}),
    (["--volume-group", "vg0"], {}),
    ([], {}),
])
def test_classes_from_exactly_one_source(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str],
                                         argv: list[str], env: dict[str, str]) -> None:
    for name in ("CSI_LOCAL_CONFIG", "CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["status", *argv])
    assert info.value.code == 2
    message = capsys.readouterr().err
    assert "not both" in message if "--config" in argv or env.get("CSI_LOCAL_CONFIG") else \
        "required" in message and "--config" in message


def test_the_configuration_file_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                    classes_file: Path) -> None:
    for name in ("CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CSI_LOCAL_CONFIG", str(classes_file))
    ns = build_parser().parse_args(["status"])
    assert ns.config == str(classes_file) and ns.volume_group is None
    assert [c.name for c in status.node_classes(ns).classes] == ["fast", "big", "cold"]


@pytest.mark.parametrize(("left", "says", "problem"), [
    pytest.param(None, "room for at least", False, id="empty"),
    pytest.param(0.1, "WARNING: above 80% full", False, id="above-80-percent"),
    pytest.param(0.0, "PROBLEM: the metadata area of volume group vg0 is", True, id="full"),
])
def test_the_metadata_area(node: Node, left: float | None, says: str, problem: bool) -> None:
    """How full the VG's metadata area is, a warning above 80 %, and when no
    further volume fits the problem, on the VG and on the pool (text and JSON)."""
    fvg = node.host.vgs["vg0"]
    limit = vg_text.max_text_size(fvg.mda_size)
    if left is not None:
        fvg.mda_padding += int(limit * (1 - left)) - fvg.mda_text
    code, text, _ = run(node.host, args(node.backend.config.state_dir), node.host.clock)
    assert code == 0
    assert "Metadata area of vg0: " in text and says in text, text
    got = as_json(node.host, node.backend.config.state_dir, node.host.clock)
    area = got["volume_group"]["metadata_area"]
    assert (area["problem"] is not None) is problem
    assert (got["thin_pool"]["count_problem"] is not None) is problem
    assert (area["lvs_that_fit"] == 0) is problem
