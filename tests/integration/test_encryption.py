"""Encrypted volumes (LUKS2) through the CSI API, as the provisioner and
kubelet drive it, on real dm-crypt: no plaintext on the LV, the data back
after an unstage and a restage, a wrong key refused with the data intact,
online growth in mount and block mode, and a snapshot, restore and clone
round trip opened with the source's key."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks.lab import copy_ranges
from benchmarks.measure import rss_bytes
from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.host import crypt, mounts
from csi_local.host.kernel import Kernel
from csi_local.storage.lv_devices import thin_mapped_sectors
from csi_local.volumes import encryption
from tests.deploy._deploy import plugin_memory_limits
from tests.integration.conftest import LoopVG, PluginProcess, block_cap, expect_code, mount_cap, run
from tests.integration.dhvkit import (
    Dhv,
    dhv_fixture,  # noqa: F401 - the `dhv` fixture
    new_id,
    ok,
)
from tests.integration.test_group_snapshots import groups

pytestmark = pytest.mark.integration
MiB = 1 << 20
HEADER = 16 * MiB
Code = grpc.StatusCode
KEY = "a passphrase from a Secret\n"
SECRETS = {encryption.SECRET_KEY: KEY}
# A line no file system writes by itself, repeated over 1 MiB.
PATTERN = (b"csi-local encryption test pattern 0123456789abcdef\n" * 20560)[:MiB]


def create(p: PluginProcess, name: str, size: int = 64 * MiB,
           cap: pb.VolumeCapability | None = None,
           source: pb.VolumeContentSource | None = None) -> str:
    req = pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[cap or mount_cap()],
        parameters={encryption.PARAMETER: encryption.LUKS2})
    if source is not None:
        req.volume_content_source.CopyFrom(source)
    return p.controller.CreateVolume(req).volume.volume_id


def stage(p: PluginProcess, vid: str, path: str, cap: pb.VolumeCapability | None = None,
          secrets: dict[str, str] | None = None) -> None:
    p.node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=path, volume_capability=cap or mount_cap(),
        secrets=SECRETS if secrets is None else secrets), timeout=300)


def stage_block(p: PluginProcess, vid: str, staging: str, target: str) -> None:
    """Stage and publish `vid` as a raw block device at `target`."""
    stage(p, vid, staging, block_cap())
    p.node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=staging, target_path=target,
        volume_capability=block_cap()))


def unstage(p: PluginProcess, vid: str, path: str) -> None:
    p.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vid,
                                                         staging_target_path=path))


def expand(p: PluginProcess, vid: str, path: str, size: int) -> None:
    p.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size)))
    p.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=path, capacity_range=pb.CapacityRange(required_bytes=size),
        secrets=SECRETS), timeout=300)


def grow_online(p: PluginProcess, vid: str, staging: str, size: int) -> None:
    """Grow the staged volume to `size`: its dm-crypt device follows the LV (the
    LUKS2 header smaller) and its mounted file system grows by at least 48 MiB."""
    before = os.statvfs(staging)
    expand(p, vid, staging, size)
    assert size_of(mapper(vid)) == size - HEADER
    after = os.statvfs(staging)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 48 * MiB


def mapper(vid: str) -> str:
    return f"/dev/mapper/{encryption.mapper_name(vid)}"


def lv_holds(vg: LoopVG, vid: str, needle: bytes) -> bool:
    """Whether `needle` appears anywhere on the LV itself (read past the cache)."""
    run("sync")
    with open(f"/dev/{vg.name}/{vid}", "rb", buffering=0) as f:
        data = f.read()
    return needle in data


def size_of(path: str) -> int:
    with open(path, "rb") as f:
        return f.seek(0, os.SEEK_END)


def test_mount_volume_round_trip(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "enc-mount")
    staging = plugin.path("stage-enc")
    expect_code(Code.INVALID_ARGUMENT, stage, plugin, vid, staging, secrets={})
    stage(plugin, vid, staging)
    top = mounts.top_mount(staging)
    assert top is not None and top.source == mapper(vid) and top.fs_type == "ext4"
    assert run("cryptsetup", "isLuks", "--type", "luks2", f"/dev/{vg.name}/{vid}",
               check=False).returncode == 0
    with open(f"{staging}/data", "wb") as f:
        f.write(PATTERN)
        os.fsync(f.fileno())
    unstage(plugin, vid, staging)
    assert not os.path.exists(mapper(vid)) and mounts.top_mount(staging) is None
    # The known pattern is nowhere on the LV: only ciphertext is.
    assert not lv_holds(vg, vid, PATTERN[:4096])

    # A wrong key is refused, and nothing changes.
    err = expect_code(Code.UNAUTHENTICATED, stage, plugin, vid, staging,
                      secrets={encryption.SECRET_KEY: "not the passphrase"})
    assert "not the passphrase" not in (err.details() or "")
    assert not os.path.exists(mapper(vid)) and mounts.top_mount(staging) is None
    assert "not the passphrase" not in plugin.log() and KEY.strip() not in plugin.log()

    # Restaged with the key: the same data.
    stage(plugin, vid, staging)
    with open(f"{staging}/data", "rb") as f:
        assert f.read() == PATTERN

    # Online growth: the LV, then the dm-crypt device, then ext4.
    grow_online(plugin, vid, staging, 128 * MiB)
    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=staging))
    assert not stats.volume_condition.abnormal, stats.volume_condition.message

    # A snapshot of the mounted volume, a restore and a clone, opened with the
    # source's key (a wrong one refused), each with the data.
    snap = plugin.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="enc-snap", source_volume_id=vid)).snapshot.snapshot_id
    restored = create(plugin, "enc-restore", 128 * MiB, source=pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap)))
    clone = create(plugin, "enc-clone", 160 * MiB, source=pb.VolumeContentSource(
        volume=pb.VolumeContentSource.VolumeSource(volume_id=vid)))
    for copy in (restored, clone):
        path = plugin.path(f"stage-{copy}")
        expect_code(Code.UNAUTHENTICATED, stage, plugin, copy, path,
                    secrets={encryption.SECRET_KEY: "another"})
        stage(plugin, copy, path)
        top = mounts.top_mount(path)
        assert top is not None and top.source == mapper(copy)
        with open(f"{path}/data", "rb") as f:
            assert f.read() == PATTERN
        unstage(plugin, copy, path)
        assert not os.path.exists(mapper(copy))
    # The clone was made bigger than its source: its file system grew to it.
    unstage(plugin, vid, staging)


def test_a_new_volume_holds_a_placeholder_header_until_its_first_stage(
        plugin: PluginProcess, vg: LoopVG) -> None:
    """From CreateVolume on, an encrypted volume's LV starts with a LUKS2
    header that no key opens: a csi-local from before encryption (a
    rollback) refuses to mkfs it, where its bare LV took a plain-text file
    system (tests/integration/test_upgrades.py). Its first stage formats it
    for real, and so does a restore's of a snapshot taken before then; once
    staged it is never formatted again."""
    vid = create(plugin, "enc-placeholder")
    lv = f"/dev/{vg.name}/{vid}"
    probe = run("blkid", "-p", "-o", "export", lv).stdout
    assert "TYPE=crypto_LUKS" in probe and f"LABEL={crypt.PLACEHOLDER_LABEL}" in probe, probe
    assert run("cryptsetup", "open", "--test-passphrase", "--key-file", "-", lv,
               input=KEY, check=False).returncode == 2  # no keyslot takes the key
    snap = plugin.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="enc-placeholder-snap", source_volume_id=vid)).snapshot.snapshot_id
    restored = create(plugin, "enc-placeholder-restore", source=pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap)))
    for each in (vid, restored):
        staging = plugin.path(f"stage-{each}")
        stage(plugin, each, staging)
        with open(f"{staging}/data", "wb") as f:
            f.write(PATTERN)
            os.fsync(f.fileno())
        unstage(plugin, each, staging)
        dump = run("cryptsetup", "luksDump", f"/dev/{vg.name}/{each}").stdout
        assert crypt.PLACEHOLDER_LABEL not in dump and "argon2id" in dump, dump
        stage(plugin, each, staging)  # opened, never formatted again
        with open(f"{staging}/data", "rb") as f:
            assert f.read() == PATTERN
        unstage(plugin, each, staging)
        assert not lv_holds(vg, each, PATTERN[:4096])
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=restored))
    plugin.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))


@pytest.mark.parametrize("fs_type", ["xfs", "btrfs"])
def test_xfs_and_btrfs_on_an_encrypted_volume(plugin: PluginProcess, fs_type: str) -> None:
    """The other file systems on the dm-crypt device: made, restaged with the
    data, grown online, and a clone mounted beside its mounted source, which
    the kernel refuses for a second fs of the same id unless the clone's
    btrfs got a new one on its own dm-crypt device (xfs mounts with nouuid,
    as every xfs does: volumes/lifecycle.py)."""
    cap = mount_cap(fs_type)
    vid = create(plugin, f"enc-{fs_type}", 320 * MiB, cap=cap)
    staging = plugin.path(f"stage-{fs_type}")
    stage(plugin, vid, staging, cap)
    top = mounts.top_mount(staging)
    assert top is not None and top.fs_type == fs_type
    assert os.path.realpath(top.source) == os.path.realpath(mapper(vid))
    with open(f"{staging}/data", "wb") as out:
        out.write(PATTERN)
        os.fsync(out.fileno())
    unstage(plugin, vid, staging)
    stage(plugin, vid, staging, cap)
    with open(f"{staging}/data", "rb") as f:
        assert f.read() == PATTERN
    grow_online(plugin, vid, staging, 400 * MiB)
    clone = create(plugin, f"enc-{fs_type}-clone", 400 * MiB, cap=cap,
                   source=pb.VolumeContentSource(
                       volume=pb.VolumeContentSource.VolumeSource(volume_id=vid)))
    clone_staging = plugin.path(f"stage-{fs_type}-clone")
    stage(plugin, clone, clone_staging, cap)  # beside its source, still mounted
    with open(f"{clone_staging}/data", "rb") as f:
        assert f.read() == PATTERN

    def fs_id(path: str) -> str:
        return run("blkid", "-p", "-o", "value", "-s", "UUID", path).stdout.strip()

    top = mounts.top_mount(clone_staging)
    # btrfs names the device as its scan found it (/dev/dm-N), not by the link.
    assert top is not None and os.path.realpath(top.source) == os.path.realpath(mapper(clone))
    if fs_type == "btrfs":  # btrfstune gave the clone an identity of its own
        assert fs_id(mapper(clone)) != fs_id(mapper(vid))
    else:  # xfs keeps it (xfs_admin refuses a snapshot's dirty log): nouuid
        assert fs_id(mapper(clone)) == fs_id(mapper(vid))
        assert "nouuid" in top.super_options | top.options, top
    unstage(plugin, clone, clone_staging)
    unstage(plugin, vid, staging)
    assert not os.path.exists(mapper(clone)) and not os.path.exists(mapper(vid))


def test_block_volume_round_trip(plugin: PluginProcess, vg: LoopVG) -> None:
    vid = create(plugin, "enc-block", cap=block_cap())
    staging, target = plugin.path("stage-blk"), plugin.path("pod", "blk")
    stage_block(plugin, vid, staging, target)
    assert size_of(target) == 64 * MiB - HEADER
    with open(target, "r+b", buffering=0) as f:
        f.write(PATTERN)
        os.fsync(f.fileno())
    assert not lv_holds(vg, vid, PATTERN[:4096])
    expand(plugin, vid, staging, 96 * MiB)
    assert size_of(target) == 96 * MiB - HEADER
    with open(target, "rb") as f:
        assert f.read(len(PATTERN)) == PATTERN
    plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vid,
                                                                  target_path=target))
    unstage(plugin, vid, staging)
    assert not os.path.exists(mapper(vid))
    # Handed out raw: a stage as a file system refuses to format it.
    expect_code(Code.FAILED_PRECONDITION, stage, plugin, vid, plugin.path("stage-fs"))
    assert not os.path.exists(mapper(vid))


def kill_tree(plugin: PluginProcess) -> None:
    """SIGKILL the plugin and every process it started (cryptsetup, mkfs), as
    the end of its container does."""
    assert plugin.proc is not None
    kill_commands(plugin.proc.pid)
    plugin.kill()


def children(parent: int) -> set[int]:
    """The processes `parent` started (each in a process group of its own)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.add(int(entry))
    return found


