"""Data-safety and security defects, proven against real LVM, mkfs and mount.

Each test fails on the code before its fix (see the docstrings).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from tests.integration.conftest import (
    LoopVG,
    PluginProcess,
    block_cap,
    expect_code,
    make_vg,
    mount_cap,
    run,
)
from tests.integration.test_node import create, publish, stage, state, unpublish, unstage
from tests.integration.test_snapshots import snap

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode
PATTERN = b"csi-local raw block data, not a file system signature\n" * 80


def test_volume_used_as_block_is_never_formatted(plugin: PluginProcess) -> None:
    """Raw data written through a block publish survives a later stage as a file
    system: the stage is refused. (Before: blkid found nothing, so mkfs ran.)"""
    vid = create(plugin, "raw", cap=block_cap())
    staging, target = plugin.path("s-raw"), plugin.path("t-raw")
    stage(plugin, vid, staging, block_cap())
    publish(plugin, vid, staging, target, block_cap())
    with open(target, "r+b") as dev:
        dev.seek(3 * MiB)
        dev.write(PATTERN)
        dev.flush()
        os.fsync(dev.fileno())
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)
    err = expect_code(Code.FAILED_PRECONDITION, stage, plugin, vid, plugin.path("s-fs"),
                      mount_cap("ext4"))
    assert "used before" in (err.details() or "")
    assert not mounts.is_mount_point(plugin.path("s-fs"))
    lv_path = f"/dev/{plugin.vg.name}/{vid}"
    assert run("blkid", "-p", lv_path, check=False).returncode == 2  # still no signature
    with open(lv_path, "rb") as dev:
        dev.seek(3 * MiB)
        assert dev.read(len(PATTERN)) == PATTERN


def _mapped_sectors(vg: str, lv: str) -> int:
    """The thin device's mapped sectors, as dmsetup prints them (the test's own
    reading, independent of the plugin's ioctl)."""
    name = f"{vg.replace('-', '--')}-{lv.replace('-', '--')}"
    return int(run("dmsetup", "status", name).stdout.split()[3])


def test_block_volume_never_written_is_formatted_later(plugin: PluginProcess) -> None:
    """A volume handed out raw whose workload never wrote maps no block: it holds
    nothing, so a later stage as a file system formats it. (Before: the first
    stage of any kind dropped the "fresh" tag, and the volume was refused forever.)"""
    vid = create(plugin, "unwritten", cap=block_cap())
    staging = plugin.path("s-unwritten")
    stage(plugin, vid, staging, block_cap())
    unstage(plugin, vid, staging)
    assert _mapped_sectors(plugin.vg.name, vid) == 0
    stage(plugin, vid, plugin.path("s-unwritten-fs"), mount_cap("ext4"))
    lv_path = f"/dev/{plugin.vg.name}/{vid}"
    assert run("blkid", "-p", "-o", "value", "-s", "TYPE", lv_path).stdout.strip() == "ext4"
    assert _mapped_sectors(plugin.vg.name, vid) > 0


def _find_process(argv0: str, arg: str, deadline: float) -> int | None:
    """The pid of a running `argv0 ... arg` (its cmdline), polled until `deadline`."""
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
            except OSError:
                continue
            if words and os.path.basename(words[0]) == argv0.encode() and arg.encode() in words:
                return int(pid)
        time.sleep(0.005)
    return None


def test_stage_killed_inside_mkfs_formats_on_retry(plugin_factory: Any) -> None:
    """kill -9 of the plugin and of its mkfs part-way: the blocks that mkfs
    mapped are its own (the formatting mark says so), so the retry formats and
    mounts. A volume with mapped blocks and no mark is refused (see above)."""
    p: PluginProcess = plugin_factory()
    vid = create(p, "killed-mkfs", size=512 * MiB)
    lv_path = f"/dev/{p.vg.name}/{vid}"
    staging = p.path("s-killed-mkfs")
    req = pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=staging,
                                    volume_capability=mount_cap("ext4"))
    fut = p.node.NodeStageVolume.future(req)
    pid = _find_process("mkfs.ext4", lv_path, time.monotonic() + 120)
    assert pid is not None, "mkfs.ext4 never ran"
    # Hold it where it is, then kill both. mkfs may have finished between
    # being found and the signal (a zombie takes SIGSTOP, then is reaped):
    # the plugin dies all the same before it mounts, and the retry must cope.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(grpc.RpcError):
        fut.result()
    if _mapped_sectors(p.vg.name, vid) == 0:
        # Caught before its first write: write what a later kill would have left.
        with open(lv_path, "r+b") as dev:
            dev.seek(8 * MiB)
            dev.write(PATTERN)
            os.fsync(dev.fileno())
    assert _mapped_sectors(p.vg.name, vid) > 0
    assert [f.name for f in p.state_dir.iterdir() if f.name.startswith("formatting.")]
    p.start()
    stage(p, vid, staging, mount_cap("ext4"))
    assert mounts.top_mount(staging) is not None
    assert run("blkid", "-p", "-o", "value", "-s", "TYPE", lv_path).stdout.strip() == "ext4"
    assert not [f.name for f in p.state_dir.iterdir() if f.name.startswith("formatting.")]
    unstage(p, vid, staging)
    p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))


