"""The state file reconciled with LVM and the mount table at start
(nodestate.recovery.reconcile_state), on a FakeHost with many volumes: only
the records' LVs are read (a node has thousands, its state file names a
few), and each record is kept, trimmed or dropped as the mount table says.
Before: every volume of every class was listed to check them."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.nodestate.recovery import reconcile_state
from csi_local.storage import vg_text
from csi_local.volumes import naming
from csi_local.volumes.node_records import AccessType, Staging, VolumeRecord
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

KIND_V = f"{naming.TAG_KIND}={naming.KIND_VOLUME}"
FILLERS = 200  # volumes no record names: none of them may be read


def _fill(n: Node, count: int = FILLERS, vg: str | None = None) -> None:
    for i in range(count):
        n.host.add_lv(vol_id(f"filler-{i}"), 16 * MiB, tags=[KIND_V], vg=vg)


def _stage(n: Node, vid: str, *targets: str) -> None:
    """`vid` staged at <root>/s-<vid> and published at each of `targets`."""
    staging = n.path(f"s-{vid}")
    code, answer = call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=staging, volume_capability=mount_cap()))
    assert code == "OK", answer
    for t in targets:
        code, answer = call(n.node.NodePublishVolume, pb.NodePublishVolumeRequest(
            volume_id=vid, staging_target_path=staging, target_path=n.path(t),
            volume_capability=mount_cap()))
        assert code == "OK", answer


def _new(n: Node, name: str, vg: str | None = None) -> str:
    vid = vol_id(name)
    n.host.add_lv(vid, GiB, tags=[KIND_V, f"{naming.TAG_SIZE}={GiB}"], fs="ext4", vg=vg)
    return vid


def _umount(n: Node, path: str) -> None:
    n.host.run(["umount", path])


def _selected(argv: tuple[str, ...]) -> set[str]:
    """The LV names an `lvs --select 'lv_name="a" || ...'` asks for (empty: a
    listing of everything)."""
    if "--select" not in argv:
        return set()
    expr = argv[argv.index("--select") + 1]
    return {part.strip().removeprefix('lv_name="').removesuffix('"')
            for part in expr.split("||")}


def _lvs_reads(n: Node) -> list[set[str]]:
    """What each `lvs` since the last clear asked for (an empty set: every LV)."""
    out = []
    for argv in n.host.commands("lvs"):
        names = _selected(argv)
        targets = {a.split("/", 1)[1] for a in argv  # `lvs VG/LV`
                   if "/" in a and "=" not in a and not a.startswith("-")}
        out.append(names | targets)
    return out


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    return make_node(tmp_path, monkeypatch)


def test_no_records_read_nothing(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without records there is nothing to check: no command, not even the mount table."""
    _fill(node)
    node.host.calls.clear()
    monkeypatch.setattr(node.host, "mounts", lambda: pytest.fail("mount table read"))
    assert reconcile_state(node.backend.pools, node.host, {}) == {}
    assert node.host.calls == []


@pytest.mark.usefixtures("reads")
def test_only_the_records_lvs_are_read_and_each_is_kept_trimmed_or_dropped(
        node: Node) -> None:
    _fill(node)
    whole, unstaged, unpublished, removed, inactive = (
        _new(node, name) for name in ("whole", "unstaged", "unpublished", "removed", "inactive"))
    _stage(node, whole, "t-whole")
    _stage(node, unstaged)
    _stage(node, unpublished, "t-unpublished-1", "t-unpublished-2")
    _stage(node, removed)
    _stage(node, inactive)
    records = node.state.all()
    # A reboot, or an operator, behind the plugin's back:
    _umount(node, node.path(f"s-{unstaged}"))
    _umount(node, node.path("t-unpublished-2"))
    for vid in (removed, inactive):
        _umount(node, node.path(f"s-{vid}"))
    node.host.run(["lvremove", "--yes", f"vg0/{removed}"])
    node.host.run(["lvchange", "--activate", "n", f"vg0/{inactive}"])
    # A record of a name that is no volume ID (a file edited by hand): never looked up.
    records["data"] = VolumeRecord("data", Staging(node.path("s-data"), AccessType.MOUNT))
    node.host.calls.clear()

    kept = reconcile_state(node.backend.pools, node.host, records)

    assert kept == {
        whole: records[whole],
        unpublished: dataclasses.replace(records[unpublished], publishes={
            node.path("t-unpublished-1"): records[unpublished].publishes[
                node.path("t-unpublished-1")]}),
    }
    # One `lvs`, of the records' volumes only: none of the fillers; where the
    # committed metadata answers, of those it has no LV for (LVM has the last
    # word on absence).
    if node.host.pv_metadata:
        assert _lvs_reads(node) == [{removed}]
    else:
        assert _lvs_reads(node) == [{whole, unstaged, unpublished, removed, inactive}]
    assert [c[0] for c in node.host.calls] == ["lvs"]