def kill_commands(parent: int) -> None:
    """SIGKILL every process `parent` started, each in its process group."""
    for pid in children(parent):
        try:
            os.killpg(pid, signal.SIGKILL)  # each command runs in a group of its own
        except ProcessLookupError:
            pass


def kill_a_stage_after(plugin: PluginProcess, vid: str, staging: str,
                       after: str) -> pb.NodeStageVolumeRequest:
    """Stage `vid` and kill the plugin (and what it started) once the command
    `after` names has run; start it again. Returns the stage's request."""
    req = pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=staging,
                                    volume_capability=mount_cap(), secrets=SECRETS)
    mark = len(plugin.log())
    fut = plugin.node.NodeStageVolume.future(req, timeout=300)
    deadline = time.monotonic() + 240
    while f"{after} " not in plugin.log()[mark:] or "ran " not in plugin.log()[mark:]:
        assert time.monotonic() < deadline and not fut.done(), plugin.log()[mark:]
        time.sleep(0.02)
    kill_tree(plugin)
    try:
        fut.result()
    except grpc.RpcError:
        pass
    plugin.start()
    return req


# The step a kill lands in: after the command the log names has run, the
# stage's next one is running (isLuks: luksFormat; luksFormat: open; open: mkfs).
@pytest.mark.parametrize("after", ["cryptsetup isLuks", "cryptsetup luksFormat",
                                   "cryptsetup open"])
