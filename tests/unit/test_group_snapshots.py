"""GroupController over a FakeHost: group snapshots taken at one instant.

The group layer (csi_local.volumes.group_snapshots) and its servicer
(csi_local.csi.group_controller_servicer), with the Controller and Node
servicers of the same node, built as plugin.py builds them. What each test
proves against the fake: the members LVM holds
(names, origins, tags), the order of FIFREEZE, lvcreate --snapshot and FITHAW
in `host.calls`, what is left frozen (`host.frozen`), and the take's journal
files in the state directory. The kernel's side of the freeze (a real
FIFREEZE, LVM's nested suspend) is proven in the VM.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.group_controller_servicer import GroupControllerServicer
from csi_local.csi.identity_servicer import IdentityServicer
from csi_local.host.locks import Locks
from csi_local.storage import vg_text
from csi_local.volumes import naming
from csi_local.volumes.freezes import Freezes
from csi_local.volumes.group_snapshots import JOURNAL_PREFIX, GroupSnapshots
from csi_local.volumes.known_vgs import KnownVolumeGroups
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.pool import COMMAND_TEXT_MAX, LV_TEXT_MAX
from tests.unit import table
from tests.unit.fakehost import DM_MAJOR, FakeLv
from tests.unit.servicers import (
    THREE_CLASSES,
    GiB,
    Node,
    block_cap,
    call,
    make_class_node,
    make_node,
    mount_cap,
    vol_id,
)
from tests.unit.table import Case

# Every test twice: reading the committed metadata, and every read an `lvs`.
pytestmark = pytest.mark.usefixtures("reads")

A, B, C = vol_id("a"), vol_id("b"), vol_id("c")
G = naming.group_id_for("g")
KIND_S = f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}"
FROZEN_KERNEL = "cannot snapshot a frozen file system"
RPC = pb.GroupControllerServiceCapability.RPC


def member(vid: str, gid: str = G) -> str:
    """The ID of group `gid`'s snapshot of volume `vid`."""
    return naming.member_snapshot_id(gid, vid)


def member_tags(vid: str, size: int, gid: str = G) -> set[str]:
    return {KIND_S, f"{naming.TAG_SOURCE}=volume:{vid}", f"{naming.TAG_GROUP}={gid}",
            f"{naming.TAG_GROUP_SIZE}={size}"}


# requests -------------------------------------------------------------------------------


def cg(name: str = "g", *sources: str,
       params: dict[str, str] | None = None) -> pb.CreateVolumeGroupSnapshotRequest:
    return pb.CreateVolumeGroupSnapshotRequest(name=name, source_volume_ids=sources,
                                               parameters=params or {})


def gg(gid: str = G, *snapshot_ids: str) -> pb.GetVolumeGroupSnapshotRequest:
    return pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=gid, snapshot_ids=snapshot_ids)


def dg(gid: str = G, *snapshot_ids: str) -> pb.DeleteVolumeGroupSnapshotRequest:
    return pb.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=gid,
                                               snapshot_ids=snapshot_ids)


# the node, with its GroupController ------------------------------------------------------


class Lab:
    """A node, its group layer and GroupController (as plugin.py wires them),
    and helpers to make, stage and inspect volumes."""

    def __init__(self, n: Node) -> None:
        self.n = n
        self.host = n.host
        self.state_dir = n.backend.config.state_dir
        self.freezes = n.backend.freezes  # the one freeze rule, as the controller's
        self.journal_dir = self.freezes.directory
        self.groups = GroupSnapshots(n.backend.pools, n.backend.fs, n.backend.host,
                                     self.freezes, legacy_journal_dir=self.state_dir)
        self.gc = GroupControllerServicer(n.backend, self.groups)

    def volume(self, name: str, size: int = GiB, params: dict[str, str] | None = None) -> str:
        code, reply = call(self.n.controller.CreateVolume, pb.CreateVolumeRequest(
            name=name, capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[mount_cap()], parameters=params or {}))
        assert code == "OK", reply
        return str(reply.volume.volume_id)

    def stage(self, vid: str, cap: pb.VolumeCapability | None = None) -> str:
        """Stage `vid` through the Node servicer (an ext4 mount unless `cap`); the
        staging path as the mount table shows it."""
        path = self.n.path(f"stage-{vid[-8:]}")
        code, reply = call(self.n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
            volume_id=vid, staging_target_path=path,
            volume_capability=cap or mount_cap()))
        assert code == "OK", reply
        return os.path.realpath(path)

    def publish(self, vid: str, staging: str) -> str:
        target = self.n.path(f"target-{vid[-8:]}")
        code, reply = call(self.n.node.NodePublishVolume, pb.NodePublishVolumeRequest(
            volume_id=vid, target_path=target, staging_target_path=staging,
            volume_capability=mount_cap()))
        assert code == "OK", reply
        return os.path.realpath(target)

    def create(self, name: str = "g", *sources: str,
               params: dict[str, str] | None = None) -> tuple[str, Any]:
        return call(self.gc.CreateVolumeGroupSnapshot, cg(name, *sources, params=params))

    def made(self, name: str = "g", *sources: str) -> pb.VolumeGroupSnapshot:
        code, reply = self.create(name, *sources)
        assert code == "OK", reply
        gs: pb.VolumeGroupSnapshot = reply.group_snapshot
        return gs

    def numbers(self, vid: str) -> tuple[int, int]:
        """The device numbers of an active volume (what `host.frozen` holds)."""
        return DM_MAJOR, self.host.lv(vid).minor

    def journals(self) -> list[str]:
        """The freeze journals, and any left where older versions kept them."""
        found = [n for n in os.listdir(self.state_dir) if n.startswith(JOURNAL_PREFIX)]
        if os.path.isdir(self.journal_dir):
            found += os.listdir(self.journal_dir)
        return sorted(found)

    def members(self) -> dict[str, FakeLv]:
        """Every LV carrying a group tag, by name."""
        return {name: lv for (_, name), lv in self.host.all_lvs().items()
                if any(t.startswith(f"{naming.TAG_GROUP}=") for t in lv.tags)}

    def lv_state(self) -> dict[tuple[str, str], frozenset[str]]:
        return {key: frozenset(lv.tags) for key, lv in self.host.all_lvs().items()}

    def events(self) -> list[tuple[str, str]]:
        """Freezes, thaws, snapshots (by origin) and removals, in order."""
        out = []
        for c in self.host.calls:
            if c[0] in ("FIFREEZE", "FITHAW"):
                out.append((c[0], c[1]))
            elif c[0] == "lvcreate" and "--snapshot" in c:
                out.append(("lvcreate", c[-1].split("/")[1]))
            elif c[0] == "lvremove":
                out.append(("lvremove", c[-1].split("/")[1]))
        return out

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events()]


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    n = make_node(tmp_path, monkeypatch)
    try:
        yield Lab(n)
    finally:
        n.backend.state.close()  # an open state file per test adds up over the suite


