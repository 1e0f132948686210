"""Offline growth: a volume extended while nothing used it (Nomad's `volume
expand` of an unused volume calls ControllerExpandVolume alone, and never
NodeExpandVolume) has its file system grown at its next stage, as kubelet's
resizefs does at mount; an encrypted one's dm-crypt device first. Measured:
no grow tool runs when the file system spans its device already. The VM test
(tests/integration/test_node.py) proves it on real file systems."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.volumes import encryption
from tests.unit.servicers import GiB, MiB, Node, call, make_node, mount_cap

KEY = "offline key"
SECRETS = {encryption.SECRET_KEY: KEY}
GROW_TOOLS = ("resize2fs", "xfs_growfs", "btrfs")


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return make_node(tmp_path, monkeypatch)


def create(n: Node, fs: str, encrypted: bool, size: int = 2 * GiB) -> str:
    code, reply = call(n.controller.CreateVolume, pb.CreateVolumeRequest(
        name=f"pvc-{fs}-{encrypted}", capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[mount_cap(fs)],
        parameters={encryption.PARAMETER: "luks2"} if encrypted else {}))
    assert code == "OK", reply
    return str(reply.volume.volume_id)


def stage(n: Node, vid: str, fs: str, secrets: dict[str, str] | None = None) -> None:
    code, msg = call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=n.path("stage"), volume_capability=mount_cap(fs),
        secrets=SECRETS if secrets is None else secrets))
    assert code == "OK", msg


def unstage(n: Node, vid: str) -> None:
    code, msg = call(n.node.NodeUnstageVolume, pb.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=n.path("stage")))
    assert code == "OK", msg


def controller_expand(n: Node, vid: str, fs: str, size: int) -> None:
    code, reply = call(n.controller.ControllerExpandVolume, pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capability=mount_cap(fs)))
    assert code == "OK" and reply.capacity_bytes == size, reply


def device(n: Node, vid: str, encrypted: bool) -> str:
    return f"/dev/mapper/{encryption.mapper_name(vid)}" if encrypted else f"/dev/vg0/{vid}"


def fs_size(n: Node, vid: str, fs: str, encrypted: bool) -> int | None:
    return n.host.filesystem_size(device(n, vid, encrypted), n.path("stage"), fs)


def grow_calls(n: Node) -> list[tuple[str, ...]]:
    return [c for c in n.host.calls if c[0] in GROW_TOOLS]


@pytest.mark.parametrize(("fs", "encrypted"), [
    ("ext4", False), ("xfs", False), ("btrfs", False), ("ext4", True), ("xfs", True)])
def test_a_volume_grown_while_unused_grows_its_file_system_at_its_next_stage(
        n: Node, fs: str, encrypted: bool) -> None:
    """It stayed its old size: the stage grew nothing without the grow-fs tag
    (volume 3 GiB, file system 2 GiB)."""
    vid = create(n, fs, encrypted)
    stage(n, vid, fs)
    lv = n.host.lv(vid)
    data = lv.content.luks.data if lv.content.luks is not None else lv.content
    uuid = data.uuid
    unstage(n, vid)
    controller_expand(n, vid, fs, 3 * GiB)
    before = len(n.host.calls)
    stage(n, vid, fs)
    dev = device(n, vid, encrypted)
    assert n.host.device_size(dev) == 3 * GiB - (16 * MiB if encrypted else 0)
    assert fs_size(n, vid, fs, encrypted) == n.host.device_size(dev)
    ran = [c[0] for c in n.host.calls[before:]]
    assert ran.index("mount") < ran.index({"ext4": "resize2fs", "xfs": "xfs_growfs",
                                           "btrfs": "btrfs"}[fs])
    assert data.uuid == uuid and data.fs == fs  # the same file system, grown
    # Its size matches now: the next stage runs no grow tool.
    unstage(n, vid)
    before = len(grow_calls(n))
    stage(n, vid, fs)
    assert len(grow_calls(n)) == before


def test_a_new_volume_runs_no_grow_tool(n: Node) -> None:
    for fs, encrypted in (("ext4", False), ("xfs", True)):
        vid = create(n, fs, encrypted)
        stage(n, vid, fs)
        unstage(n, vid)
    assert not grow_calls(n)
    assert not [c for c in n.host.commands("cryptsetup") if c[1] in ("resize", "luksDump")]


def test_an_open_dm_crypt_device_grows_to_its_lv_first(n: Node) -> None:
    """A stage that finds the volume's dm-crypt device open and mounted
    already (a retry, after its LV grew) grows the device with the stage's
    key, then the file system on it."""
    vid = create(n, "ext4", True)
    stage(n, vid, "ext4")
    controller_expand(n, vid, "ext4", 3 * GiB)
    mapper = device(n, vid, True)
    assert n.host.device_size(mapper) == 2 * GiB - 16 * MiB
    before = len(n.host.calls)
    stage(n, vid, "ext4")
    ran = [c[:2] for c in n.host.calls[before:]]
    assert ran.index(("cryptsetup", "resize")) < ran.index(("resize2fs", mapper))
    assert n.host.device_size(mapper) == 3 * GiB - 16 * MiB == fs_size(n, vid, "ext4", True)
    # Once more: the sizes match, nothing runs but the key's check against the
    # header that every reuse of an open device makes (not even luksDump).
    before = len(n.host.calls)
    stage(n, vid, "ext4")
    ran = [c for c in n.host.calls[before:] if c[0] in ("cryptsetup", *GROW_TOOLS)]
    assert [c[:3] for c in ran] == [("cryptsetup", "open", "--test-passphrase")], ran


def test_an_open_dm_crypt_device_without_a_key_is_left_as_it_is(n: Node) -> None:
    """A retry without the key is refused, as every reuse of an open device
    without it is (INVALID_ARGUMENT), and grows nothing."""
    vid = create(n, "ext4", True)
    stage(n, vid, "ext4")
    controller_expand(n, vid, "ext4", 3 * GiB)
    code, msg = call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=n.path("stage"), volume_capability=mount_cap("ext4"),
        secrets={}))
    assert code == "INVALID_ARGUMENT", msg
    assert not [c for c in n.host.commands("cryptsetup") if c[1] == "resize"]
    assert not grow_calls(n)


def test_nothing_is_grown_on_a_device_that_is_not_what_is_mounted(n: Node) -> None:
    """Something else mounted over the staging path: the step leaves it, and
    the volume's file system below, alone."""
    vid = create(n, "ext4", False)
    stage(n, vid, "ext4")
    unstage(n, vid)
    controller_expand(n, vid, "ext4", 3 * GiB)
    stage(n, vid, "ext4")
    n.host.set_content(vid, "ext4", fs_size=2 * GiB)  # as if not grown yet
    n.host.add_mount(n.path("stage"))  # a tmpfs over it
    lvm = n.backend.pools.default.lvm
    assert not n.node.volumes.steps.grow_to_device(lvm, lvm.get(vid), n.path("stage"), "ext4", None,
                                           was_open=False)
    assert len(grow_calls(n)) == 1  # the stage's own


def test_a_read_only_stage_grows_nothing(n: Node) -> None:
    """The grow tools write: a file system staged read-only is left as it is
    (it grows at its next read-write stage)."""
    vid = create(n, "ext4", False)
    stage(n, vid, "ext4")
    unstage(n, vid)
    controller_expand(n, vid, "ext4", 3 * GiB)
    code, msg = call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=n.path("stage"),
        volume_capability=mount_cap("ext4", flags=("ro",))))
    assert code == "OK", msg
    assert not grow_calls(n)
