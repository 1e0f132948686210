"""Node service against real LVM, mkfs and mount."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import subprocess

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host import mounts
from tests.integration.conftest import LoopVG, PluginProcess, block_cap, expect_code, mount_cap, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
Code = grpc.StatusCode
Mode = pb.VolumeCapability.AccessMode


def create(p: PluginProcess, name: str, size: int = 32 * MiB,
           cap: pb.VolumeCapability | None = None) -> str:
    return p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[cap or mount_cap()])).volume.volume_id


def stage(p: PluginProcess, vid: str, path: str, cap: pb.VolumeCapability | None = None) -> None:
    p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=path, volume_capability=cap or mount_cap()))


def unstage(p: PluginProcess, vid: str, path: str) -> None:
    p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=path))


def publish(p: PluginProcess, vid: str, staging: str, target: str,
            cap: pb.VolumeCapability | None = None, readonly: bool = False) -> None:
    p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=staging, target_path=target,
        volume_capability=cap or mount_cap(), readonly=readonly))


def unpublish(p: PluginProcess, vid: str, target: str) -> None:
    p.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target))


def state(p: PluginProcess) -> dict[str, object]:
    return json.loads((p.state_dir / "state.json").read_text())["volumes"]  # type: ignore[no-any-return]


def test_node_info_and_capabilities(plugin_factory: object) -> None:
    p = plugin_factory("--max-volumes-per-node", "7")  # type: ignore[operator]
    info = p.node.NodeGetInfo(pb.NodeGetInfoRequest())
    assert info.node_id == "node-1" and info.max_volumes_per_node == 7
    caps = {c.rpc.type for c in p.node.NodeGetCapabilities(
        pb.NodeGetCapabilitiesRequest()).capabilities}
    R = pb.NodeServiceCapability.RPC
    assert {R.STAGE_UNSTAGE_VOLUME, R.GET_VOLUME_STATS, R.VOLUME_CONDITION,
            R.SINGLE_NODE_MULTI_WRITER, R.EXPAND_VOLUME} <= caps


def test_mount_lifecycle_keeps_data(plugin: PluginProcess) -> None:
    vid = create(plugin, "life")
    staging, target = plugin.path("stage-life"), plugin.path("pod", "life")
    stage(plugin, vid, staging, mount_cap(flags=("noatime",)))
    stage(plugin, vid, staging, mount_cap(flags=("noatime",)))  # idempotent
    top = mounts.top_mount(staging)
    assert top is not None and top.fs_type == "ext4" and "noatime" in top.options
    publish(plugin, vid, staging, target, mount_cap(flags=("noatime",)))
    publish(plugin, vid, staging, target, mount_cap(flags=("noatime",)))  # idempotent
    with open(f"{target}/hello", "w") as f:
        f.write("world")
    rec = state(plugin)[vid]
    assert rec["staging"]["path"] == staging and rec["publish_count"] == 1  # type: ignore[index]
    ro = plugin.path("pod", "life-ro")
    publish(plugin, vid, staging, ro, mount_cap(flags=("noatime",)), readonly=True)
    with pytest.raises(OSError) as info:
        open(f"{ro}/nope", "w")
    assert info.value.errno == errno.EROFS
    assert open(f"{ro}/hello").read() == "world"
    # Unstage with live publishes: refused, nothing unmounted.
    expect_code(Code.FAILED_PRECONDITION, unstage, plugin, vid, staging)
    assert mounts.is_mount_point(staging) and mounts.is_mount_point(target)
    for t in (target, ro):
        unpublish(plugin, vid, t)
        unpublish(plugin, vid, t)  # idempotent
        assert not mounts.is_mount_point(t) and not os.path.exists(t)
    unstage(plugin, vid, staging)
    unstage(plugin, vid, staging)
    assert not mounts.is_mount_point(staging)
    assert vid not in state(plugin)
    # Re-stage: the same file system, data intact (never reformatted).
    stage(plugin, vid, staging)
    assert open(f"{staging}/hello").read() == "world"
    unstage(plugin, vid, staging)


def test_publish_flags_keep_those_of_the_staging_mount(plugin: PluginProcess) -> None:
    # A publish is a bind, plus a remount for read-only and other flags. The
    # kernel gives a remounted bind exactly the flags passed, so a remount that
    # passed only "ro" would make a nosuid,nodev volume suid and dev again.
    vid = create(plugin, "flags")
    staging = plugin.path("stage-flags")
    stage(plugin, vid, staging, mount_cap(flags=("nosuid", "nodev", "noatime")))
    ro, nx = plugin.path("pod", "flags-ro"), plugin.path("pod", "flags-nx")
    publish(plugin, vid, staging, ro, mount_cap(), readonly=True)
    publish(plugin, vid, staging, nx, mount_cap(flags=("noexec",)))
    seen = {t: (m.options if (m := mounts.top_mount(t)) else None) for t in (ro, nx)}
    ro_options, nx_options = seen[ro], seen[nx]
    assert ro_options is not None and {"ro", "nosuid", "nodev", "noatime"} <= ro_options, seen
    assert nx_options is not None and {"rw", "noexec", "nosuid", "nodev", "noatime"} <= nx_options
    with pytest.raises(OSError) as info:
        open(f"{ro}/nope", "w")
    assert info.value.errno == errno.EROFS
    with open(f"{nx}/run.sh", "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(f"{nx}/run.sh", 0o755)
    with pytest.raises(PermissionError):
        subprocess.run([f"{nx}/run.sh"], check=False)  # noexec: the exec itself is refused
    for t in (ro, nx):
        unpublish(plugin, vid, t)
        assert not mounts.is_mount_point(t) and not os.path.exists(t)
    unstage(plugin, vid, staging)
    assert not mounts.is_mount_point(staging)


def test_incompatible_restage_and_unstaged_publish(plugin: PluginProcess) -> None:
    vid = create(plugin, "compat")
    staging = plugin.path("stage-compat")
    expect_code(Code.FAILED_PRECONDITION, publish, plugin, vid, staging, plugin.path("t0"))
    stage(plugin, vid, staging)
    expect_code(Code.ALREADY_EXISTS, stage, plugin, vid, staging, mount_cap(flags=("ro",)))
    expect_code(Code.ALREADY_EXISTS, stage, plugin, vid, plugin.path("elsewhere"))
    expect_code(Code.NOT_FOUND, stage, plugin, "csi-v-" + "2" * 32, plugin.path("s2"))
    expect_code(Code.INVALID_ARGUMENT, stage, plugin, vid, "relative/path")
    expect_code(Code.INVALID_ARGUMENT, publish, plugin, vid, staging, "rel")
    unstage(plugin, vid, staging)


def test_publish_refuses_a_staging_path_whose_mount_is_gone(plugin: PluginProcess) -> None:
    """A staging record that outlived its mount (unmounted behind the plugin's
    back) must never make publish bind the bare directory: that is the node's
    own root file system, not the volume."""
    vid = create(plugin, "gone")
    staging, target = plugin.path("stage-gone"), plugin.path("pod", "gone")
    stage(plugin, vid, staging)
    run("umount", staging)
    err = expect_code(Code.FAILED_PRECONDITION, publish, plugin, vid, staging, target)
    assert "stage it again" in (err.details() or "")
    assert not mounts.is_mount_point(target)
    stage(plugin, vid, staging)  # the CO's retry of the stage mounts it again
    publish(plugin, vid, staging, target)
    top = mounts.top_mount(target)
    assert top is not None and top.fs_type == "ext4"
    # The same target again with other mount flags is another publish: refused.
    expect_code(Code.ALREADY_EXISTS, publish, plugin, vid, staging, target,
                mount_cap(flags=("noatime",)))
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_never_reformats_another_fs(plugin: PluginProcess) -> None:
    vid = create(plugin, "nofmt", size=320 * MiB)
    staging = plugin.path("stage-nofmt")
    stage(plugin, vid, staging, mount_cap("ext4"))
    with open(f"{staging}/keep", "w") as f:
        f.write("precious")
    unstage(plugin, vid, staging)
    err = expect_code(Code.FAILED_PRECONDITION, stage, plugin, vid, staging, mount_cap("xfs"))
    assert "ext4" in (err.details() or "") and "xfs" in (err.details() or "")
    assert not mounts.is_mount_point(staging)
    stage(plugin, vid, staging, mount_cap("ext4"))
    assert open(f"{staging}/keep").read() == "precious"
    unstage(plugin, vid, staging)


@pytest.mark.parametrize("fs_type", ["xfs", "btrfs"])
def test_other_filesystems(plugin: PluginProcess, fs_type: str) -> None:
    vid = create(plugin, f"fs-{fs_type}", size=320 * MiB, cap=mount_cap(fs_type))
    staging, target = plugin.path(f"s-{fs_type}"), plugin.path(f"t-{fs_type}")
    stage(plugin, vid, staging, mount_cap(fs_type))
    assert mounts.top_mount(staging).fs_type == fs_type  # type: ignore[union-attr]
    publish(plugin, vid, staging, target, mount_cap(fs_type))
    with open(f"{target}/x", "w") as f:
        f.write(fs_type)
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_block_volume_io_through_target(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "blk", cap=block_cap())
    staging, target = plugin.path("stage-blk"), plugin.path("dev", "blk")
    stage(plugin, vid, staging, block_cap())
    publish(plugin, vid, staging, target, block_cap())
    payload = os.urandom(4096)
    fd = os.open(target, os.O_WRONLY | os.O_SYNC)
    os.pwrite(fd, payload, 8192)
    os.close(fd)
    with open(f"/dev/{vg.name}/{vid}", "rb") as f:
        f.seek(8192)
        assert f.read(4096) == payload
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=target))
    assert [u.total for u in stats.usage] == [32 * MiB]
    # Read-only block publish: the kernel refuses writes (a read-only bind of a
    # device node alone would not), reads see the data.
    ro = plugin.path("dev", "blk-ro")
    publish(plugin, vid, staging, ro, block_cap(), readonly=True)
    publish(plugin, vid, staging, ro, block_cap(), readonly=True)  # idempotent
    assert len(mounts.mounts_at(ro)) == 1
    with pytest.raises(OSError) as info:
        fd = os.open(ro, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x" * 4096, 0)
        finally:
            os.close(fd)
    assert info.value.errno in (errno.EROFS, errno.EPERM, errno.EACCES)
    with open(ro, "rb") as f:
        f.seek(8192)
        assert f.read(4096) == payload
    unpublish(plugin, vid, ro)
    assert run("losetup", "--associated", f"/dev/{vg.name}/{vid}").stdout.strip() == ""
    unpublish(plugin, vid, target)
    assert not os.path.exists(target)
    unstage(plugin, vid, staging)
    assert not mounts.is_mount_point(os.path.join(staging, vid))


def test_single_writer_and_multi_node_refused(plugin: PluginProcess) -> None:
    cap = mount_cap(mode=Mode.SINGLE_NODE_SINGLE_WRITER)
    vid = create(plugin, "sw", cap=cap)
    staging = plugin.path("stage-sw")
    stage(plugin, vid, staging, cap)
    publish(plugin, vid, staging, plugin.path("w1"), cap)
    expect_code(Code.FAILED_PRECONDITION, publish, plugin, vid, staging, plugin.path("w2"), cap)
    assert not mounts.is_mount_point(plugin.path("w2"))
    publish(plugin, vid, staging, plugin.path("r1"), cap, readonly=True)
    multi = mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)
    expect_code(Code.INVALID_ARGUMENT, publish, plugin, vid, staging, plugin.path("m"), multi)
    for t in ("w1", "r1"):
        unpublish(plugin, vid, plugin.path(t))
    unstage(plugin, vid, staging)


def test_volume_stats_and_condition(plugin: PluginProcess) -> None:
    vid = create(plugin, "stats")
    staging, target = plugin.path("stage-stats"), plugin.path("t-stats")
    stage(plugin, vid, staging)
    publish(plugin, vid, staging, target)
    with open(f"{target}/blob", "wb") as f:
        f.write(os.urandom(4 * MiB))
        os.fsync(f.fileno())
    st = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=target))
    by_unit = {u.unit: u for u in st.usage}
    b, i = by_unit[pb.VolumeUsage.BYTES], by_unit[pb.VolumeUsage.INODES]
    assert b.total > 24 * MiB and b.used >= 4 * MiB and b.available > 0
    assert i.total > 0 and i.used > 0
    assert st.volume_condition.abnormal is False
    expect_code(Code.NOT_FOUND, plugin.node.NodeGetVolumeStats,
                pb.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=plugin.path("other")))
    run("umount", target)  # the mount disappears behind the plugin's back
    st = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=target))
    assert st.volume_condition.abnormal and "not mounted" in st.volume_condition.message
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)


def test_concurrent_publishes_of_different_volumes(plugin: PluginProcess) -> None:
    vids = [create(plugin, f"par-{i}") for i in range(4)]
    stagings = [plugin.path(f"stage-par-{i}") for i in range(4)]
    targets = [plugin.path(f"t-par-{i}") for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: stage(plugin, vids[i], stagings[i]), range(4)))
        list(pool.map(lambda i: publish(plugin, vids[i], stagings[i], targets[i]), range(4)))
    for t in targets:
        assert mounts.is_mount_point(t)
    assert len(state(plugin)) == 4
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: unpublish(plugin, vids[i], targets[i]), range(4)))
        list(pool.map(lambda i: unstage(plugin, vids[i], stagings[i]), range(4)))
    assert state(plugin) == {}


def test_state_rebuilt_when_lost_or_corrupt(plugin: PluginProcess) -> None:
    vid = create(plugin, "rebuild")
    staging, target = plugin.path("stage-rb"), plugin.path("t-rb")
    flagged = mount_cap(flags=("noatime",))
    stage(plugin, vid, staging, flagged)
    publish(plugin, vid, staging, target, readonly=True)
    before = state(plugin)[vid]
    for damage in ("lose", "corrupt"):
        plugin.kill()
        path = plugin.state_dir / "state.json"
        if damage == "lose":
            path.unlink()
        else:
            path.write_text("{not json")
        plugin.start()
        after = state(plugin)[vid]
        assert after["staging"]["path"] == before["staging"]["path"]  # type: ignore[index]
        assert list(after["publishes"]) == [target]  # type: ignore[index]
        assert after["publishes"][target]["readonly"] is True  # type: ignore[index]
        assert "rebuilt 1 volume record" in plugin.log()
        # A repeat stage with the original flags is still idempotent.
        stage(plugin, vid, staging, flagged)
        assert len(mounts.mounts_at(staging)) == 1
    # The rebuilt state is good enough to refuse an unstage and to finish cleanly.
    expect_code(Code.FAILED_PRECONDITION, unstage, plugin, vid, staging)
    unpublish(plugin, vid, target)
    unstage(plugin, vid, staging)
    assert not mounts.is_mount_point(staging)


def test_second_process_cannot_take_the_state_dir(plugin: PluginProcess) -> None:
    import subprocess

    argv = plugin.argv()
    argv[argv.index("--endpoint") + 1] = f"unix://{plugin.workdir}/other.sock"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "in use by another process" in proc.stderr


@pytest.mark.parametrize(("fs_type", "encrypted"), [("ext4", False), ("xfs", False),
                                                    ("ext4", True)])
def test_a_volume_expanded_while_unused_grows_at_its_next_stage(
        plugin: PluginProcess, fs_type: str, encrypted: bool) -> None:
    """Nomad's `volume expand` of a volume no allocation uses calls
    ControllerExpandVolume alone, never NodeExpandVolume: the next stage
    grows the file system to its grown device (an encrypted volume's
    dm-crypt device spans its LV once opened), the data intact. It mounted
    the file system at its old size."""
    from csi_local.volumes import encryption
    params = {encryption.PARAMETER: encryption.LUKS2} if encrypted else {}
    secrets = {encryption.SECRET_KEY: "offline growth key"} if encrypted else {}
    cap = mount_cap(fs_type)
    first, grown = (320 * MiB, 512 * MiB) if fs_type == "xfs" else (64 * MiB, 256 * MiB)
    vid = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name=f"offline-{fs_type}-{encrypted}", parameters=params, volume_capabilities=[cap],
        capacity_range=pb.CapacityRange(required_bytes=first))).volume.volume_id
    staging = plugin.path(f"stage-offline-{fs_type}-{encrypted}")

    def stage_it() -> None:
        plugin.node.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id=vid, staging_target_path=staging, volume_capability=cap,
            secrets=secrets), timeout=300)

    def df() -> int:
        st = os.statvfs(staging)
        return st.f_blocks * st.f_frsize

    grown_before = plugin.log().count("growing it")  # the plugin may be a shared one
    stage_it()
    before = df()
    data = os.urandom(MiB)
    with open(f"{staging}/data", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    unstage(plugin, vid, staging)
    reply = plugin.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=grown),
        volume_capability=cap))
    assert reply.capacity_bytes == grown
    stage_it()
    after = df()
    print(f"{fs_type} encrypted={encrypted}: df total {before} -> {after} bytes "
          f"(LV {first} -> {grown})")
    assert after >= before + (grown - first) - 16 * MiB, (before, after)
    with open(f"{staging}/data", "rb") as back:
        assert back.read() == data
    assert plugin.log().count("growing it") == grown_before + 1, plugin.log()[-4000:]
    # The sizes match now: another stage grows nothing.
    unstage(plugin, vid, staging)
    stage_it()
    assert df() == after and plugin.log().count("growing it") == grown_before + 1
    unstage(plugin, vid, staging)