@pytest.mark.usefixtures("reads")
def test_one_record_is_one_lookup_of_that_lv(node: Node) -> None:
    _fill(node)
    vid = _new(node, "only")
    _stage(node, vid, "t-only")
    records = node.state.all()
    node.host.calls.clear()
    assert reconcile_state(node.backend.pools, node.host, records) == records
    assert _lvs_reads(node) == ([] if node.host.pv_metadata else [{vid}])


@pytest.mark.usefixtures("reads")
def test_records_are_kept_when_lvm_cannot_be_read(node: Node) -> None:
    vid = _new(node, "kept")
    _stage(node, vid)
    records = node.state.all()
    _umount(node, node.path(f"s-{vid}"))  # gone, but nothing can be verified
    node.host.vgs["vg0"].pv_unreadable = True  # neither its PV nor `lvs` answers
    node.host.fail_next(["lvs"], rc=5, stderr="  Internal error")
    assert reconcile_state(node.backend.pools, node.host, records) == records


def test_records_are_kept_when_a_vg_is_missing(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A record whose LV is not found while a class's VG is missing may be in
    that VG: kept. The records of LVs found are still checked."""
    n = make_class_node(tmp_path, monkeypatch, THREE_CLASSES)
    _fill(n, 50)
    _fill(n, 50, vg="vg-hdd")
    fast = _new(n, "fast")
    big = _new(n, "big", vg="vg-hdd")
    _stage(n, fast, "t-fast")
    _stage(n, big)
    records = n.state.all()
    _umount(n, n.path("t-fast"))
    n.host.set_vg_present("vg-hdd", False)
    n.host.calls.clear()
    kept = reconcile_state(n.backend.pools, n.host, records)
    assert kept == {fast: dataclasses.replace(records[fast], publishes={}), big: records[big]}
    assert _lvs_reads(n) == [{fast, big}]


def test_committed_metadata_answers_without_a_process(node: Node,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the committed metadata answering (the fake's PV, read by the
    plugin's reader), no `lvs` runs, and the VG is read once however many
    records there are, only their LVs' sections parsed; a record it has no
    LV for is asked of LVM alone (LVM has the last word on absence)."""
    assert node.host.pv_metadata  # make_node's default: the committed path
    _fill(node)
    vids = [_new(node, f"c{i}") for i in range(3)]
    gone = _new(node, "gone")
    for vid in (*vids, gone):
        _stage(node, vid)
    records = node.state.all()
    _umount(node, node.path(f"s-{vids[2]}"))
    _umount(node, node.path(f"s-{gone}"))
    node.host.run(["lvremove", "--yes", f"vg0/{gone}"])
    labels: list[str] = []  # each PV read starts at its label
    read = node.host.read_device

    def counted(path: str, offset: int, length: int) -> bytes:
        if offset == 0:
            labels.append(path)
        return read(path, offset, length)

    parsed: list[Collection[str] | None] = []
    parse = vg_text.vg_metadata

    def spied(text: bytes, previous: vg_text.VgMetadata | None = None,
              only: Collection[str] | None = None) -> vg_text.VgMetadata:
        parsed.append(only)
        return parse(text, previous, only)

    monkeypatch.setattr(node.host, "read_device", counted)
    monkeypatch.setattr(vg_text, "vg_metadata", spied)
    node.host.calls.clear()
    kept = reconcile_state(node.backend.pools, node.host, records)
    assert kept == {vids[0]: records[vids[0]], vids[1]: records[vids[1]]}
    assert labels == ["/dev/fake-pv-vg0"]  # one read of the VG
    assert [set(only or ()) for only in parsed] == [set(records)]  # their sections only
    assert _lvs_reads(node) == [{gone}]
