"""The committed-metadata reader against real LVM: what it says of a thin LV
is what `lvs` says, a change made behind its back by another process is seen
at the next read, and NodeStageVolume finds its volume without an `lvs`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.host.kernel import Kernel
from csi_local.host.runner import ProcessRunner
from csi_local.storage import vg_text
from csi_local.storage.committed_vg import CommittedMetadata
from csi_local.storage.lvm import LogicalVolume, Lvm
from tests.integration.conftest import LoopVG, PluginProcess, make_vg, mount_cap, run
from tests.integration.test_node import create, stage, unstage

pytestmark = pytest.mark.integration
MiB = 1 << 20


def _comparable(lv: LogicalVolume) -> LogicalVolume:
    """What the reader vouches for: every field but the usage figures and the
    attr letters it does not know (permissions, allocation, target, zeroing,
    health), which only `lvs` reads."""
    attr = lv.attr[0] + lv.attr[4:6] + lv.attr[9:]
    return dataclasses.replace(lv, attr=attr, data_percent=None, metadata_percent=None,
                               health="", metadata_size=0)


def test_reader_agrees_with_lvs(vg: LoopVG) -> None:
    lvm = Lvm(ProcessRunner(), vg.name, vg.pool)
    run("lvcreate", "--yes", "--thin", "-V", "64M", "-n", "md-a", "--addtag", "csi-local.kind=x",
        "--addtag", "k=v/1:2#&!", f"{vg.name}/{vg.pool}")
    run("lvcreate", "--yes", "-s", "-n", "md-snap", f"{vg.name}/md-a")  # skip flag, inactive
    run("lvcreate", "--yes", "--thin", "-V", "32M", "-n", "md-off", "--activate", "n",
        f"{vg.name}/{vg.pool}")
    with open(f"/dev/{vg.name}/md-a", "rb"):  # held open: lvs says "o", so must the reader
        reader = CommittedMetadata(ProcessRunner(), Kernel())
        for name in ("md-a", "md-snap", "md-off"):
            got = reader.thin_volume(vg.name, name)
            assert got is not None, name
            assert _comparable(got) == _comparable(lvm.get(name)), name
        a = reader.thin_volume(vg.name, "md-a")
        assert a is not None and a.active and a.open
        snap = reader.thin_volume(vg.name, "md-snap")
        assert snap is not None and snap.activation_skip and not snap.active
        assert snap.origin == "md-a"
        assert reader.thin_volume(vg.name, vg.pool) is None  # not a thin volume
        assert reader.thin_volume(vg.name, "md-none") is None


def test_changes_behind_its_back_are_seen_at_once(vg: LoopVG) -> None:
    """Another process (an admin, csi-local-dhv) changes the VG: the next read
    shows it. Nothing is cached but the parse of an unchanged text."""
    reader = CommittedMetadata(ProcessRunner(), Kernel())
    run("lvcreate", "--yes", "--thin", "-V", "32M", "-n", "md-b", f"{vg.name}/{vg.pool}")
    before = reader.volume_group(vg.name)
    assert before is not None and "md-b" in before.lvs
    run("lvchange", "--addtag", "added", f"{vg.name}/md-b")
    run("lvextend", "--size", "64M", f"{vg.name}/md-b")
    b = reader.thin_volume(vg.name, "md-b")
    assert b is not None and "added" in b.tags and b.size == 64 * MiB
    run("lvcreate", "--yes", "--thin", "-V", "32M", "-n", "md-c", f"{vg.name}/{vg.pool}")
    run("lvremove", "--yes", f"{vg.name}/md-b")
    after = reader.volume_group(vg.name)
    assert after is not None and after.seqno > before.seqno
    assert "md-c" in after.lvs and "md-b" not in after.lvs


def test_a_ring_that_wraps_many_times_reads_right() -> None:
    """A small metadata area: LVM's ring wraps every few commits, and each
    committed version is read whole."""
    small = make_vg(size=256 * MiB)
    try:
        run("vgremove", "--yes", small.name)
        run("pvremove", "--yes", small.loop)
        run("pvcreate", "--yes", "--metadatasize", "64k", small.loop)
        run("vgcreate", "--yes", small.name, small.loop)
        run("lvcreate", "--yes", "--type", "thin-pool", "-L", "64M", "-n", "pool", small.name)
        run("lvcreate", "--yes", "--thin", "-V", "16M", "-n", "ring", f"{small.name}/pool")
        for i in range(30):
            run("lvchange", "--addtag", f"tag-{i:02d}-" + "x" * 200, f"{small.name}/ring")
            text = vg_text.read_committed(Kernel(), small.loop).text
            tags = vg_text.vg_metadata(text).lvs["ring"].tags
            assert len(tags) == i + 1 and any(t.startswith(f"tag-{i:02d}-") for t in tags)
    finally:
        small.destroy()


def test_report_agrees_with_lvs(vg: LoopVG) -> None:
    """The committed report says what `lvs` says of every LV's size, tags, pool
    and origin, and of the pool's size and usage (written data included)."""
    lvm = Lvm(ProcessRunner(), vg.name, vg.pool)
    run("lvcreate", "--yes", "--thin", "-V", "64M", "-n", "rp-a", "--addtag", "t=1",
        f"{vg.name}/{vg.pool}")
    run("dd", "if=/dev/urandom", f"of=/dev/{vg.name}/rp-a", "bs=1M", "count=5",
        "oflag=direct", "status=none")
    run("lvcreate", "--yes", "-s", "-n", "rp-snap", f"{vg.name}/rp-a")
    got = CommittedMetadata(ProcessRunner(), Kernel()).report(vg.name, vg.pool)
    want = lvm.report()
    assert got is not None and got.extent_size == want.extent_size
    fields = ("name", "size", "tags", "pool", "origin", "created", "thin_id", "uuid")
    assert ({tuple(getattr(lv, f) for f in fields) for lv in got.lvs}
            == {tuple(getattr(lv, f) for f in fields) for lv in want.lvs})
    pool, lvs_pool = got.find(vg.pool), want.find(vg.pool)
    assert pool is not None and lvs_pool is not None and pool.is_thin_pool
    assert (pool.size, pool.metadata_size) == (lvs_pool.size, lvs_pool.metadata_size)
    assert pool.data_percent is not None and lvs_pool.data_percent is not None
    assert pool.data_percent > 0
    assert abs(pool.data_percent - lvs_pool.data_percent) < 0.05
    assert pool.metadata_percent == pytest.approx(lvs_pool.metadata_percent, abs=0.05)
    assert sorted(lv.name for lv in got.lvs if lv.is_thin_volume) == sorted(
        lv.name for lv in want.lvs if lv.is_thin_volume)