def test_kill_during_an_encrypted_stage_then_retry_converges(
        plugin: PluginProcess, vg: LoopVG, after: str) -> None:
    vid = create(plugin, f"enc-kill-{after.split()[1].lower()}")
    staging = plugin.path("stage-kill")
    req = kill_a_stage_after(plugin, vid, staging, after)
    plugin.node.NodeStageVolume(req, timeout=300)
    top = mounts.top_mount(staging)
    assert top is not None and top.source == mapper(vid) and top.fs_type == "ext4"
    with open(f"{staging}/data", "wb") as f:
        f.write(PATTERN)
    unstage(plugin, vid, staging)
    assert not os.path.exists(mapper(vid))
    stage(plugin, vid, staging)  # opened, never formatted again: the data is there
    with open(f"{staging}/data", "rb") as f:
        assert f.read() == PATTERN
    unstage(plugin, vid, staging)
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert vid not in vg.lv_names()
    assert not [d for d in os.listdir("/dev/mapper") if d.startswith(encryption.MAPPER_PREFIX)]


def test_a_wrong_key_is_refused_while_the_device_is_open(plugin: PluginProcess) -> None:
    """An open dm-crypt device says nothing of the key a stage brings: a stage
    killed right after `cryptsetup open`, then retried with a wrong key,
    mounted the volume (no cryptsetup ran), and a repeated stage of a staged
    volume with a wrong key answered OK. Both are refused now, as a first
    open is, and the right key still stages it."""
    wrong = {encryption.SECRET_KEY: "not the passphrase"}
    vid = create(plugin, "enc-open-key")
    staging = plugin.path("stage-open-key")
    kill_a_stage_after(plugin, vid, staging, "cryptsetup open")
    assert os.path.exists(mapper(vid)), "the killed stage's dm-crypt device is gone"
    mark = len(plugin.log())
    expect_code(Code.UNAUTHENTICATED, stage, plugin, vid, staging, secrets=wrong)
    assert mounts.top_mount(staging) is None
    assert "--test-passphrase" in plugin.log()[mark:]
    stage(plugin, vid, staging)
    top = mounts.top_mount(staging)
    assert top is not None and top.source == mapper(vid)
    with open(f"{staging}/data", "wb") as f:
        f.write(PATTERN)
    # Staged: the same stage again with a wrong key is refused, and changes nothing.
    expect_code(Code.UNAUTHENTICATED, stage, plugin, vid, staging, secrets=wrong)
    top = mounts.top_mount(staging)
    assert top is not None and top.source == mapper(vid)
    stage(plugin, vid, staging)
    with open(f"{staging}/data", "rb") as f:
        assert f.read() == PATTERN
    assert "not the passphrase" not in plugin.log()
    unstage(plugin, vid, staging)
    assert not os.path.exists(mapper(vid))