def test_snapshot_counts_against_the_pool(plugin: PluginProcess, vg: LoopVG) -> None:
    """With ratio 1.0 a snapshot that could outgrow the pool is RESOURCE_EXHAUSTED,
    and leaves no LV. (Before: CreateSnapshot took no pool lock and checked nothing.)"""
    cap = plugin.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity
    big = (cap * 6 // 10) // MiB * MiB
    vid = create(plugin, "big", size=big)
    before = vg.lv_names()
    err = expect_code(Code.RESOURCE_EXHAUSTED, snap, plugin, "big-snap", vid)
    assert "room for" in (err.details() or "")
    assert vg.lv_names() == before
    small = create(plugin, "small", size=16 * MiB)
    assert snap(plugin, "small-snap", small).ready_to_use  # what fits still works


def _kubelet_paths(p: PluginProcess) -> tuple[str, str, str]:
    root = p.workdir / "kubelet" / "plugins" / "kubernetes.io" / "csi" / "volumeDevices"
    return (str(root / "staging" / "pvc-1"), str(root / "publish" / "pvc-1" / "uid-1"),
            str(root / "pvc-1" / "dev" / "uid-1"))


def test_rebuilt_state_ignores_kubelets_own_device_bind(plugin_factory: Any) -> None:
    """After a state loss, kubelet's own bind of a block device (volumeDevices/<pv>/dev/<uid>)
    is not a publish, so unstage and delete work once the CO's publish is gone.
    (Before: it was recorded as a publish nobody ever unpublishes: unstage refused forever.)"""
    p: PluginProcess = plugin_factory()
    vid = create(p, "kblk", cap=block_cap())
    staging, target, own = _kubelet_paths(p)
    stage(p, vid, staging, block_cap())
    os.makedirs(os.path.dirname(target))
    publish(p, vid, staging, target, block_cap())
    os.makedirs(os.path.dirname(own))
    open(own, "w").close()
    run("mount", "--bind", target, own)  # what kubelet does to keep the device mapped
    p.kill()
    (p.state_dir / "state.json").unlink()
    p.start()
    assert list(state(p)[vid]["publishes"]) == [target]  # type: ignore[index]
    unpublish(p, vid, target)
    run("umount", own)  # kubelet unmaps its own bind
    unstage(p, vid, staging)
    assert vid not in state(p)
    p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))


def test_stale_state_after_reboot_does_not_block_delete(plugin_factory: Any) -> None:
    """A state file naming mounts that are gone (a reboot) is reconciled at start.
    (Before: its records refused DeleteVolume forever.)"""
    p: PluginProcess = plugin_factory()
    vid = create(p, "stale")
    staging, target = p.path("s-stale"), p.path("t-stale")
    stage(p, vid, staging)
    publish(p, vid, staging, target)
    p.kill()
    run("umount", target)
    run("umount", staging)  # what a reboot leaves: the file remembers, the kernel does not
    p.start()
    assert vid not in state(p)
    p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert vid not in p.vg.lv_names()


def test_reconcile_keeps_what_is_still_mounted(plugin_factory: Any) -> None:
    """At start only the state file's own volumes are looked up (in the committed
    metadata, their devices by ioctl): a record whose mounts are all there is kept
    whole, one that lost a publish keeps the rest, one whose LV is gone is dropped."""
    p: PluginProcess = plugin_factory()
    kept, trimmed, gone = (create(p, name) for name in ("kept", "trimmed", "gone"))
    for vid in (kept, trimmed, gone):
        stage(p, vid, p.path(f"s-{vid}"))
    publish(p, kept, p.path(f"s-{kept}"), p.path("t-kept"))
    publish(p, trimmed, p.path(f"s-{trimmed}"), p.path("t-trimmed"))
    before: dict[str, Any] = state(p)
    p.kill()
    run("umount", p.path("t-trimmed"))
    run("umount", p.path(f"s-{gone}"))
    run("lvremove", "--yes", f"{p.vg.name}/{gone}")
    p.start()
    after: dict[str, Any] = state(p)
    assert after[kept] == before[kept]
    assert after[trimmed]["staging"] == before[trimmed]["staging"]
    assert after[trimmed]["publishes"] == {}
    assert gone not in after
    for vid, target in ((kept, "t-kept"), (trimmed, None)):
        if target:
            unpublish(p, vid, p.path(target))
        unstage(p, vid, p.path(f"s-{vid}"))
        p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))


