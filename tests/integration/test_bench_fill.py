"""The bench's fast fill (benchmarks/fill.py) on real LVM: 200 volumes and 20
snapshots cloned in LVM's metadata from what the plugin made are a VG that
vgck and thin_check pass, whose pool activates, that LVM and the plugin list
exactly, and whose volumes the plugin stages, deletes and snapshots like
any other."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.fill import Clone, fill_vg, pool_metadata_bytes
from benchmarks.lab import Lab, PluginProcess, run
from benchmarks.runner import _mount_cap
from csi_local._gen import csi_pb2 as pb
from csi_local.volumes import naming

pytestmark = pytest.mark.integration

VOLUMES = 200
SNAPSHOTS = 20
SIZE = 4 << 20


@pytest.fixture
def lab() -> Iterator[Lab]:
    lab = Lab(4 << 30, pool_metadata=pool_metadata_bytes(VOLUMES + SNAPSHOTS + 10))
    try:
        yield lab
    finally:
        lab.close()


def _names(plugin: PluginProcess, snapshots: bool) -> set[str]:
    names: set[str] = set()
    token = ""
    while True:
        if snapshots:
            snaps = plugin.controller.ListSnapshots(pb.ListSnapshotsRequest(
                starting_token=token, max_entries=64), timeout=600)
            names |= {e.snapshot.snapshot_id for e in snaps.entries}
            token = snaps.next_token
        else:
            volumes = plugin.controller.ListVolumes(pb.ListVolumesRequest(
                starting_token=token, max_entries=64), timeout=600)
            names |= {e.volume.volume_id for e in volumes.entries}
            token = volumes.next_token
        if not token:
            return names


def _lvs(vg: str, *fields: str) -> list[list[str]]:
    out = run("lvs", "--noheadings", "--separator", "|", "-o", ",".join(fields), vg).stdout
    return [[x.strip() for x in line.split("|")] for line in out.splitlines() if line.strip()]


def test_filled_volumes_are_real_lvs_the_plugin_serves(lab: Lab) -> None:
    assert lab.vg is not None
    vg = lab.vg.name
    plugin = lab.plugin()
    plugin.start()
    cap = _mount_cap()
    vid0 = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="fill-0", capacity_range=pb.CapacityRange(required_bytes=SIZE),
        volume_capabilities=[cap]), timeout=600).volume.volume_id
    sid0 = plugin.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="fill-snap-0", source_volume_id=vid0), timeout=600).snapshot.snapshot_id
    volumes = [vid0] + [naming.volume_id_for(f"fill-{i}") for i in range(1, VOLUMES)]
    snapshots = [(sid0, vid0)] + [(naming.snapshot_id_for(f"fill-snap-{j}"), volumes[10 * j])
                                  for j in range(1, SNAPSHOTS)]
    clones = ([Clone(v, vid0) for v in volumes[1:]]
              + [Clone(s, sid0, origin) for s, origin in snapshots[1:]])
    plugin.stop()

    made = fill_vg(run, vg, "pool", clones, Path(lab.path("fill")))
    assert len(made) == VOLUMES - 1 + SNAPSHOTS - 1

    # LVM's own checks: the VG's metadata, the pool's (read-only, pool inactive).
    run("vgck", vg)
    rows = _lvs(vg, "lv_name", "origin", "thin_id", "lv_tags")
    by_name = {r[0]: r for r in rows}
    assert {n for n in by_name if n.startswith("csi-v-")} == set(volumes)
    assert {n for n in by_name if n.startswith("csi-s-")} == {s for s, _ in snapshots}
    for sid, origin in snapshots:
        assert by_name[sid][1] == origin
        assert f"csi-local.source=volume:{origin}" in by_name[sid][3]
    thin_ids = [int(by_name[n][2]) for n in volumes + [s for s, _ in snapshots]]
    assert len(set(thin_ids)) == len(thin_ids)
    pool_row = _lvs(vg, "lv_name", "transaction_id", "lv_active")
    assert any(r[0] == "pool" and r[2] == "active" for r in pool_row), pool_row
    run("vgchange", "--activate", "n", vg)
    run("lvchange", "--activate", "y", "--yes", f"{vg}/pool_tmeta")
    try:
        run("thin_check", f"/dev/{vg}/pool_tmeta")
        dump = run("thin_dump", f"/dev/{vg}/pool_tmeta").stdout
    finally:
        run("lvchange", "--activate", "n", f"{vg}/pool_tmeta")
    assert sorted(int(x) for x in re.findall(r'dev_id="(\d+)"', dump)) == sorted(thin_ids)
    run("lvchange", "--activate", "y", f"{vg}/pool")

    plugin.start()
    assert _names(plugin, snapshots=False) == set(volumes)
    assert _names(plugin, snapshots=True) == {s for s, _ in snapshots}

    # A filled volume: staged (activated, mkfs, mounted), written, unstaged, deleted.
    vid = volumes[123]
    staging = os.path.join(lab.path("stage"), "staging")
    plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=staging, volume_capability=cap), timeout=600)
    with open(os.path.join(staging, "probe"), "w") as f:
        f.write("written")
    plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=staging), timeout=600)
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid), timeout=600)
    # A filled snapshot, and a new volume restored from it; then a fresh one.
    sid, origin = snapshots[7]
    restored = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="fill-restored", capacity_range=pb.CapacityRange(required_bytes=SIZE),
        volume_capabilities=[cap], volume_content_source=pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=sid))),
        timeout=600).volume.volume_id
    plugin.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=sid), timeout=600)
    fresh = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="fill-fresh", capacity_range=pb.CapacityRange(required_bytes=SIZE),
        volume_capabilities=[cap]), timeout=600).volume.volume_id
    assert _names(plugin, snapshots=False) == (set(volumes) - {vid}) | {restored, fresh}
    plugin.stop()
    run("vgck", vg)
    names = {r[0] for r in _lvs(vg, "lv_name")}
    assert vid not in names and sid not in names and origin in names