@pytest.fixture
def ab(lab: Lab) -> Lab:
    """Two unstaged 1 GiB volumes, A and B."""
    assert (lab.volume("a"), lab.volume("b")) == (A, B)
    lab.host.calls.clear()
    return lab


@pytest.fixture
def mounted(ab: Lab) -> tuple[Lab, str, str]:
    """A and B staged as ext4 mounts; their staging paths."""
    pa, pb_ = ab.stage(A), ab.stage(B)
    ab.host.calls.clear()
    return ab, pa, pb_


# capabilities ---------------------------------------------------------------------------


def test_capabilities(lab: Lab) -> None:
    reply = lab.gc.GroupControllerGetCapabilities(
        pb.GroupControllerGetCapabilitiesRequest(), None)  # type: ignore[arg-type]
    assert [c.rpc.type for c in reply.capabilities] == [
        RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT]
    ident = IdentityServicer(lab.n.backend.config, lab.n.backend.pools)
    caps = ident.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(),
                                       None)  # type: ignore[arg-type]
    services = [c.service.type for c in caps.capabilities if c.HasField("service")]
    assert pb.PluginCapability.Service.GROUP_CONTROLLER_SERVICE in services


# CreateVolumeGroupSnapshot: what a take makes ---------------------------------------------


@pytest.mark.parametrize("count", [2, 3])
def test_create_snapshots_every_source(lab: Lab, count: int) -> None:
    sizes = {vol_id(n): (1 + i % 2) * GiB for i, n in enumerate("abc"[:count])}
    for name in "abc"[:count]:
        lab.volume(name, sizes[vol_id(name)])
    # Asked in an order that is neither the volumes' nor their members' sort order.
    order = sorted(sizes, key=member, reverse=True)
    lab.host.calls.clear()
    gs = lab.made("g", *order)
    assert gs.group_snapshot_id == G
    assert gs.ready_to_use and gs.creation_time.seconds > 0
    assert [s.source_volume_id for s in gs.snapshots] == order
    for s in gs.snapshots:
        vid = s.source_volume_id
        assert (s.snapshot_id, s.group_snapshot_id, s.size_bytes) == (member(vid), G, sizes[vid])
        assert s.ready_to_use and s.creation_time.seconds > 0
        lv = lab.host.lv(s.snapshot_id)
        assert lv.tags == member_tags(vid, count)
        assert (lv.origin, lv.active, lv.skip) == (vid, False, True)  # never activated
    assert set(lab.members()) == {member(v) for v in order}
    assert lab.kinds() == ["lvcreate"] * count  # nothing mounted: nothing frozen
    assert not lab.host.frozen and lab.journals() == []


def test_create_is_idempotent(ab: Lab) -> None:
    first = ab.made("g", A, B)
    before = ab.lv_state()
    ab.host.calls.clear()
    again = ab.made("g", A, B)
    assert again.group_snapshot_id == first.group_snapshot_id == G
    assert [(s.snapshot_id, s.source_volume_id, s.group_snapshot_id) for s in again.snapshots] \
        == [(s.snapshot_id, s.source_volume_id, s.group_snapshot_id) for s in first.snapshots]
    # The sources in another order: the same group, its members in that order.
    reordered = ab.made("g", B, A)
    assert [s.snapshot_id for s in reordered.snapshots] == [member(B), member(A)]
    assert ab.kinds() == [] and ab.lv_state() == before


@pytest.mark.parametrize("sources", [
    pytest.param((A,), id="fewer"),
    pytest.param((A, C), id="another"),
    pytest.param((A, B, C), id="more"),
])
def test_create_same_name_other_sources(ab: Lab, sources: tuple[str, ...]) -> None:
    ab.volume("c")
    ab.made("g", A, B)
    before = ab.lv_state()
    ab.host.calls.clear()
    code, msg = ab.create("g", *sources)
    assert code == "ALREADY_EXISTS", msg
    assert "other volumes" in msg
    assert ab.kinds() == [] and ab.lv_state() == before


# CreateVolumeGroupSnapshot: refusals ------------------------------------------------------


Setup = Callable[[Lab], object]


def row(id: str, request: pb.CreateVolumeGroupSnapshotRequest, code: str, says: str = "", *,
        setup: Setup = lambda lab: None, busy: str = "") -> Any:
    return table.row(id, request, code, says, setup=setup, busy=busy, ran=None)


def nothing_left(lab: Lab, case: Case, method: str, code: str, answer: Any) -> None:
    assert lab.kinds() == [] and not lab.host.frozen and lab.journals() == []


# A refused group snapshot makes, removes or retags no LV, and leaves nothing
# frozen, no freeze or snapshot command run, no journal.
TABLE = table.Table[Lab](
    send=lambda lab, method, request: call(getattr(lab.gc, method), request),
    host=lambda lab: lab.host, locks=lambda lab: lab.n.backend.locks,
    kept=lambda lab: {"lvs": lab.lv_state()}, after=nothing_left)


def snapshot_of_a(lab: Lab) -> None:
    code, reply = call(lab.n.controller.CreateSnapshot, pb.CreateSnapshotRequest(
        name="s", source_volume_id=A))
    assert code == "OK", reply


def pool_size(size: int) -> Setup:
    def setup(lab: Lab) -> None:
        lab.host.lv("pool0").size = size
    return setup


def mda_room_for_one(lab: Lab) -> None:
    """The VG's metadata area with room for one more LV, not two."""
    fvg = lab.host.vgs["vg0"]
    free = COMMAND_TEXT_MAX + LV_TEXT_MAX + LV_TEXT_MAX // 2
    fvg.mda_padding += vg_text.max_text_size(fvg.mda_size) - fvg.mda_text - free


def pool_fill(data: float) -> Setup:
    def setup(lab: Lab) -> None:
        lab.host.lv("pool0").data_percent = data
    return setup


