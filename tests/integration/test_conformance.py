"""Conformance defects found by upstream csi-sanity and by review, against real LVM.

Each test fails on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import os
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from tests.integration.conftest import LoopVG, PluginProcess, block_cap, expect_code, mount_cap
from tests.integration.test_node import create, publish, stage, state, unpublish, unstage
from tests.integration.test_snapshots import restore, snap, write

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode
UNKNOWN_ID = "csi-v-" + "9" * 32


def test_not_found_for_volume_not_at_path(plugin: PluginProcess) -> None:
    """csi-sanity sends `volume_path: "some/path"`; the spec's tables say NOT_FOUND.
    (Before: the relative path was INVALID_ARGUMENT first.)"""
    stats, expand = plugin.node.NodeGetVolumeStats, plugin.node.NodeExpandVolume
    expect_code(Code.NOT_FOUND, stats, pb.NodeGetVolumeStatsRequest(
        volume_id=UNKNOWN_ID, volume_path="some/path"))
    expect_code(Code.NOT_FOUND, expand, pb.NodeExpandVolumeRequest(
        volume_id=UNKNOWN_ID, volume_path="some/path",
        capacity_range=pb.CapacityRange(required_bytes=64 * MiB)))
    vid = create(plugin, "at-path")
    staging, target = plugin.path("s-at"), plugin.path("t-at")
    stage(plugin, vid, staging)
    publish(plugin, vid, staging, target)
    for other in ("some/path", plugin.path("not-its-path")):
        expect_code(Code.NOT_FOUND, stats, pb.NodeGetVolumeStatsRequest(
            volume_id=vid, volume_path=other))
    assert stats(pb.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=target)).usage
    expect_code(Code.INVALID_ARGUMENT, stage, plugin, vid, "relative/staging")
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_repeat_publish_after_state_rebuild(plugin_factory: Any) -> None:
    """A publish recorded by a rebuild (access mode unknown) accepts the CO's repeat.
    (Before: ALREADY_EXISTS.)"""
    p: PluginProcess = plugin_factory()
    vid = create(p, "again")
    staging, target = p.path("s-again"), p.path("t-again")
    stage(p, vid, staging)
    publish(p, vid, staging, target)
    p.kill()
    (p.state_dir / "state.json").unlink()
    p.start()
    stage(p, vid, staging)
    publish(p, vid, staging, target)
    rec = state(p)[vid]
    assert rec["publishes"][target]["access_mode"] == mount_cap().access_mode.mode  # type: ignore[index]
    unpublish(p, vid, target)
    unstage(p, vid, staging)


def test_btrfs_rounds_up_to_its_minimum(plugin: PluginProcess) -> None:
    """mkfs.btrfs needs >= 114 MiB. (Before: a 64 MiB volume was made, then stage INTERNAL.)"""
    vol = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="tiny-btrfs", capacity_range=pb.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[mount_cap("btrfs")])).volume
    assert vol.capacity_bytes >= 114 * MiB
    staging = plugin.path("s-btrfs")
    stage(plugin, vol.volume_id, staging, mount_cap("btrfs"))
    unstage(plugin, vol.volume_id, staging)
    expect_code(Code.OUT_OF_RANGE, plugin.controller.CreateVolume, pb.CreateVolumeRequest(
        name="tiny-btrfs-2",
        capacity_range=pb.CapacityRange(required_bytes=64 * MiB, limit_bytes=64 * MiB),
        volume_capabilities=[mount_cap("btrfs")]))


def _fs_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def test_block_stage_keeps_the_grow_fs_tag(plugin: PluginProcess) -> None:
    """A clone grown past its source, staged first as block and then as a file system,
    gets its file system grown. (Before: the block stage dropped the tag.)"""
    vid = create(plugin, "grow-src", size=64 * MiB)
    s = plugin.path("s-grow-src")
    stage(plugin, vid, s)
    write(f"{s}/data", "grown")
    unstage(plugin, vid, s)
    cid = restore(plugin, "grow-clone", volume=vid, size=256 * MiB).volume_id
    bs = plugin.path("s-grow-blk")
    stage(plugin, cid, bs, block_cap())
    unstage(plugin, cid, bs)
    ms = plugin.path("s-grow-fs")
    stage(plugin, cid, ms)
    assert open(f"{ms}/data").read() == "grown"
    assert _fs_bytes(ms) > 200 * MiB
    unstage(plugin, cid, ms)


@pytest.mark.parametrize("fs_type", ["xfs", "btrfs"])
def test_restore_and_clone_mount_beside_their_origin(plugin: PluginProcess, vg: LoopVG,
                                                      fs_type: str) -> None:
    """xfs refuses a second file system with a mounted one's UUID, and btrfs takes it
    for a device of the mounted one. Restores and clones get an identity of their own.
    (Before: staging them next to their mounted origin failed.)"""
    size = 320 * MiB
    cap = mount_cap(fs_type)
    vid = create(plugin, f"origin-{fs_type}", size=size, cap=cap)
    s, t = plugin.path(f"s-o-{fs_type}"), plugin.path(f"t-o-{fs_type}")
    stage(plugin, vid, s, cap)
    publish(plugin, vid, s, t, cap)
    write(f"{t}/data", "first")
    sid = snap(plugin, f"snap-{fs_type}", vid).snapshot_id
    write(f"{t}/data", "second")
    rid = restore(plugin, f"restored-{fs_type}", snapshot=sid, size=size, cap=cap).volume_id
    cid = restore(plugin, f"cloned-{fs_type}", volume=vid, size=size, cap=cap).volume_id
    rs, cs = plugin.path(f"s-r-{fs_type}"), plugin.path(f"s-c-{fs_type}")
    stage(plugin, rid, rs, cap)
    stage(plugin, cid, cs, cap)
    assert open(f"{rs}/data").read() == "first"
    assert open(f"{cs}/data").read() == "second"
    assert open(f"{t}/data").read() == "second"
    write(f"{cs}/data", "clone's own")
    assert open(f"{t}/data").read() == "second"
    for vol, path in ((rid, rs), (cid, cs)):
        unstage(plugin, vol, path)
        stage(plugin, vol, path, cap)  # a later stage of the same clone works too
        unstage(plugin, vol, path)
    unpublish(plugin, vid, t)
    unstage(plugin, vid, s)