def test_listing_agrees_with_lvs(vg: LoopVG) -> None:
    """What ListVolumes and the state's recovery read: every LV `lvs VG`
    lists, which ones are active and their devices, the pool's usage."""
    lvm = Lvm(ProcessRunner(), vg.name, vg.pool)
    run("lvcreate", "--yes", "--thin", "-V", "64M", "-n", "ls-a", "--addtag", "t=1",
        f"{vg.name}/{vg.pool}")
    run("dd", "if=/dev/urandom", f"of=/dev/{vg.name}/ls-a", "bs=1M", "count=3",
        "oflag=direct", "status=none")
    run("lvcreate", "--yes", "-s", "-n", "ls-snap", f"{vg.name}/ls-a")  # inactive
    run("lvcreate", "--yes", "--thin", "-V", "32M", "-n", "ls-off", "--activate", "n",
        f"{vg.name}/{vg.pool}")
    got = CommittedMetadata(ProcessRunner(), Kernel()).listing([vg.name])
    want = lvm.list()
    assert got is not None
    fields = ("name", "size", "tags", "pool", "origin", "created", "thin_id", "uuid",
              "active", "kernel_major", "kernel_minor", "activation_skip", "is_thin_pool",
              "is_thin_volume", "health")
    assert ({tuple(getattr(lv, f) for f in fields) for lv in got}
            == {tuple(getattr(lv, f) for f in fields) for lv in want})
    active = {lv.name for lv in got if lv.active}
    assert {"ls-a", vg.pool} <= active and not {"ls-snap", "ls-off"} & active
    pool = next(lv for lv in got if lv.name == vg.pool)
    lvs_pool = next(lv for lv in want if lv.name == vg.pool)
    assert pool.data_percent == pytest.approx(lvs_pool.data_percent, abs=0.05)
    assert pool.metadata_percent == pytest.approx(lvs_pool.metadata_percent, abs=0.05)


