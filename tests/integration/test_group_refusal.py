"""Group snapshots on Debian 12's own kernel (6.1), which cannot let LVM
snapshot a frozen file system: mounted volumes are refused together with
FAILED_PRECONDITION and nothing is left made or frozen; volumes no one has
open are snapshotted together; a raw block device in use is refused."""

from __future__ import annotations

import os
import threading

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import PluginProcess, block_cap, expect_code, run
from tests.integration.test_group_snapshots import groups, mounted, release, take
from tests.integration.test_node import create, publish, stage, unpublish, unstage

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode


def writable(path: str, timeout: float = 60.0) -> bool:
    """Whether a write and fsync under `path` completes (a frozen file system
    holds it; the thread is left behind then, and the test fails)."""
    done = threading.Event()

    def write() -> None:
        with open(os.path.join(path, "probe"), "wb") as f:
            f.write(b"x")
            os.fsync(f.fileno())
        done.set()

    threading.Thread(target=write, daemon=True).start()
    return done.wait(timeout)


def lv_names(p: PluginProcess) -> set[str]:
    return set(run("lvs", "--noheadings", "-o", "lv_name", p.vg.name).stdout.split())


def test_mounted_volumes_refused_on_this_kernel(plugin: PluginProcess) -> None:
    a, b = mounted(plugin, "ref-a"), mounted(plugin, "ref-b")
    before = lv_names(plugin)
    err = expect_code(Code.FAILED_PRECONDITION, take, plugin, "ref", [a[0], b[0]])
    assert "frozen file system" in (err.details() or ""), err.details()
    assert lv_names(plugin) == before, "a refused group left member snapshots"
    for _, _, target in (a, b):
        assert writable(target), f"{target} is still frozen after the refused group"
    assert not [n for n in os.listdir(plugin.state_dir) if n.startswith("group-take.")]
    # One mounted volume alone is one instant already: no freeze, taken.
    alone = take(plugin, "ref-alone", [a[0]])
    assert [s.source_volume_id for s in alone.snapshots] == [a[0]]
    groups(plugin).DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=alone.group_snapshot_id))
    for vid, staging, target in (a, b):
        release(plugin, vid, staging, target)


def test_unused_volumes_together_and_raw_block_in_use(plugin: PluginProcess) -> None:
    quiet = [create(plugin, f"quiet-{i}", 32 * MiB) for i in range(3)]
    group = take(plugin, "quiet", quiet)
    assert sorted(s.source_volume_id for s in group.snapshots) == sorted(quiet)
    assert {s.snapshot_id for s in group.snapshots} <= lv_names(plugin)
    raw = create(plugin, "raw-used", 32 * MiB, cap=block_cap())
    staging, target = plugin.path("raw", "staging"), plugin.path("raw", "target")
    os.makedirs(staging, exist_ok=True)
    stage(plugin, raw, staging, block_cap())
    publish(plugin, raw, staging, target, block_cap())
    before = lv_names(plugin)
    err = expect_code(Code.FAILED_PRECONDITION, take, plugin, "raw-grp", [quiet[0], raw])
    assert "raw block" in (err.details() or ""), err.details()
    assert lv_names(plugin) == before
    unpublish(plugin, raw, target)
    unstage(plugin, raw, staging)
    groups(plugin).DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id))