@pytest.mark.report
def test_fstrim_gives_an_encrypted_volume_s_freed_blocks_back_to_the_pool(
        plugin: PluginProcess, vg: LoopVG) -> None:
    """dm-crypt drops discards unless opened with --allow-discards: fstrim on
    an encrypted volume said "the discard operation is not supported" and
    the thin LV kept every block it ever mapped. The plugin's open allows
    them and stores the flag in the LUKS2 header; a file written, deleted
    and trimmed gives its blocks back (the thin device's own mapped count)."""
    vid = create(plugin, "enc-trim", 96 * MiB)
    staging = plugin.path("stage-trim")
    stage(plugin, vid, staging)
    table = run("dmsetup", "table", encryption.mapper_name(vid)).stdout
    assert "allow_discards" in table, table
    dump = run("cryptsetup", "luksDump", f"/dev/{vg.name}/{vid}").stdout
    flags = next(line for line in dump.splitlines() if line.startswith("Flags:"))
    assert "allow-discards" in flags, dump

    def mapped() -> int:
        run("sync")
        sectors = thin_mapped_sectors(Kernel(), vg.name, vid)
        assert sectors is not None
        return sectors * 512

    with open(f"{staging}/filler", "wb") as f:
        for _ in range(48):
            f.write(PATTERN)
        os.fsync(f.fileno())
    full = mapped()
    os.unlink(f"{staging}/filler")
    run("sync")  # ext4 hands freed blocks to fstrim once the deletion is committed
    trim = run("fstrim", "-v", staging, check=False)
    assert trim.returncode == 0, trim.stderr
    after = mapped()
    print(f"thin LV mapped: {full / MiB:.1f} MiB with the file, {after / MiB:.1f} MiB after "
          f"rm and fstrim ({trim.stdout.strip()})")
    assert after < full - 40 * MiB
    # The header keeps the flag: the next open allows discards without
    # rewriting it (cryptsetup rewrites the header at every --persistent open).
    unstage(plugin, vid, staging)
    mark = len(plugin.log())
    stage(plugin, vid, staging)
    opens = [line for line in plugin.log()[mark:].splitlines()
             if "cryptsetup open --type" in line]
    assert opens and all("--allow-discards" in line and "--persistent" not in line
                         for line in opens), opens
    assert "allow_discards" in run("dmsetup", "table", encryption.mapper_name(vid)).stdout
    unstage(plugin, vid, staging)


def node_expand(p: PluginProcess, vid: str, path: str, size: int,
                secrets: dict[str, str] | None = None) -> None:
    p.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size)))
    p.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=path, capacity_range=pb.CapacityRange(required_bytes=size),
        secrets=secrets or {}), timeout=300)