def test_stage_finds_its_volume_without_lvs(plugin: PluginProcess) -> None:
    """NodeStageVolume of an active volume runs no LVM command at all: the
    LV comes from the committed metadata, its emptiness from device-mapper;
    mkfs is its one process (the mount is a system call)."""
    vid = create(plugin, "md-stage")
    staging = plugin.path("s-md-stage")
    mark = len(plugin.log())
    stage(plugin, vid, staging, mount_cap("ext4"))
    tools = [c.rsplit("/", 1)[-1] for c in re.findall(r"ran (\S+)", plugin.log()[mark:])]
    # `pvs` once in a plugin's life, when it first looks for the VG's PVs.
    assert [t for t in tools if t != "pvs"] == ["mkfs.ext4"]
    unstage(plugin, vid, staging)


def _capacity(p: PluginProcess) -> int:
    return p.controller.GetCapacity(pb.GetCapacityRequest()).available_capacity


def test_changes_behind_the_plugins_back_are_seen_by_the_next_rpc(
        plugin: PluginProcess) -> None:
    """GetCapacity and CreateVolume answer from the committed metadata: an
    lvcreate, lvextend or lvremove by another process shows at the next RPC."""
    vg = plugin.vg
    before = _capacity(plugin)
    run("lvcreate", "--yes", "--thin", "-V", "64M", "-n", "behind", f"{vg.name}/{vg.pool}")
    assert _capacity(plugin) == before - 64 * MiB
    run("lvextend", "--size", "128M", f"{vg.name}/behind")
    assert _capacity(plugin) == before - 128 * MiB
    run("lvremove", "--yes", f"{vg.name}/behind")
    assert _capacity(plugin) == before
    # A volume removed behind its back is made again by a retried create.
    vid = create(plugin, "md-gone")
    run("lvremove", "--yes", f"{vg.name}/{vid}")
    assert create(plugin, "md-gone") == vid
    assert vid in vg.lv_names()


def test_list_volumes_and_probe_run_no_process_and_see_changes_behind_their_back(
        plugin: PluginProcess) -> None:
    """ListVolumes, ControllerGetVolume and Probe answer from the committed
    metadata and the kernel's device list: no process, and a volume removed
    or deactivated by another process shows at the next call."""
    vg = plugin.vg
    vids = [create(plugin, f"md-list-{i}") for i in range(2)]
    mark = len(plugin.log())

    def listed() -> dict[str, pb.ListVolumesResponse.Entry]:
        entries = plugin.controller.ListVolumes(pb.ListVolumesRequest()).entries
        return {e.volume.volume_id: e for e in entries}

    assert set(listed()) == set(vids)
    assert plugin.identity.Probe(pb.ProbeRequest()).ready.value
    got = plugin.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vids[0]))
    assert got.volume.capacity_bytes == 32 * MiB
    assert not got.status.volume_condition.abnormal
    tools = [c.rsplit("/", 1)[-1] for c in re.findall(r"ran (\S+)", plugin.log()[mark:])]
    assert [t for t in tools if t != "pvs"] == []
    run("lvchange", "--activate", "n", f"{vg.name}/{vids[0]}")
    condition = listed()[vids[0]].status.volume_condition
    assert condition.abnormal and "not active" in condition.message
    run("lvremove", "--yes", f"{vg.name}/{vids[1]}")
    assert set(listed()) == {vids[0]}