def test_missing_vg_is_unavailable_and_forgets_nothing(plugin_factory: Any) -> None:
    """With the VG gone (renamed away here), every RPC that changes or reads a volume is
    UNAVAILABLE, and GetCapacity reports 0;
    the volume and snapshot are still there when it comes back.
    (Before: DeleteVolume and DeleteSnapshot said OK, CreateVolume NOT_FOUND.)"""
    other = make_vg(size=1 << 30)
    try:
        p: PluginProcess = plugin_factory(target_vg=other)
        vid = create(p, "keep")
        sid = snap(p, "keep-snap", vid).snapshot_id
        run("vgrename", other.name, other.name + "x")
        try:
            calls = [
                (p.controller.DeleteVolume, pb.DeleteVolumeRequest(volume_id=vid)),
                (p.controller.DeleteSnapshot, pb.DeleteSnapshotRequest(snapshot_id=sid)),
                (p.controller.CreateVolume, pb.CreateVolumeRequest(
                    name="new", volume_capabilities=[mount_cap()])),
                (p.controller.ControllerGetVolume, pb.ControllerGetVolumeRequest(volume_id=vid)),
                (p.node.NodeStageVolume, pb.NodeStageVolumeRequest(
                    volume_id=vid, staging_target_path=p.path("s-keep"),
                    volume_capability=mount_cap())),
            ]
            for fn, req in calls:
                expect_code(Code.UNAVAILABLE, fn, req)
            # A query: no room on a node without its VG (an error would leave the
            # CO's last, positive, capacity in place).
            assert p.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity == 0
        finally:
            run("vgrename", other.name + "x", other.name)
        assert {vid, sid} <= set(other.lv_names())
    finally:
        run("lvremove", "--yes", "--select", f"lv_name!={other.pool}", other.name, check=False)
        other.destroy()


def test_unstage_with_traversal_id_touches_nothing(plugin: PluginProcess) -> None:
    """The Nomad case: volume_id "../victim-file" joined to the staging path.
    (Before: NodeUnstageVolume unlinked the victim.)"""
    staging = plugin.path("co", "staging")
    os.makedirs(staging)
    victim = os.path.join(os.path.dirname(staging), "victim-file")
    with open(victim, "w") as f:
        f.write("precious")
    expect_code(Code.INVALID_ARGUMENT, plugin.node.NodeUnstageVolume,
                pb.NodeUnstageVolumeRequest(volume_id="../victim-file",
                                            staging_target_path=staging))
    assert open(victim).read() == "precious"


def test_symlinked_targets(plugin: PluginProcess) -> None:
    """A target that is a symlink is refused (before: mounted at the link's destination);
    a target under a symlinked directory is mounted and unmounted at its real path
    (before: unpublish missed it and leaked the mount); /etc is refused."""
    vid = create(plugin, "links")
    staging = plugin.path("s-links")
    stage(plugin, vid, staging)
    dest = plugin.path("elsewhere")
    os.makedirs(dest)
    link = plugin.path("link-target")
    os.symlink(dest, link)
    expect_code(Code.INVALID_ARGUMENT, publish, plugin, vid, staging, link)
    assert not mounts.is_mount_point(dest)
    expect_code(Code.INVALID_ARGUMENT, publish, plugin, vid, staging, "/etc/csi-local-target")
    assert not os.path.exists("/etc/csi-local-target")
    real_dir = plugin.path("real-dir")
    os.makedirs(real_dir)
    alias = plugin.path("alias-dir")
    os.symlink(real_dir, alias)
    publish(plugin, vid, staging, os.path.join(alias, "pod"))
    assert mounts.is_mount_point(os.path.join(real_dir, "pod"))
    unpublish(plugin, vid, os.path.join(alias, "pod"))
    assert not mounts.is_mount_point(os.path.join(real_dir, "pod"))
    assert not state(plugin)[vid]["publishes"]  # type: ignore[index]
    unstage(plugin, vid, staging)


def test_failed_readonly_block_publish_detaches_its_loop_device(plugin_factory: Any) -> None:
    """When the state write fails after a read-only block publish, the rollback unmounts
    and detaches the read-only loop device. (Before: the loop device leaked.)"""
    p: PluginProcess = plugin_factory()
    vid = create(p, "loopy", cap=block_cap())
    staging, target = p.path("s-loopy"), p.path("t-loopy")
    stage(p, vid, staging, block_cap())
    state_file = p.state_dir / "state.json"
    saved = state_file.read_text()
    state_file.unlink()
    state_file.mkdir()  # the next atomic rename onto it fails
    try:
        with pytest.raises(grpc.RpcError):
            publish(p, vid, staging, target, block_cap(), readonly=True)
    finally:
        state_file.rmdir()
        state_file.write_text(saved)
    lv_path = os.path.realpath(f"/dev/{p.vg.name}/{vid}")
    loops = subprocess.run(["losetup", "--associated", lv_path], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert loops == "", f"loop device left behind: {loops}"
    assert not mounts.is_mount_point(target)