def key_location(vid: str) -> str:
    """Where the open dm-crypt device's volume key is: "keyring" or "dm-crypt"."""
    out = run("cryptsetup", "status", encryption.mapper_name(vid)).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                if line.strip().startswith("key location:"))


def test_node_expand_without_secrets_grows_an_open_encrypted_volume(
        plugin: PluginProcess, vg: LoopVG) -> None:
    """Nomad's NodeExpandVolume carries no secrets: it was refused with
    INVALID_ARGUMENT, so an encrypted volume never grew online under Nomad.
    The plugin opens the device with its volume key in the dm-crypt table,
    where `cryptsetup resize` finds it without a passphrase. A device opened
    with its key in the kernel's keyring (by hand, or an older version)
    still needs the key: refused without it, grown with it."""
    vid = create(plugin, "enc-grow-nokey")
    staging = plugin.path("stage-grow-nokey")
    stage(plugin, vid, staging)
    assert key_location(vid) == "dm-crypt"
    before = os.statvfs(staging)
    node_expand(plugin, vid, staging, 128 * MiB)
    assert size_of(mapper(vid)) == 128 * MiB - HEADER
    after = os.statvfs(staging)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 48 * MiB
    unstage(plugin, vid, staging)
    # Opened by hand, LUKS2's default: the volume key in the kernel's keyring.
    run("cryptsetup", "open", "--type", "luks2", "--key-file", "-", f"/dev/{vg.name}/{vid}",
        encryption.mapper_name(vid), input=KEY)
    assert key_location(vid) == "keyring"
    stage(plugin, vid, staging)  # the open device, reused with its key
    err = expect_code(Code.INVALID_ARGUMENT, node_expand, plugin, vid, staging, 160 * MiB)
    assert "keyring" in (err.details() or "")
    assert size_of(mapper(vid)) == 128 * MiB - HEADER
    node_expand(plugin, vid, staging, 160 * MiB, SECRETS)
    assert size_of(mapper(vid)) == 160 * MiB - HEADER
    unstage(plugin, vid, staging)
    assert not os.path.exists(mapper(vid))


def class_key(dhv: Dhv) -> None:
    """The host volume plugin's configuration names a key file for the
    default class."""
    key = dhv.workdir / "class.key"
    key.write_text("a host volume's passphrase")
    key.chmod(0o600)
    config = dhv.plugin_dir / "csi-local-dhv.json"
    data = json.loads(config.read_text())
    data["encryption_key_files"] = {"class:default": str(key)}
    config.write_text(json.dumps(data))


def test_host_volume_create_grow_delete(dhv: Dhv, vg: LoopVG) -> None:
    class_key(dhv)
    vid = new_id()
    params = {encryption.PARAMETER: encryption.LUKS2}
    made = ok(dhv.call("create", vid, cap_min=64 * MiB, params=params))
    path = made["path"]
    lv = dhv.lv(vid)
    assert lv is not None and "csi-local-dhv.encryption=luks2" in lv.tags
    crypt = mapper(lv.name)
    top = mounts.top_mount(path)
    assert top is not None and top.source == crypt
    with open(f"{path}/data", "wb") as f:
        f.write(PATTERN)
        os.fsync(f.fileno())
    assert not lv_holds(vg, lv.name, PATTERN[:4096])
    before = os.statvfs(path)
    grown = ok(dhv.call("create", vid, cap_min=160 * MiB, params=params))
    assert grown["bytes"] >= 160 * MiB and size_of(crypt) == grown["bytes"] - HEADER
    after = os.statvfs(path)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 64 * MiB
    with open(f"{path}/data", "rb") as f:
        assert f.read() == PATTERN
    ok(dhv.call("delete", vid))
    assert dhv.lv(vid) is None and not os.path.exists(crypt)
    assert not os.path.exists(path)


def test_host_volume_clone_larger_than_its_encrypted_source(dhv: Dhv, vg: LoopVG) -> None:
    """A clone of an encrypted host volume, larger than its source, through
    the executable: the new clone's dm-crypt device grows to its LV and its
    file system to the device. It failed ("... is open, but not over volume
    ..."), and left its LV and open dm-crypt device behind."""
    class_key(dhv)
    src, clone = new_id(), new_id()
    params = {encryption.PARAMETER: encryption.LUKS2}
    made = ok(dhv.call("create", src, cap_min=64 * MiB, params=params))
    with open(f"{made['path']}/data", "wb") as f:
        f.write(PATTERN)
        os.fsync(f.fileno())
    before = os.statvfs(made["path"])
    result = dhv.call("create", clone, cap_min=160 * MiB, params={"source_volume": src})
    big = ok(result)
    lv = dhv.lv(clone)
    assert lv is not None and big["bytes"] == lv.size == 160 * MiB
    crypt = mapper(lv.name)
    assert size_of(crypt) == 160 * MiB - HEADER
    top = mounts.top_mount(big["path"])
    assert top is not None and top.source == crypt
    after = os.statvfs(big["path"])
    print(f"clone: LV {lv.size}, dm-crypt {size_of(crypt)}, df total "
          f"{before.f_blocks * before.f_frsize} -> {after.f_blocks * after.f_frsize}")
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 64 * MiB
    with open(f"{big['path']}/data", "rb") as back:
        assert back.read() == PATTERN
    for vid in (clone, src):
        ok(dhv.call("delete", vid))
        assert dhv.lv(vid) is None and not os.path.exists(dhv.path(vid))
    assert not [d for d in os.listdir("/dev/mapper") if d.startswith(encryption.MAPPER_PREFIX)]