def test_two_processes_creating_at_once_never_over_commit(plugin_factory: Any) -> None:
    """Two plugin processes on one pool (their pool lock shared, as the CSI and
    host volume plugins share it), each asked at once for 60% of the pool's
    room: one volume is made, the other is RESOURCE_EXHAUSTED."""
    first: PluginProcess = plugin_factory()
    second: PluginProcess = plugin_factory("--lock-dir", str(first.workdir / "locks"))
    room = _capacity(first)
    size = (room * 6 // 10) // MiB * MiB
    reqs = [pb.CreateVolumeRequest(name=f"race-{i}", volume_capabilities=[mount_cap()],
                                   capacity_range=pb.CapacityRange(required_bytes=size))
            for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(p.controller.CreateVolume, r)
                for p, r in zip((first, second), reqs, strict=True)]
        codes, made = [], 0
        for f in futs:
            try:
                made = f.result().volume.capacity_bytes  # whole extents
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
    assert sorted(c.name for c in codes) == ["OK", "RESOURCE_EXHAUSTED"]
    assert made >= size and _capacity(first) == _capacity(second) == room - made


def test_the_vgs_size_and_free_space_agree_with_vgs() -> None:
    """The VG's size and free space as the metrics and the pool monitor read
    them off the PVs (CommittedMetadata.space) against `vgs`, after each
    change of the kinds that take or give back extents: a thin pool and its
    spare, thin volumes and snapshots (none), linear, striped, RAID1 and
    mirrored LVs, an old-style snapshot, growing and shrinking, a PV added
    and one taken away, and a pvmove."""
    run("modprobe", "-a", "dm-raid", "dm-mirror")
    vg = make_vg(size=256 * MiB, pool_percent=25)
    extra: list[tuple[str, str]] = []
    try:
        for i in range(2):  # two more PVs: striped, RAID1 and mirrors need them
            image = f"{vg.image}.{i}"
            with open(image, "wb") as f:
                f.truncate(128 * MiB)
            extra.append((run("losetup", "--find", "--show", image).stdout.strip(), image))
        lvm = Lvm(ProcessRunner(), vg.name, vg.pool)
        reader = CommittedMetadata(ProcessRunner(), Kernel())
        reader.REFRESH = 0.0  # a PV added or taken away: `pvs` again at once
        name = vg.name
        steps: list[tuple[str, ...]] = [
            ("vgextend", name, extra[0][0]),
            ("lvcreate", "--yes", "--thin", "-V", "1G", "-n", "sp-thin", f"{name}/{vg.pool}"),
            ("lvcreate", "--yes", "-s", "-n", "sp-thin-snap", f"{name}/sp-thin"),
            ("lvcreate", "--yes", "-L", "12M", "-n", "sp-linear", name),
            ("lvcreate", "--yes", "-i", "2", "-I", "64k", "-L", "16M", "-n", "sp-striped", name),
            ("lvcreate", "--yes", "--type", "raid1", "-m", "1", "-L", "8M", "-n", "sp-raid", name),
            ("lvcreate", "--yes", "--type", "mirror", "-m", "1", "--mirrorlog", "core", "-L",
             "8M", "-n", "sp-mirror", name),
            ("lvextend", "--yes", "-L", "+8M", f"{name}/sp-linear"),
            ("lvcreate", "--yes", "-s", "-L", "4M", "-n", "sp-cow", f"{name}/sp-linear"),
            ("lvreduce", "--yes", "-L", "-8M", f"{name}/sp-striped"),
            ("lvremove", "--yes", f"{name}/sp-cow", f"{name}/sp-raid", f"{name}/sp-mirror"),
            ("vgextend", name, extra[1][0]),
            ("pvmove", extra[0][0], extra[1][0]),
            ("vgreduce", name, extra[0][0]),
            ("lvremove", "--yes", f"{name}/sp-linear", f"{name}/sp-striped",
             f"{name}/sp-thin-snap"),
        ]
        answered = 0
        for step in steps:
            run(*step)
            want = lvm.volume_group()
            got = reader.space(name)
            # None would send the caller to `vgs`; any answer must be `vgs`'s.
            assert got is None or got == want, f"after {' '.join(step)}: read {got}, vgs " \
                f"says {want}"
            answered += got is not None
        assert answered == len(steps), f"{answered} of {len(steps)} answered"
    finally:
        vg.destroy()
        for loop, image in extra:
            run("pvremove", "--yes", "--force", "--force", loop, check=False)
            run("losetup", "--detach", loop, check=False)
            Path(image).unlink(missing_ok=True)