CREATE_ERRORS = [
    row("no-name", cg("", A, B), "INVALID_ARGUMENT", "name is required"),
    row("no-sources", cg("g"), "INVALID_ARGUMENT", "source_volume_ids is required"),
    row("empty-source", cg("g", A, ""), "INVALID_ARGUMENT", "source_volume_ids is required"),
    row("duplicate-source", cg("g", A, B, A), "INVALID_ARGUMENT", "twice"),
    row("malformed-id-slash", cg("g", A, "../x"), "INVALID_ARGUMENT", "not a valid ID"),
    row("malformed-id-dot", cg("g", A, "."), "INVALID_ARGUMENT", "not a valid ID"),
    row("malformed-id-long", cg("g", A, "x" * 129), "INVALID_ARGUMENT", "not a valid ID"),
    row("unknown-volume", cg("g", A, vol_id("nope")), "NOT_FOUND", "not found"),
    row("unknown-volume-first", cg("g", vol_id("nope"), B), "NOT_FOUND", "not found"),
    row("foreign-lv", cg("g", A, "data"), "NOT_FOUND", "not found",
        setup=lambda lab: lab.host.add_lv("data", GiB)),
    row("snapshot-as-source", cg("g", A, naming.snapshot_id_for("s")), "NOT_FOUND", "not found",
        setup=snapshot_of_a),
    row("unknown-device-class", cg("g", A, B, params={"deviceClass": "nope"}),
        "INVALID_ARGUMENT", "unknown device class"),
    row("unknown-parameter", cg("g", A, B, params={"size": "1"}), "INVALID_ARGUMENT",
        "unknown parameter 'size'"),
    # Room for one member, not for both: neither is made.
    row("no-room-for-all", cg("g", A, B), "RESOURCE_EXHAUSTED", "room for",
        setup=pool_size(3 * GiB)),
    row("pool-above-high-water-mark", cg("g", A, B), "RESOURCE_EXHAUSTED", "high-water mark",
        setup=pool_fill(95.0)),
    # Room in the VG's metadata area for one member's LV, not both: neither is made.
    row("metadata-area-room-for-one", cg("g", A, B), "RESOURCE_EXHAUSTED",
        "room for 1 more volumes or snapshots, 2 needed", setup=mda_room_for_one),
    row("group-busy", cg("g", A, B), "ABORTED", "", busy=volume_key(G)),
    row("source-busy", cg("g", A, B), "ABORTED", "", busy=volume_key(B)),
]


@pytest.mark.parametrize("case", CREATE_ERRORS)
def test_create_errors(ab: Lab, case: Case) -> None:
    TABLE.run(ab, case, "CreateVolumeGroupSnapshot")


@pytest.mark.parametrize("params", [
    pytest.param({"csi.storage.k8s.io/volumegroupsnapshot/name": "x"}, id="co-parameters"),
    pytest.param({"deviceClass": "default"}, id="the-sources-class"),
    pytest.param({"deviceClass": ""}, id="empty-device-class"),
])
def test_create_accepts(ab: Lab, params: dict[str, str]) -> None:
    code, reply = ab.create("g", A, B, params=params)
    assert code == "OK", reply
    assert set(ab.members()) == {member(A), member(B)}


# freezing -------------------------------------------------------------------------------


def test_create_freezes_mounted_members_around_the_snapshots(mounted: tuple[Lab, str, str]
                                                             ) -> None:
    ab, pa, pb_ = mounted
    gs = ab.made("g", A, B)
    assert [s.snapshot_id for s in gs.snapshots] == [member(A), member(B)]
    events = ab.events()
    # Every freeze before the first snapshot, every thaw after the last.
    assert events[:2] == [("FIFREEZE", pa), ("FIFREEZE", pb_)]
    assert events[2:4] == [("lvcreate", A), ("lvcreate", B)]
    assert sorted(events[4:]) == sorted([("FITHAW", pa), ("FITHAW", pb_)])
    assert not ab.host.frozen and ab.journals() == []
    assert {name: lv.origin for name, lv in ab.members().items()} == {
        member(A): A, member(B): B}


@pytest.mark.parametrize("mounted_one", [A, B], ids=["first-mounted", "second-mounted"])
def test_one_member_with_writers_is_synced_not_frozen(ab: Lab, mounted_one: str) -> None:
    """The other member is not open, so the one that is needs no freeze: an
    instant by itself (and so this works on 6.1 too); its file system is
    committed first, as for CreateSnapshot."""
    path = ab.stage(mounted_one)
    ab.host.calls.clear()
    ab.host.nested_freeze = False
    ab.made("g", A, B)
    assert ab.kinds() == ["lvcreate", "lvcreate"]
    names = [c[0] for c in ab.host.calls]
    assert ("sync", "--file-system", path) in ab.host.calls
    assert names.index("sync") < names.index("lvcreate")


def test_create_freezes_a_published_member_once(mounted: tuple[Lab, str, str]) -> None:
    lab, pa, pb_ = mounted
    lab.publish(A, pa)
    lab.host.calls.clear()
    lab.made("g", A, B)
    assert [e for e in lab.events() if e[0] == "FIFREEZE"] == [("FIFREEZE", pa),
                                                               ("FIFREEZE", pb_)]
    assert not lab.host.frozen


def test_group_of_one_mounted_is_not_frozen(mounted: tuple[Lab, str, str]) -> None:
    lab, _, _ = mounted
    lab.host.nested_freeze = False  # even where a freeze would fail
    gs = lab.made("g", A)
    assert [s.snapshot_id for s in gs.snapshots] == [member(A)]
    assert lab.kinds() == ["lvcreate"]
    assert lab.host.lv(member(A)).tags == member_tags(A, 1)


def test_group_of_one_mounted_commits_the_file_system_first(
        mounted: tuple[Lab, str, str]) -> None:
    """CreateSnapshot runs `sync --file-system` on a mounted source before
    lvcreate (VolumeSteps.flush: LVM's lockfs suspend alone leaves
    a btrfs log tree uncommitted, and the snapshot's clone fails to mount).
    A group of one is not frozen, so the take commits it."""
    lab, pa, _ = mounted
    lab.made("g", A)
    names = [c[0] for c in lab.host.calls]
    assert ("sync", "--file-system", pa) in lab.host.calls, (
        f"a group snapshot of one mounted volume is taken without syncfs; calls: {names}")
    assert names.index("sync") < names.index("lvcreate")


def test_kernel_without_nested_freeze_refuses_mounted_members(
        mounted: tuple[Lab, str, str]) -> None:
    lab, pa, pb_ = mounted
    lab.host.nested_freeze = False  # Linux 6.1: LVM's suspend of a frozen origin fails
    before = lab.lv_state()
    code, msg = lab.create("g", A, B)
    assert code == "FAILED_PRECONDITION", msg
    assert FROZEN_KERNEL in msg and "Failed to suspend thin snapshot origin" in msg
    assert lab.lv_state() == before and lab.members() == {}
    assert not lab.host.frozen and lab.journals() == []
    assert {e for e in lab.events() if e[0] == "FITHAW"} == {("FITHAW", pa), ("FITHAW", pb_)}


def test_kernel_without_nested_freeze_takes_unmounted_members(ab: Lab) -> None:
    ab.host.nested_freeze = False
    ab.made("g", A, B)
    assert set(ab.members()) == {member(A), member(B)}