def test_changed_block_ranges_restore_an_encrypted_volume(plugin: PluginProcess,
                                                          vg: LoopVG) -> None:
    """The ranges GetMetadataDelta gives are the LV's, ciphertext: copied from
    the target snapshot's LV onto a restore of the base, they make the target,
    which then opens with the volume's key and reads as the target's data."""
    vid = create(plugin, "enc-cbt", cap=block_cap())
    staging, dev = plugin.path("stage-cbt"), plugin.path("pod", "cbt")
    stage_block(plugin, vid, staging, dev)

    def write(offset: int, seed: int) -> None:
        with open(dev, "r+b", buffering=0) as f:
            f.seek(offset)
            f.write(bytes((seed + i) % 251 + 1 for i in range(256 * 1024)))
            os.fsync(f.fileno())

    def snapshot(name: str) -> str:
        time.sleep(1.1)  # LVM's creation times are in seconds: base strictly older
        return str(plugin.controller.CreateSnapshot(pb.CreateSnapshotRequest(
            name=name, source_volume_id=vid)).snapshot.snapshot_id)

    write(0, 1)
    write(8 * MiB, 2)
    base = snapshot("enc-cbt-1")
    write(8 * MiB, 3)  # overwritten
    write(20 * MiB, 4)  # new
    target = snapshot("enc-cbt-2")
    with open(dev, "rb") as f:
        expected = f.read()
    assert plugin.channel is not None
    sm = csi_pb2_grpc.SnapshotMetadataStub(plugin.channel)
    ranges = [(b.byte_offset, b.size_bytes) for r in sm.GetMetadataDelta(
        pb.GetMetadataDeltaRequest(base_snapshot_id=base, target_snapshot_id=target),
        timeout=300) for b in r.block_metadata]
    # LV offsets: the data area starts past the 16 MiB header.
    assert ranges and all(off >= HEADER for off, _ in ranges)
    # A restore of the base, plus the delta's ranges read off the target's LV.
    restored = create(plugin, "enc-cbt-restore", cap=block_cap(), source=pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=base)))
    run("lvchange", "--activate", "y", "--ignoreactivationskip", f"{vg.name}/{target}")
    run("lvchange", "--activate", "y", "--ignoreactivationskip", f"{vg.name}/{restored}")
    copy_ranges(f"/dev/{vg.name}/{target}", f"/dev/{vg.name}/{restored}", ranges)
    run("lvchange", "--activate", "n", f"{vg.name}/{target}")
    r_staging, r_dev = plugin.path("stage-cbt-r"), plugin.path("pod", "cbt-r")
    stage_block(plugin, restored, r_staging, r_dev)
    with open(r_dev, "rb") as f:
        assert f.read() == expected, "the restored backup is not the target's data"
    for v, st, t in ((vid, staging, dev), (restored, r_staging, r_dev)):
        plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=v,
                                                                      target_path=t))
        unstage(plugin, v, st)


def test_group_snapshot_of_mounted_encrypted_volumes_on_this_kernel(
        plugin: PluginProcess) -> None:
    """Debian 12's kernel refuses LVM's snapshot of a thin LV whose own file
    system is frozen (test_group_refusal.py: plain mounted volumes are refused
    together). An encrypted volume's file system is one device higher, on
    dm-crypt: frozen there, its LV is snapshotted, and the group is taken."""
    members = []
    for name in ("enc-g1", "enc-g2"):
        vid = create(plugin, name)
        staging = plugin.path(f"stage-{name}")
        stage(plugin, vid, staging)
        with open(f"{staging}/data", "wb") as f:
            f.write(name.encode() * 1000)
        members.append((vid, staging))
    group = groups(plugin).CreateVolumeGroupSnapshot(pb.CreateVolumeGroupSnapshotRequest(
        name="enc-group", source_volume_ids=[v for v, _ in members]),
        timeout=600).group_snapshot
    by_source = {s.source_volume_id: s.snapshot_id for s in group.snapshots}
    for (vid, staging), name in zip(members, ("enc-g1", "enc-g2"), strict=True):
        copy = create(plugin, f"{name}-restore", source=pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=by_source[vid])))
        path = plugin.path(f"stage-{name}-restore")
        stage(plugin, copy, path)
        with open(f"{path}/data", "rb") as f:
            assert f.read() == name.encode() * 1000
        unstage(plugin, copy, path)
        unstage(plugin, vid, staging)


