"""The committed-metadata reader against real LVM: what it says of a thin LV
is what `lvs` says, a change made behind its back by another process is seen
at the next read, and NodeStageVolume finds its volume without an `lvs`."""

from __future__ import annotations

import dataclasses
import re

import pytest

from csi_local import lvm_metadata
from csi_local.lvm import CommittedMetadata, LogicalVolume, Lvm
from csi_local.runner import ShRunner
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
    lvm = Lvm(ShRunner(), vg.name, vg.pool)
    run("lvcreate", "--yes", "--thin", "-V", "64M", "-n", "md-a", "--addtag", "csi-local.kind=x",
        "--addtag", "k=v/1:2#&!", f"{vg.name}/{vg.pool}")
    run("lvcreate", "--yes", "-s", "-n", "md-snap", f"{vg.name}/md-a")  # skip flag, inactive
    run("lvcreate", "--yes", "--thin", "-V", "32M", "-n", "md-off", "--activate", "n",
        f"{vg.name}/{vg.pool}")
    with open(f"/dev/{vg.name}/md-a", "rb"):  # held open: lvs says "o", so must the reader
        reader = CommittedMetadata(ShRunner())
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
    reader = CommittedMetadata(ShRunner())
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
            text = lvm_metadata.read_committed(small.loop).text
            tags = lvm_metadata.vg_metadata(text).lvs["ring"].tags
            assert len(tags) == i + 1 and any(t.startswith(f"tag-{i:02d}-") for t in tags)
    finally:
        small.destroy()


def test_stage_finds_its_volume_without_lvs(plugin: PluginProcess) -> None:
    """NodeStageVolume of an active volume runs no LVM command at all: the
    LV comes from the committed metadata, its emptiness from device-mapper."""
    vid = create(plugin, "md-stage")
    staging = plugin.path("s-md-stage")
    mark = len(plugin.log())
    stage(plugin, vid, staging, mount_cap("ext4"))
    tools = [c.rsplit("/", 1)[-1] for c in re.findall(r"ran (\S+)", plugin.log()[mark:])]
    # `pvs` once in a plugin's life, when it first looks for the VG's PVs.
    assert [t for t in tools if t != "pvs"] == ["mkfs.ext4", "mount"]
    unstage(plugin, vid, staging)