@pytest.mark.parametrize("in_use", [
    pytest.param(lambda lab: lab.stage(B, block_cap()), id="staged-as-block"),
    pytest.param(lambda lab: lab.host.set_busy(B), id="open-by-a-process"),
])
def test_raw_block_member_in_use(ab: Lab, in_use: Setup) -> None:
    in_use(ab)
    ab.stage(A)  # a member that could be frozen is not frozen either
    before = ab.lv_state()
    ab.host.calls.clear()
    code, msg = ab.create("g", A, B)
    assert code == "FAILED_PRECONDITION", msg
    assert "raw block device" in msg and B in msg
    assert ab.kinds() == [] and not ab.host.frozen and ab.journals() == []
    assert ab.lv_state() == before
    # Alone, it is one snapshot: an instant without any freeze.
    gs = ab.made("alone", B)
    assert [s.source_volume_id for s in gs.snapshots] == [B]
    assert ab.kinds() == ["lvcreate"]


def test_second_snapshot_fails(mounted: tuple[Lab, str, str]) -> None:
    lab, pa, pb_ = mounted
    lab.host.fail_next(("lvcreate", "--yes", "--snapshot", "--name", member(B)), 5,
                       "  unexpected failure\n")
    code, msg = lab.create("g", A, B)
    assert code == "INTERNAL", msg
    assert "lvcreate exited 5" in msg
    assert lab.members() == {}  # the first member is removed
    events = lab.events()
    assert ("lvremove", member(A)) in events
    assert events.index(("lvremove", member(A))) > max(
        events.index(("FITHAW", pa)), events.index(("FITHAW", pb_)))
    assert not lab.host.frozen and lab.journals() == []
    # A retry takes the group.
    lab.made("g", A, B)
    assert set(lab.members()) == {member(A), member(B)}


@pytest.mark.parametrize("other", [A, B], ids=["first", "second"])
def test_file_system_frozen_by_someone_else(mounted: tuple[Lab, str, str], other: str) -> None:
    lab, pa, _ = mounted
    theirs = lab.numbers(other)
    lab.host.frozen.add(theirs)
    before = lab.lv_state()
    code, msg = lab.create("g", A, B)
    assert code == "FAILED_PRECONDITION", msg
    assert "cannot freeze" in msg
    assert lab.host.frozen == {theirs}, "ours thawed, theirs left frozen"
    thaws = [e for e in lab.events() if e[0] == "FITHAW"]
    assert thaws == ([] if other == A else [("FITHAW", pa)])
    assert lab.lv_state() == before and lab.journals() == []
    assert "lvcreate" not in lab.kinds()


# GetVolumeGroupSnapshot -----------------------------------------------------------------


@pytest.fixture
def group(ab: Lab) -> Lab:
    """Group G of A and B."""
    ab.made("g", A, B)
    ab.host.calls.clear()
    return ab


GET_ROWS = [
    pytest.param(gg(), "OK", "", id="no-snapshot-ids"),
    pytest.param(gg(G, member(A), member(B)), "OK", "", id="its-members"),
    pytest.param(gg(G, member(B), member(A)), "OK", "", id="its-members-other-order"),
    pytest.param(gg(G, member(A)), "INVALID_ARGUMENT", "not the members", id="fewer-ids"),
    pytest.param(gg(G, member(A), member(B), member(C)), "INVALID_ARGUMENT",
                 "not the members", id="more-ids"),
    pytest.param(gg(G, member(A), naming.snapshot_id_for("x")), "INVALID_ARGUMENT",
                 "not the members", id="other-ids"),
    pytest.param(gg(naming.group_id_for("other")), "NOT_FOUND", "not found", id="unknown"),
    pytest.param(gg(A), "NOT_FOUND", "not found", id="a-volume-id"),
    pytest.param(gg("not-a-group"), "NOT_FOUND", "not found", id="not-our-id"),
    pytest.param(gg(""), "INVALID_ARGUMENT", "required", id="empty-id"),
    pytest.param(gg("a/b"), "INVALID_ARGUMENT", "not a valid ID", id="malformed-id"),
]


@pytest.mark.parametrize(("request_", "code", "says"), GET_ROWS)
def test_get(group: Lab, request_: pb.GetVolumeGroupSnapshotRequest, code: str,
             says: str) -> None:
    before = group.lv_state()
    got, answer = call(group.gc.GetVolumeGroupSnapshot, request_)
    assert got == code, answer
    assert group.lv_state() == before and group.kinds() == []
    if code != "OK":
        assert says in answer, answer
        return
    gs = answer.group_snapshot
    assert gs.group_snapshot_id == G and gs.ready_to_use
    members = [group.host.lv(member(A)), group.host.lv(member(B))]
    assert gs.creation_time.seconds == min(lv.created for lv in members)
    assert [s.snapshot_id for s in gs.snapshots] == sorted([member(A), member(B)])
    assert {(s.snapshot_id, s.source_volume_id, s.group_snapshot_id, s.size_bytes)
            for s in gs.snapshots} == {(member(A), A, G, GiB), (member(B), B, G, GiB)}


# DeleteVolumeGroupSnapshot --------------------------------------------------------------


def listed(lab: Lab) -> dict[str, str]:
    """ListSnapshots: {snapshot ID: its group snapshot ID}."""
    code, reply = call(lab.n.controller.ListSnapshots, pb.ListSnapshotsRequest())
    assert code == "OK", reply
    return {e.snapshot.snapshot_id: e.snapshot.group_snapshot_id for e in reply.entries}


@pytest.mark.parametrize("ids", [(), (member(A), member(B)), (member(B), member(A))],
                         ids=["no-snapshot-ids", "its-members", "other-order"])
def test_delete_removes_every_member(group: Lab, ids: tuple[str, ...]) -> None:
    assert listed(group) == {member(A): G, member(B): G}
    code, reply = call(group.gc.DeleteVolumeGroupSnapshot, dg(G, *ids))
    assert (code, reply) == ("OK", pb.DeleteVolumeGroupSnapshotResponse())
    assert group.members() == {}
    assert sorted(group.events()) == sorted([("lvremove", member(A)),
                                             ("lvremove", member(B))])
    assert listed(group) == {}
    assert {A, B} <= set(group.host.lvs)  # the sources stay
    assert call(group.gc.GetVolumeGroupSnapshot, gg())[0] == "NOT_FOUND"
    group.host.calls.clear()
    assert call(group.gc.DeleteVolumeGroupSnapshot, dg(G, *ids))[0] == "OK"  # again
    assert "lvremove" not in group.kinds()