# --- memory -------------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _memory_cgroup() -> Path:
    """A cgroup v2 of this test's own under the root, with the memory
    controller (memory.peak: kernel 5.19 or later)."""
    control = CGROUP_ROOT / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        control.write_text("+memory")
    path = CGROUP_ROOT / f"csi-local-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def _remove_cgroup(path: Path) -> None:
    """Remove the test's cgroup once empty; whatever is left in it (a child
    of the stopped plugin) was started by this test: cgroup.kill ends it."""
    if "populated 1" in (path / "cgroup.events").read_text():
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 30
    while "populated 1" in (path / "cgroup.events").read_text():
        assert time.monotonic() < deadline, (path / "cgroup.procs").read_text()
        time.sleep(0.1)
    path.rmdir()


def _sample_peaks(cgroup: Path, done: threading.Event, peaks: dict[int, tuple[str, int]],
                  ) -> None:
    """Every process in `cgroup`: its command and peak RSS (VmHWM), sampled
    every 50 ms until `done`. A cryptsetup is caught: its argon2id holds its
    64 MiB for the whole derivation (--iter-time 1000: a second or more), and
    VmHWM keeps the peak until the process exits."""
    while not done.is_set():
        for pid in map(int, (cgroup / "cgroup.procs").read_text().split()):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                hwm = rss_bytes(pid, "VmHWM")
            except (OSError, RuntimeError):
                continue  # exited meanwhile (a zombie has no VmHWM)
            peaks[pid] = (comm, max(hwm, peaks.get(pid, ("", 0))[1]))
        done.wait(0.05)


@pytest.mark.report
def test_an_encrypted_stage_fits_the_shipped_memory_limits(plugin_factory: Any) -> None:
    """The plugin at its peak: staging an encrypted volume (luksFormat, then
    open: cryptsetup's argon2id at 64 MiB each, one after the other, then
    mkfs), the plugin started in a memory cgroup of its own as its container
    is. Two measures, both under the memory limit of every shipped plugin that
    stages (the Nomad job's, node.yaml's: the kernel kills a container past
    it): the cgroup's memory.peak, all it charged since the plugin's start as
    a container's limit counts it (its processes' memory, their kernel memory
    and the page cache they brought in); and the peak RSS of the processes
    that run throughout the stage (the plugin, its lvm shell) added to the
    largest peak of the commands it ran meanwhile, sampled."""
    limits = plugin_memory_limits()
    cgroup = _memory_cgroup()
    p: PluginProcess = plugin_factory(start=False)
    p.cgroup = cgroup
    try:
        p.start()
        idle = rss_bytes(p.pid)
        vid = create(p, "enc-memory")
        # What runs when the stage starts runs throughout it: the plugin, and
        # its lvm shell (started in the background once the plugin serves:
        # by now the create has used it).
        resident = set(map(int, (cgroup / "cgroup.procs").read_text().split()))
        staging = p.path("stage-memory")
        peaks: dict[int, tuple[str, int]] = {}
        done = threading.Event()
        sampler = threading.Thread(target=_sample_peaks, args=(cgroup, done, peaks))
        sampler.start()
        try:
            stage(p, vid, staging)
        finally:
            done.set()
            sampler.join()
        cgroup_peak = int((cgroup / "memory.peak").read_text())
        plugin_peak = rss_bytes(p.pid, "VmHWM")
        unstage(p, vid, staging)
    finally:
        p.stop()
        _remove_cgroup(cgroup)
    peaks[p.pid] = ("csi-local", plugin_peak)
    commands = {pid: v for pid, v in peaks.items() if pid not in resident}
    crypt = max((v for v in commands.values() if v[0] == "cryptsetup"), key=lambda v: v[1],
                default=None)
    assert crypt is not None, f"no cryptsetup sampled: {sorted(peaks.values())}"
    largest = max(commands.values(), key=lambda v: v[1])
    rss_peak = sum(h for pid, (_, h) in peaks.items() if pid in resident) + largest[1]
    mib = 1 << 20
    print(f"plugin RSS idle {idle / mib:.1f} MiB, peak {plugin_peak / mib:.1f} MiB; "
          f"cryptsetup peak {crypt[1] / mib:.1f} MiB; largest command {largest[0]} "
          f"{largest[1] / mib:.1f} MiB; resident processes + largest command "
          f"{rss_peak / mib:.1f} MiB; cgroup memory.peak {cgroup_peak / mib:.1f} MiB; "
          "limits " + ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in limits.items()))
    # argon2id's 64 MiB is in cryptsetup's peak: the sampler saw the real one
    assert crypt[1] > 64 * mib
    for where, limit in limits.items():
        assert max(cgroup_peak, rss_peak) < limit, where