DELETE_ROWS = [
    pytest.param(dg(G, member(A)), "INVALID_ARGUMENT", "not the members", "lvs",
                 id="fewer-ids"),
    pytest.param(dg(G, member(A), naming.snapshot_id_for("x")), "INVALID_ARGUMENT",
                 "not the members", "lvs", id="other-ids"),
    pytest.param(dg(naming.group_id_for("other")), "OK", "", "lvs", id="unknown"),
    pytest.param(dg(A), "OK", "", "", id="a-volume-id-is-never-touched"),
    pytest.param(dg("not-a-group"), "OK", "", "", id="not-our-id"),
    pytest.param(dg(""), "INVALID_ARGUMENT", "required", "", id="empty-id"),
    pytest.param(dg(".."), "INVALID_ARGUMENT", "not a valid ID", "", id="malformed-id"),
]


@pytest.mark.parametrize(("request_", "code", "says", "ran"), DELETE_ROWS)
def test_delete_rows(group: Lab, request_: pb.DeleteVolumeGroupSnapshotRequest, code: str,
                     says: str, ran: str) -> None:
    before = group.lv_state()
    got, answer = call(group.gc.DeleteVolumeGroupSnapshot, request_)
    assert got == code, answer
    if code != "OK":
        assert says in answer, answer
    assert group.lv_state() == before, "nothing is removed"
    assert {c[0] for c in group.host.calls} == set(ran.split())


# members as snapshots -------------------------------------------------------------------


def test_member_is_a_snapshot_of_the_group(group: Lab) -> None:
    ctl = group.n.controller
    before = group.lv_state()
    code, msg = call(ctl.DeleteSnapshot, pb.DeleteSnapshotRequest(snapshot_id=member(A)))
    assert code == "INVALID_ARGUMENT", msg
    assert G in msg and "DeleteVolumeGroupSnapshot" in msg
    assert group.lv_state() == before and "lvremove" not in group.kinds()

    code, reply = call(ctl.GetSnapshot, pb.GetSnapshotRequest(snapshot_id=member(A)))
    assert code == "OK", reply
    assert (reply.snapshot.group_snapshot_id, reply.snapshot.source_volume_id) == (G, A)

    snapshot_of_a(group)  # an ordinary snapshot beside the members
    assert listed(group) == {member(A): G, member(B): G, naming.snapshot_id_for("s"): ""}
    code, reply = call(ctl.ListSnapshots, pb.ListSnapshotsRequest(source_volume_id=B))
    assert [(e.snapshot.snapshot_id, e.snapshot.group_snapshot_id) for e in reply.entries] \
        == [(member(B), G)]