@pytest.mark.report
def test_four_encrypted_stages_at_once_fit_the_smallest_shipped_limit(
        plugin_factory: Any) -> None:
    """Four encrypted stages at once, the plugin in a memory cgroup limited
    as the smallest shipped limit limits its container: before the bound on
    key derivations (host/derivations.py), each stage ran its own argon2id
    at 64 MiB and three of four were OOM-killed in 256 MiB (issue 42). Now
    every stage succeeds, the kernel killed nothing (memory.events), and the
    cgroup's peak stays under the limit."""
    limit = min(plugin_memory_limits().values())
    cgroup = _memory_cgroup()
    (cgroup / "memory.max").write_text(str(limit))
    if (cgroup / "memory.swap.max").exists():
        (cgroup / "memory.swap.max").write_text("0")  # no swap to hide a peak in
    p: PluginProcess = plugin_factory(start=False)
    p.cgroup = cgroup
    errors: list[BaseException] = []
    try:
        p.start()
        vids = [create(p, f"enc-at-once-{i}") for i in range(4)]
        paths = [p.path(f"stage-at-once-{i}") for i in range(4)]

        def one(vid: str, path: str) -> None:
            try:
                stage(p, vid, path)
            except BaseException as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=one, args=pair)
                   for pair in zip(vids, paths, strict=True)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - started
        events = dict(line.split() for line in (cgroup / "memory.events").read_text()
                      .splitlines())
        peak = int((cgroup / "memory.peak").read_text())
        for vid, path in zip(vids, paths, strict=True):
            with contextlib.suppress(grpc.RpcError):  # one that failed has nothing staged
                unstage(p, vid, path)
    finally:
        p.stop()
        _remove_cgroup(cgroup)
    mib = 1 << 20
    print(f"four encrypted stages at once in {limit / mib:.0f} MiB: {took:.1f} s, "
          f"memory.peak {peak / mib:.1f} MiB, oom_kill {events.get('oom_kill')}, "
          f"errors {len(errors)}")
    assert not errors, errors
    assert events.get("oom_kill") == "0", events
    assert peak < limit


@pytest.mark.parametrize("chunk", ["64k", "192k", "1m", "32m"])
def test_the_smallest_encrypted_volumes_stage_on_pools_of_any_chunk_size(
        plugin_factory: Any, chunk: str) -> None:
    """An encrypted ext4 volume asked for 1 MiB got 16 MiB, exactly its LUKS2
    header, and its first stage failed ("Requested offset is beyond real
    size of device"). The smallest encrypted ext4 and xfs volumes stage and
    mount on pools of 64 KiB, 192 KiB, 1 MiB and 32 MiB chunks, and are the
    size the plugin computed: the file system's minimum plus the data offset
    cryptsetup chose, the 16 MiB header aligned to the pool's chunk size
    (the thin volume's optimal I/O size)."""
    from csi_local.host import filesystem_rules as fsrules
    from csi_local.host.crypt import data_offset_for
    from tests.integration.conftest import make_vg
    chunk_bytes = int(chunk[:-1]) << {"k": 10, "m": 20}[chunk[-1]]
    small = make_vg(size=1 << 30, chunk_size=chunk)
    try:
        p = plugin_factory(target_vg=small)
        for fs_type in ("ext4", "xfs"):
            cap = mount_cap(fs_type)
            vid = p.controller.CreateVolume(pb.CreateVolumeRequest(
                name=f"tiny-{fs_type}", capacity_range=pb.CapacityRange(required_bytes=MiB),
                volume_capabilities=[cap],
                parameters={encryption.PARAMETER: encryption.LUKS2})).volume.volume_id
            lv = f"/dev/{small.name}/{vid}"
            size = size_of(lv)
            offset = data_offset_for(chunk_bytes)
            extent = 4 * MiB
            assert size == -(-(fsrules.min_size(fs_type) + offset) // extent) * extent
            staging = p.path(f"stage-tiny-{fs_type}")
            stage(p, vid, staging, cap)
            top = mounts.top_mount(staging)
            assert top is not None and top.fs_type == fs_type
            dump = json.loads(run("cryptsetup", "luksDump", "--dump-json-metadata",
                                  lv).stdout)
            real = int(dump["segments"]["0"]["offset"])
            numbers = os.stat(lv).st_rdev
            queue = f"/sys/dev/block/{os.major(numbers)}:{os.minor(numbers)}/queue"
            io = {name: Path(f"{queue}/{name}").read_text().strip()
                  for name in ("minimum_io_size", "optimal_io_size")}
            print(f"chunk {chunk} {fs_type}: LV {size} bytes, data offset {real} "
                  f"(computed {offset}), dm-crypt {size_of(mapper(vid))} bytes, queue {io}")
            assert real == offset
            assert size_of(mapper(vid)) == size - offset
            with open(f"{staging}/data", "wb") as f:
                f.write(PATTERN[:64 << 10])
                os.fsync(f.fileno())
            unstage(p, vid, staging)
            p.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    finally:
        small.destroy()