def test_member_restores(group: Lab) -> None:
    code, reply = call(group.n.controller.CreateVolume, pb.CreateVolumeRequest(
        name="restored", volume_capabilities=[mount_cap()],
        volume_content_source=pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=member(A)))))
    assert code == "OK", reply
    assert reply.volume.content_source.snapshot.snapshot_id == member(A)
    lv = group.host.lv(reply.volume.volume_id)
    assert (lv.origin, lv.active) == (member(A), True)
    # The group is still whole; deleting it leaves the restored volume.
    assert call(group.gc.GetVolumeGroupSnapshot, gg())[0] == "OK"
    assert call(group.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert reply.volume.volume_id in group.host.lvs


# an unfinished group --------------------------------------------------------------------


def lose_member(lab: Lab, vid: str) -> None:
    """A take that did not finish: one member never made."""
    lab.host.run(["lvremove", "--yes", f"vg0/{member(vid)}"])
    lab.host.calls.clear()


def test_unfinished_group_is_not_found_and_is_retaken(group: Lab) -> None:
    lose_member(group, B)
    old = group.host.lv(member(A)).created
    code, msg = call(group.gc.GetVolumeGroupSnapshot, gg())
    assert code == "NOT_FOUND", msg
    group.host.calls.clear()
    gs = group.made("g", A, B)
    assert [s.snapshot_id for s in gs.snapshots] == [member(A), member(B)]
    events = group.events()
    assert events == [("lvremove", member(A)), ("lvcreate", A), ("lvcreate", B)]
    assert group.host.lv(member(A)).created > old  # a new instant
    assert {n: lv.tags for n, lv in group.members().items()} == {
        member(A): member_tags(A, 2), member(B): member_tags(B, 2)}
    assert call(group.gc.GetVolumeGroupSnapshot, gg())[0] == "OK"


def test_unfinished_group_is_deleted(group: Lab) -> None:
    lose_member(group, A)
    assert call(group.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert group.members() == {}


# recover(): after a plugin killed mid-take ------------------------------------------------


def journal(lab: Lab, gid: str, frozen: list[tuple[str, int, int]] | None = None,
            text: str | None = None, *, legacy: bool = False) -> str:
    """A take's journal as take() writes it (or `text`); `legacy`: as versions
    before the one freeze rule wrote it, in the state directory."""
    os.makedirs(lab.journal_dir, exist_ok=True)
    path = os.path.join(lab.state_dir if legacy else lab.journal_dir, JOURNAL_PREFIX + gid)
    body = json.dumps({"group_id": gid, "frozen": [list(f) for f in frozen or []],
                       **({} if legacy else {"what": f"group snapshot {gid}"})})
    Path(path).write_text(body if text is None else text, encoding="utf-8")
    return path


def restart(lab: Lab) -> None:
    """What plugin.py does at start-up: a new group layer recovers."""
    lab.host.calls.clear()
    backend = lab.n.backend
    GroupSnapshots(backend.pools, backend.fs, backend.host,
                   Freezes(backend.host, backend.locks, lab.freezes.limit),
                   legacy_journal_dir=lab.state_dir).recover()


@pytest.mark.parametrize("legacy", [False, True], ids=["journal", "older-versions-journal"])
def test_recover_thaws_and_deletes_an_unfinished_group(mounted: tuple[Lab, str, str],
                                                       legacy: bool) -> None:
    lab, pa, _ = mounted
    lab.made("g", A, B)
    lose_member(lab, B)
    lab.host.frozen.add(lab.numbers(A))  # killed while A was frozen
    journal(lab, G, [(pa, *lab.numbers(A))], legacy=legacy)
    restart(lab)
    assert not lab.host.frozen
    assert ("FITHAW", pa) in lab.events()
    assert lab.members() == {}
    assert lab.journals() == []


@pytest.mark.parametrize("fails", ["snapshot", "none"])
def test_a_failed_thaw_keeps_the_journal_for_the_next_start(
        mounted: tuple[Lab, str, str], monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    # The kernel refused to thaw B: without the journal, nothing would ever
    # thaw it again, and every write to B would hang.
    lab, _, pb_ = mounted
    real_thaw = lab.host.thaw
    refused: list[str] = []

    def thaw(mount_point: str) -> bool:
        if mount_point == pb_ and not refused:  # the first thaw of B only
            refused.append(mount_point)
            raise OSError(errno.EIO, "Input/output error")
        return real_thaw(mount_point)

    monkeypatch.setattr(lab.host, "thaw", thaw)
    if fails == "snapshot":
        lab.host.fail_next(("lvcreate", "--yes", "--snapshot", "--name", member(B)), 5,
                           "  unexpected failure\n")
        assert lab.create("g", A, B)[0] == "INTERNAL"
    else:
        lab.made("g", A, B)
    assert lab.host.frozen == {lab.numbers(B)}, "A thawed, B stuck"
    assert len(lab.journals()) == 1
    restart(lab)  # the next start thaws B and drops the journal
    assert not lab.host.frozen and lab.journals() == []
    assert set(lab.members()) == (set() if fails == "snapshot" else {member(A), member(B)})


def test_recover_keeps_a_finished_group(group: Lab) -> None:
    journal(group, G)  # killed after the last snapshot, before the journal went
    before = group.lv_state()
    restart(group)
    assert group.lv_state() == before and group.kinds() == []
    assert group.journals() == []


def test_recover_leaves_another_file_system_frozen(mounted: tuple[Lab, str, str]) -> None:
    lab, pa, _ = mounted
    theirs = lab.numbers(A)
    lab.host.frozen.add(theirs)
    # The journal's path now shows A's file system, not the device it froze.
    journal(lab, G, [(pa, DM_MAJOR, 99), (lab.n.path("gone"), DM_MAJOR, 98)])
    restart(lab)
    assert lab.host.frozen == {theirs}
    assert lab.events() == []
    assert lab.journals() == []


@pytest.mark.parametrize("text", [
    pytest.param("{not json", id="not-json"),
    pytest.param(json.dumps({"frozen": []}), id="no-group-id"),
    pytest.param(json.dumps({"group_id": G, "frozen": [["/x", "y"]]}), id="bad-frozen"),
    pytest.param(json.dumps({"group_id": G, "frozen": 5}), id="frozen-not-a-list"),
    pytest.param(json.dumps([1]), id="not-an-object"),
])
def test_recover_removes_an_unreadable_journal(group: Lab, text: str) -> None:
    lose_member(group, B)  # an unfinished group the journal cannot name
    journal(group, G, text=text)
    before = group.lv_state()
    restart(group)
    assert group.journals() == []
    assert group.lv_state() == before  # its group is not touched


def test_recover_ignores_other_files_and_a_missing_directory(group: Lab,
                                                             tmp_path: Path) -> None:
    other = Path(group.state_dir, "token.key")
    other.write_text("k", encoding="utf-8")
    journal(group, naming.group_id_for("never-made"))
    restart(group)
    assert other.read_text(encoding="utf-8") == "k"
    assert group.journals() == [] and set(group.members()) == {member(A), member(B)}
    GroupSnapshots(group.n.backend.pools, group.n.backend.fs, group.host,
                   Freezes(group.host, Locks(str(tmp_path / "locks"))),
                   legacy_journal_dir=str(tmp_path / "absent")).recover()


def test_a_take_leaves_no_journal_behind(ab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal exists while a take runs, naming what it freezes."""
    pa, pb_ = ab.stage(A), ab.stage(B)
    seen: list[dict[str, Any]] = []
    real = ab.host.freeze

    def freeze(path: str) -> None:
        (name,) = ab.journals()
        seen.append(json.loads(Path(ab.journal_dir, name).read_text(encoding="utf-8")))
        real(path)

    monkeypatch.setattr(ab.host, "freeze", freeze)
    ab.made("g", A, B)
    journal = {"group_id": G, "what": f"group snapshot {G}",
               "frozen": [[pa, *ab.numbers(A)], [pb_, *ab.numbers(B)]]}
    assert seen == [journal, journal]
    assert ab.journals() == []


# device classes -------------------------------------------------------------------------


@pytest.fixture
def classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    n = make_class_node(tmp_path, monkeypatch, THREE_CLASSES)
    try:
        yield Lab(n)
    finally:
        n.backend.state.close()


def test_group_across_device_classes(classes: Lab) -> None:
    fast = classes.volume("f", params={"deviceClass": "fast"})
    big = classes.volume("b", params={"deviceClass": "big"})
    gs = classes.made("g", big, fast)
    assert [s.source_volume_id for s in gs.snapshots] == [big, fast]
    # Each member lives beside its source, in its class's VG and pool.
    assert classes.host.lv(member(fast), "vg-nvme").pool == "pool"
    assert classes.host.lv(member(big), "vg-hdd").pool == "pool"
    code, reply = call(classes.gc.GetVolumeGroupSnapshot, gg())
    assert code == "OK", reply
    assert call(classes.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert classes.members() == {}


def test_group_device_class_other_than_a_sources(classes: Lab) -> None:
    fast = classes.volume("f", params={"deviceClass": "fast"})
    big = classes.volume("b", params={"deviceClass": "big"})
    before = classes.lv_state()
    code, msg = classes.create("g", fast, big, params={"deviceClass": "fast"})
    assert code == "INVALID_ARGUMENT", msg
    assert "device class 'big'" in msg
    assert classes.lv_state() == before and classes.journals() == []


# a member's volume group missing -----------------------------------------------------------
#
# A group's members are found by their tags, so a member in a VG that is
# missing (a PV unplugged, a VG not yet activated) is simply not seen: the
# group looks unfinished, or absent. While a VG the node has had is missing,
# neither may be concluded: nothing is deleted, retaken or called gone, and
# the call is UNAVAILABLE, as every other lookup answers a missing VG.


@pytest.fixture
def split(classes: Lab) -> tuple[Lab, str, str]:
    """Group G of a fast volume (VG vg-nvme) and a big one (VG vg-hdd)."""
    fast = classes.volume("f", params={"deviceClass": "fast"})
    big = classes.volume("b", params={"deviceClass": "big"})
    classes.made("g", fast, big)
    classes.host.calls.clear()
    return classes, fast, big


def known_vgs(lab: Lab, backups: Path, *, had: tuple[str, ...] = ()) -> None:
    """The record of the VGs the node has had, made at a start (as CsiPlugin
    wires it), LVM's metadata backups naming `had` among the missing ones."""
    backups.mkdir(exist_ok=True)
    for vg in had:
        (backups / vg).write_text("# lvm metadata backup\n", encoding="utf-8")
    pools = lab.n.backend.pools
    pools.known_vgs = KnownVolumeGroups(lab.state_dir, lambda: str(backups))
    for pool in pools:
        pool.known_vgs = pools.known_vgs
    pools.note_volume_groups()
    lab.host.calls.clear()


def lose_member_in(lab: Lab, vid: str, vg: str) -> None:
    """A take that did not finish: `vid`'s member, in VG `vg`, never made."""
    lab.host.run(["lvremove", "--yes", f"{vg}/{member(vid)}"])
    lab.host.calls.clear()


def test_retry_while_a_members_vg_is_missing_deletes_nothing(
        split: tuple[Lab, str, str]) -> None:
    """The CO's retry of a group that was taken whole, while one member's VG is
    missing: the other members are not debris of an unfinished take."""
    lab, fast, big = split
    before = lab.lv_state()
    lab.host.set_vg_present("vg-hdd", False)
    # The same sources, and others (a group of the one member seen would be a
    # second group of this ID once the VG is back).
    for sources in ((fast, big), (big, fast), (fast,)):
        code, msg = lab.create("g", *sources)
        assert (code, lab.lv_state()) == ("UNAVAILABLE", before), msg
        assert "volume group vg-hdd not found" in msg, msg
    assert not {"lvremove", "lvcreate"} & set(lab.kinds())
    assert lab.journals() == []
    # Back: the retry answers the group that was taken, at its instant.
    lab.host.set_vg_present("vg-hdd", True)
    gs = lab.made("g", fast, big)
    assert [s.snapshot_id for s in gs.snapshots] == [member(fast), member(big)]
    assert lab.lv_state() == before
    assert not {"lvremove", "lvcreate"} & set(lab.kinds())


def test_get_and_delete_while_a_members_vg_is_missing(split: tuple[Lab, str, str]) -> None:
    """Neither "not found" nor a delete of the members that are seen: the CO
    would forget the one in the missing VG."""
    lab, fast, big = split
    before = lab.lv_state()
    lab.host.set_vg_present("vg-hdd", False)
    for rpc, request_ in ((lab.gc.GetVolumeGroupSnapshot, gg()),
                          (lab.gc.DeleteVolumeGroupSnapshot, dg()),
                          (lab.gc.DeleteVolumeGroupSnapshot, dg(G, member(fast), member(big)))):
        code, msg = call(rpc, request_)
        assert code == "UNAVAILABLE", msg
        assert "volume group vg-hdd not found" in msg, msg
    assert lab.lv_state() == before and "lvremove" not in lab.kinds()
    lab.host.set_vg_present("vg-hdd", True)
    assert call(lab.gc.GetVolumeGroupSnapshot, gg())[0] == "OK"
    assert call(lab.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert lab.members() == {}


@pytest.mark.parametrize("rpc", ["create", "get", "delete"])
def test_a_group_not_seen_while_a_vg_is_missing(classes: Lab, rpc: str) -> None:
    """No member seen at all: the group may be wholly in the missing VG, so it
    is neither taken anew (two groups of one ID) nor called gone."""
    fast = classes.volume("f", params={"deviceClass": "fast"})
    big = classes.volume("b", params={"deviceClass": "big"})
    classes.made("g", big)
    classes.host.set_vg_present("vg-hdd", False)
    classes.host.calls.clear()
    before = classes.lv_state()
    code, msg = {"create": lambda: classes.create("g", fast),
                 "get": lambda: call(classes.gc.GetVolumeGroupSnapshot, gg()),
                 "delete": lambda: call(classes.gc.DeleteVolumeGroupSnapshot, dg())}[rpc]()
    assert code == "UNAVAILABLE", msg
    assert "volume group vg-hdd not found" in msg, msg
    assert classes.lv_state() == before
    assert not {"lvremove", "lvcreate"} & set(classes.kinds())


def test_a_whole_group_is_served_while_another_vg_is_missing(classes: Lab) -> None:
    """Every member seen: nothing of it can be in the missing VG."""
    fast = classes.volume("f", params={"deviceClass": "fast"})
    fast2 = classes.volume("f2", params={"deviceClass": "fast"})
    classes.made("g", fast, fast2)
    classes.host.set_vg_present("vg-hdd", False)
    classes.host.calls.clear()
    before = classes.lv_state()
    gs = classes.made("g", fast, fast2)
    assert sorted(s.snapshot_id for s in gs.snapshots) == sorted([member(fast), member(fast2)])
    assert call(classes.gc.GetVolumeGroupSnapshot, gg())[0] == "OK"
    assert classes.lv_state() == before
    assert call(classes.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert classes.members() == {}


def test_a_vg_the_node_never_had_holds_no_member(classes: Lab, tmp_path: Path) -> None:
    """A missing VG this node never had (classes are per cluster, pools per
    node) holds nothing: groups are taken, found and deleted as without it."""
    classes.host.set_vg_present("vg-hdd", False)
    known_vgs(classes, tmp_path / "lvm-backup")
    fast = classes.volume("f", params={"deviceClass": "fast"})
    fast2 = classes.volume("f2", params={"deviceClass": "fast"})
    assert call(classes.gc.GetVolumeGroupSnapshot, gg())[0] == "NOT_FOUND"
    classes.made("g", fast, fast2)
    lose_member_in(classes, fast2, "vg-nvme")
    classes.host.calls.clear()
    gs = classes.made("g", fast, fast2)  # the unfinished one is retaken
    assert len(gs.snapshots) == 2
    assert classes.events()[0] == ("lvremove", member(fast))
    assert call(classes.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert call(classes.gc.DeleteVolumeGroupSnapshot, dg())[0] == "OK"
    assert classes.members() == {}


def test_a_vg_the_node_had_keeps_its_members(split: tuple[Lab, str, str],
                                             tmp_path: Path) -> None:
    """The same VG on the record (the node had it): refused, whatever restarts."""
    lab, fast, big = split
    known_vgs(lab, tmp_path / "lvm-backup")
    lab.host.set_vg_present("vg-hdd", False)
    known_vgs(lab, tmp_path / "lvm-backup")  # a start while it is missing
    before = lab.lv_state()
    assert lab.create("g", fast, big)[0] == "UNAVAILABLE"
    assert lab.lv_state() == before


@pytest.mark.parametrize("rpc", ["create", "get", "delete"])
def test_the_only_vg_missing(group: Lab, rpc: str) -> None:
    """One VG, missing: no member is seen, and the group is not called gone."""
    before = group.lv_state()
    group.host.set_vg_present("vg0", False)
    code, msg = {"create": lambda: group.create("g", A, B),
                 "get": lambda: call(group.gc.GetVolumeGroupSnapshot, gg()),
                 "delete": lambda: call(group.gc.DeleteVolumeGroupSnapshot, dg())}[rpc]()
    assert code == "UNAVAILABLE", msg
    assert "volume group vg0 not found" in msg, msg
    assert group.lv_state() == before
    assert not {"lvremove", "lvcreate"} & set(group.kinds())


def test_recover_leaves_a_group_whose_vg_is_missing(split: tuple[Lab, str, str]) -> None:
    """A start with a take's journal left and a member's VG missing: the group
    may be whole, so it is left to the CO's retry once the VG is back; the
    plugin still starts."""
    lab, fast, big = split
    journal(lab, G)
    lab.host.set_vg_present("vg-hdd", False)
    before = lab.lv_state()
    restart(lab)
    assert lab.lv_state() == before and "lvremove" not in lab.kinds()
    assert lab.journals() == []
    lab.host.set_vg_present("vg-hdd", True)
    assert call(lab.gc.GetVolumeGroupSnapshot, gg())[0] == "OK"
    gs = lab.made("g", fast, big)  # the CO's retry: the group as it was taken
    assert [s.snapshot_id for s in gs.snapshots] == [member(fast), member(big)]
    assert lab.lv_state() == before and "lvcreate" not in lab.kinds()


# the freeze window's own limit ------------------------------------------------------------


def until_thawed(lab: Lab, seconds: float) -> None:
    """Wait until nothing is frozen, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while lab.host.frozen and time.monotonic() < deadline:
        time.sleep(0.005)


def slow(lab: Lab, monkeypatch: pytest.MonkeyPatch, vid: str, seconds: float,
         seen: list[set[tuple[int, int]]]) -> None:
    """lvcreate of `vid`'s member takes up to `seconds` (LVM waiting for its VG
    lock), and returns as soon as nothing is frozen any more (the limit's thaw
    came first); `seen` gets what is frozen when it returns."""
    real = lab.host.run

    def run(argv: Any, **kwargs: Any) -> Any:
        if argv[0] == "lvcreate" and "--snapshot" in argv and member(vid) in argv:
            until_thawed(lab, seconds)
            out = real(argv, **kwargs)
            seen.append(set(lab.host.frozen))
            return out
        return real(argv, **kwargs)

    monkeypatch.setattr(lab.host, "run", run)


@pytest.mark.parametrize("hangs", [A, B], ids=["first", "second"])
def test_a_take_past_the_freeze_limit_thaws_and_fails(
        mounted: tuple[Lab, str, str], monkeypatch: pytest.MonkeyPatch, hangs: str) -> None:
    lab, pa, pb_ = mounted
    lab.freezes.limit = 0.3
    seen: list[set[tuple[int, int]]] = []
    slow(lab, monkeypatch, hangs, 1.0, seen)
    started = time.monotonic()
    code, msg = lab.create("g", A, B)
    assert code == "UNAVAILABLE", msg
    assert "frozen for its limit of 0.3 s (--group-freeze-timeout)" in msg
    assert seen == [set()], "thawed at the limit, while lvcreate still ran"
    assert time.monotonic() - started < 5
    assert lab.members() == {}, "a member cut after the thaw is no instant: deleted"
    assert not lab.host.frozen and lab.journals() == []
    thaws = [e for e in lab.events() if e[0] == "FITHAW"]
    assert sorted(thaws) == sorted([("FITHAW", pa), ("FITHAW", pb_)]), "each thawed once"
    if hangs == A:  # the limit passed during the first: the second is never cut
        assert ("lvcreate", A) in lab.events() and ("lvcreate", B) not in lab.events()
    lab.freezes.limit = 60.0
    monkeypatch.undo()
    assert lab.made("g", A, B).group_snapshot_id == G  # a retry takes it


def test_a_slow_freeze_past_the_limit_thaws_it_too(
        mounted: tuple[Lab, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # FIFREEZE of B writes back its dirty data and takes past the limit: A is
    # thawed by the timer meanwhile, B as soon as its freeze returns.
    lab, pa, pb_ = mounted
    lab.freezes.limit = 0.2
    real = lab.host.freeze

    def freeze(path: str) -> None:
        if path == pb_:
            until_thawed(lab, 0.6)  # A thawed by the timer meanwhile
        real(path)

    monkeypatch.setattr(lab.host, "freeze", freeze)
    code, msg = lab.create("g", A, B)
    assert code == "UNAVAILABLE", msg
    assert not lab.host.frozen and lab.members() == {} and lab.journals() == []
    assert "lvcreate" not in lab.kinds()
    assert lab.events() == [("FIFREEZE", pa), ("FITHAW", pa), ("FIFREEZE", pb_),
                            ("FITHAW", pb_)]


def test_within_the_limit_nothing_changes(mounted: tuple[Lab, str, str]) -> None:
    lab, pa, pb_ = mounted
    lab.freezes.limit = 30.0
    lab.made("g", A, B)
    assert lab.events() == [("FIFREEZE", pa), ("FIFREEZE", pb_), ("lvcreate", A),
                            ("lvcreate", B), ("FITHAW", pb_), ("FITHAW", pa)]


def stuck_take(lab: Lab, monkeypatch: pytest.MonkeyPatch, path: str) -> list[str]:
    """A take whose thaw of `path` fails, and keeps failing: its journal is
    kept; the failed thaws are counted in the returned list."""
    real_thaw = lab.host.thaw
    refused: list[str] = []

    def thaw(mount_point: str) -> bool:
        if mount_point == path:
            refused.append(mount_point)
            raise OSError(errno.EIO, "Input/output error")
        return real_thaw(mount_point)

    monkeypatch.setattr(lab.host, "thaw", thaw)
    lab.host.fail_next(("lvcreate", "--yes", "--snapshot", "--name", member(B)), 5,
                       "  unexpected failure\n")
    assert lab.create("g", A, B)[0] == "INTERNAL"
    return refused


def test_a_retry_does_not_overwrite_a_journal_kept_after_a_failed_thaw(
        mounted: tuple[Lab, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    lab, _pa, pb_ = mounted
    refused = stuck_take(lab, monkeypatch, pb_)
    path = os.path.join(lab.journal_dir, JOURNAL_PREFIX + G)
    kept = Path(path).read_text(encoding="utf-8")
    assert [pb_, *lab.numbers(B)] in json.loads(kept)["frozen"]
    # The retry tries B's thaw first, fails again: refused, the journal as it was.
    code, msg = lab.create("g", A, B)
    assert code == "FAILED_PRECONDITION", msg
    assert f"{pb_} frozen by an earlier attempt at group snapshot {G} still cannot be " \
        "thawed" in msg
    assert len(refused) == 2 and Path(path).read_text(encoding="utf-8") == kept
    assert lab.host.frozen == {lab.numbers(B)} and lab.members() == {}
    # Once B thaws, the retry drops the old journal and takes the group.
    monkeypatch.undo()
    lab.made("g", A, B)
    assert not lab.host.frozen and lab.journals() == []
    assert set(lab.members()) == {member(A), member(B)}


def test_a_start_whose_thaw_fails_keeps_the_journal(
        mounted: tuple[Lab, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    lab, _pa, pb_ = mounted
    stuck_take(lab, monkeypatch, pb_)
    restart(lab)  # the thaw fails again: kept for the next start
    assert lab.journals() == [JOURNAL_PREFIX + G] and lab.host.frozen == {lab.numbers(B)}
    monkeypatch.undo()
    restart(lab)
    assert lab.journals() == [] and not lab.host.frozen
