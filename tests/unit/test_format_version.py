"""The on-disk format (docs/on-disk-format.md): a volume, snapshot or state
file of a newer csi-local's format is never acted on.

The servicers over the fake host, one table for every RPC: each row puts an
LV of format 2 where the request acts (this version's format is 1) and
checks that the RPC refuses with FAILED_PRECONDITION naming both formats,
that nothing but the look-up ran (no mkfs, mount, lvcreate, lvextend,
lvremove, lvchange) and that no LV, mount or state record changed. The
RPCs that only read (listings, conditions, stats) or only undo what is
mounted (unstage, unpublish: a node rolled back must be able to drain)
still answer: a row each. Then what a new LV carries while the format is 1
(no tag) and once it is raised, the state file's refusal to start, and
csi-local-dhv's refusals.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi import server as server_mod
from csi_local.csi.group_controller_servicer import GroupControllerServicer
from csi_local.errors import FormatTooNew
from csi_local.nodestate import state_file
from csi_local.nodestate.state_file import StateStore
from csi_local.storage.lvm import LogicalVolume
from csi_local.version import __version__
from csi_local.volumes import format_version, naming
from csi_local.volumes import host_volume_names as hvn
from csi_local.volumes.group_snapshots import GroupSnapshots
from csi_local.volumes.naming import Source, SourceKind
from csi_local.volumes.node_records import VolumeRecord
from csi_local.volumes.pool import Pools
from tests.dhvharness import failed, run
from tests.unit import table
from tests.unit.servicers import GiB, Node, block_cap, call, make_node, mount_cap, vol_id
from tests.unit.table import Case
from tests.unit.test_dhv_clones import (
    SNAP,
    SRC,
    Dhv,
    make,
    refused,
    snapshot,
    source,
    write_config,
)
from tests.unit.test_dhv_clones import state as dhv_state

V, V2 = vol_id("vol"), vol_id("vol2")
NEW = vol_id("new")  # what CreateVolume rows ask for (name "new")
S = naming.snapshot_id_for("snap")  # what CreateSnapshot rows ask for (name "snap")
G = naming.group_id_for("g")
KIND_V = f"{naming.TAG_KIND}={naming.KIND_VOLUME}"
KIND_S = f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}"
NEWER = f"{naming.TAG_FORMAT}=2"
REFUSED = "is of on-disk format 2 (csi-local.format), newer than format 1"
EXT4 = mount_cap()


# the node, with its GroupController -----------------------------------------------------


@dataclasses.dataclass
class World:
    n: Node
    gc: GroupControllerServicer

    def path(self, name: str) -> str:
        return self.n.path(name)


def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    n = make_node(tmp_path, monkeypatch)
    groups = GroupSnapshots(n.backend.pools, n.backend.fs, n.backend.host, n.backend.freezes,
                            legacy_journal_dir=n.backend.config.state_dir)
    return World(n, GroupControllerServicer(n.backend, groups))


def send(w: World, method: str, request: Any) -> tuple[str, Any]:
    for servicer in (w.n.controller, w.n.node, w.gc):
        if hasattr(servicer, method) and method in type(servicer).__dict__:
            return call(getattr(servicer, method), request)
    raise AssertionError(f"no servicer has {method}")


def kept(w: World) -> dict[str, object]:
    host = w.n.host
    return {
        "lvs": {name: (lv.size, frozenset(lv.tags), lv.active, lv.content.fs)
                for name, lv in host.lvs.items()},
        "mounts": (host.mounts(), dict(host.loops)),
        "state": w.n.state.all(),
    }


TABLE = table.Table[World](send=send, host=lambda w: w.n.host,
                           locks=lambda w: w.n.backend.locks, kept=kept)


# setups ---------------------------------------------------------------------------------

Setup = Callable[[World], object]
W = TypeVar("W")  # a CSI World or a host volume plugin's Dhv


def chain(*steps: Callable[[W], object]) -> Callable[[W], None]:
    """The steps, in order."""
    def run(w: W) -> None:
        for step in steps:
            step(w)
    return run


def ok(method: str, request: Any) -> Setup:
    def run(w: World) -> None:
        code, reply = send(w, method, request(w) if callable(request) else request)
        assert code == "OK", reply
    return run


def volume(vid: str = V, fs: str | None = "ext4", tags: Sequence[str] = ()) -> Setup:
    """A volume that was staged and written before (it holds `fs`)."""
    def run(w: World) -> None:
        lv = w.n.host.add_lv(vid, GiB, tags=[KIND_V, f"{naming.TAG_SIZE}={GiB}", *tags], fs=fs)
        lv.content.written = True
    return run


def snap(sid: str = S, of: str = V, tags: Sequence[str] = ()) -> Setup:
    return lambda w: w.n.host.add_lv(sid, GiB, tags=[KIND_S, Source(SourceKind.VOLUME, of).tag(),
                                                     *tags], active=False, skip=True)


def newer(name: str, fmt: str = "2") -> Setup:
    """`name` retagged by a newer csi-local: of format `fmt`."""
    return lambda w: w.n.host.lvs[name].tags.add(f"{naming.TAG_FORMAT}={fmt}")


def stage(vid: str = V, cap: pb.VolumeCapability = EXT4) -> Callable[[World], Any]:
    return lambda w: pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=w.path("stage"), volume_capability=cap)


def publish(vid: str = V, cap: pb.VolumeCapability = EXT4) -> Callable[[World], Any]:
    return lambda w: pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=w.path("stage"), target_path=w.path("target"),
        volume_capability=cap)


def staged(vid: str = V, cap: pb.VolumeCapability = EXT4) -> Setup:
    return ok("NodeStageVolume", stage(vid, cap))


def published(vid: str = V, cap: pb.VolumeCapability = EXT4) -> Setup:
    return ok("NodePublishVolume", publish(vid, cap))


def group_of(*vids: str) -> Setup:
    return ok("CreateVolumeGroupSnapshot",
              pb.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=vids))


def expand_node(w: World) -> pb.NodeExpandVolumeRequest:
    return pb.NodeExpandVolumeRequest(volume_id=V, volume_path=w.path("stage"),
                                      capacity_range=pb.CapacityRange(required_bytes=2 * GiB))


def cv(**source: str) -> pb.CreateVolumeRequest:
    content = None
    if "snapshot" in source:
        content = pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=source["snapshot"]))
    elif "volume" in source:
        content = pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=source["volume"]))
    return pb.CreateVolumeRequest(name="new", volume_capabilities=[EXT4],
                                  capacity_range=pb.CapacityRange(required_bytes=GiB),
                                  volume_content_source=content)


def row(id: str, method: str, request: Any, setup: Setup, code: str = "FAILED_PRECONDITION",
        says: str = REFUSED, **kw: Any) -> Any:
    return table.row(id, request, code, says if code != "OK" else "", setup=setup,
                     method=method, **kw)


def unmounted(*names: str) -> Callable[[World, Any], None]:
    def check(w: World, _: Any) -> None:
        for name in names:
            assert not w.n.host.is_mount_point(w.path(name)), name
    return check


STAGED_NEWER = chain(volume(), staged(), newer(V))
PUBLISHED_NEWER = chain(volume(), staged(), published(), newer(V))

ROWS = [
    # Every RPC that changes a volume or snapshot, copies it, or answers a
    # retry with it: refused, nothing run but the look-up.
    row("stage", "NodeStageVolume", stage(), chain(volume(), newer(V)), ran="(lvs)"),
    row("stage-never-formats-a-fresh-one", "NodeStageVolume", stage(),
        chain(volume(fs=None), newer(V)), ran="(lvs)"),
    row("stage-never-activates", "NodeStageVolume", stage(),
        chain(volume(), newer(V), lambda w: w.n.host.run(
            ["lvchange", "--activate", "n", f"vg0/{V}"])), ran="(lvs)"),
    row("stage-block", "NodeStageVolume", stage(cap=block_cap()), chain(volume(), newer(V)),
        ran="(lvs)"),
    row("stage-format-that-is-no-number", "NodeStageVolume", stage(),
        chain(volume(), newer(V, "2b")), says="is of on-disk format 2b", ran="(lvs)"),
    # Staged by a newer csi-local before the node was rolled back.
    row("publish", "NodePublishVolume", publish(), STAGED_NEWER, ran="(lvs)"),
    row("publish-block", "NodePublishVolume", publish(cap=block_cap()),
        chain(volume(), staged(cap=block_cap()), newer(V)), ran="(lvs)"),
    row("node-expand", "NodeExpandVolume", expand_node, STAGED_NEWER, ran="lvs"),
    row("controller-expand", "ControllerExpandVolume",
        pb.ControllerExpandVolumeRequest(volume_id=V, capacity_range=pb.CapacityRange(
            required_bytes=2 * GiB)), chain(volume(), newer(V)), ran="lvs"),
    row("delete-volume", "DeleteVolume", pb.DeleteVolumeRequest(volume_id=V),
        chain(volume(), newer(V)), ran="(lvs)"),
    row("create-snapshot-of-it", "CreateSnapshot",
        pb.CreateSnapshotRequest(name="snap", source_volume_id=V),
        chain(volume(), newer(V)), ran="lvs"),
    row("create-snapshot-retry-finds-a-newer-one", "CreateSnapshot",
        pb.CreateSnapshotRequest(name="snap", source_volume_id=V),
        chain(volume(), snap(), newer(S)), ran="lvs", says="snapshot vg0/"),
    row("delete-snapshot", "DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=S),
        chain(volume(), snap(), newer(S)), ran="lvs"),
    row("clone-from-it", "CreateVolume", cv(volume=V), chain(volume(), newer(V)), ran="lvs"),
    row("restore-from-it", "CreateVolume", cv(snapshot=S), chain(volume(), snap(), newer(S)),
        ran="lvs"),
    row("create-volume-retry-finds-a-newer-one", "CreateVolume", cv(),
        chain(volume(NEW), newer(NEW)), ran="(lvs)"),
    row("group-snapshot-of-it", "CreateVolumeGroupSnapshot",
        pb.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=[V, V2]),
        chain(volume(), volume(V2), newer(V2)), ran="lvs"),
    row("group-snapshot-retry-finds-a-newer-member", "CreateVolumeGroupSnapshot",
        pb.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=[V, V2]),
        chain(volume(), volume(V2), group_of(V, V2), newer(naming.member_snapshot_id(G, V))),
        ran="lvs"),
    row("delete-group-snapshot-none-removed", "DeleteVolumeGroupSnapshot",
        pb.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=G),
        chain(volume(), volume(V2), group_of(V, V2), newer(naming.member_snapshot_id(G, V2))),
        ran="lvs"),
    # This version's own format, written out: acted on as ever.
    row("format-1-tag-staged", "NodeStageVolume", stage(), chain(volume(), newer(V, "1")),
        code="OK", ran="(lvs) blkid mount", changes="mounts state"),
    row("format-1-tag-deleted", "DeleteVolume", pb.DeleteVolumeRequest(volume_id=V),
        chain(volume(), newer(V, "1")), code="OK", ran="(lvs) lvremove", changes="lvs"),
    # Reading it stays allowed, and so does undoing what is mounted.
    row("list-volumes", "ListVolumes", pb.ListVolumesRequest(), chain(volume(), newer(V)),
        code="OK", ran=None),
    row("controller-get-volume", "ControllerGetVolume",
        pb.ControllerGetVolumeRequest(volume_id=V), chain(volume(), newer(V)), code="OK",
        ran=None),
    row("validate-capabilities", "ValidateVolumeCapabilities",
        pb.ValidateVolumeCapabilitiesRequest(volume_id=V, volume_capabilities=[EXT4]),
        chain(volume(), newer(V)), code="OK", ran=None),
    row("list-snapshots", "ListSnapshots", pb.ListSnapshotsRequest(),
        chain(volume(), snap(), newer(S)), code="OK", ran=None),
    row("get-snapshot", "GetSnapshot", pb.GetSnapshotRequest(snapshot_id=S),
        chain(volume(), snap(), newer(S)), code="OK", ran=None),
    row("get-group-snapshot", "GetVolumeGroupSnapshot",
        pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=G),
        chain(volume(), volume(V2), group_of(V, V2), newer(naming.member_snapshot_id(G, V))),
        code="OK", ran=None),
    row("volume-stats", "NodeGetVolumeStats",
        lambda w: pb.NodeGetVolumeStatsRequest(volume_id=V, volume_path=w.path("stage")),
        STAGED_NEWER, code="OK", ran=None),
    row("unpublish", "NodeUnpublishVolume",
        lambda w: pb.NodeUnpublishVolumeRequest(volume_id=V, target_path=w.path("target")),
        PUBLISHED_NEWER, code="OK", ran="umount", changes="mounts state",
        check=unmounted("target")),
    row("unstage", "NodeUnstageVolume",
        lambda w: pb.NodeUnstageVolumeRequest(volume_id=V, staging_target_path=w.path("stage")),
        STAGED_NEWER, code="OK", ran="umount", changes="mounts state",
        check=unmounted("stage")),
]


@pytest.mark.parametrize("case", ROWS)
@pytest.mark.usefixtures("reads")  # on the committed metadata and on `lvs` alike
def test_rpcs_and_a_newer_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 case: Case) -> None:
    TABLE.run(world(tmp_path, monkeypatch), case)


def test_the_refusal_names_both_formats_and_the_version(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(tmp_path, monkeypatch)
    chain(volume(), newer(V, "7"))(w)
    code, message = send(w, "DeleteVolume", pb.DeleteVolumeRequest(volume_id=V))
    assert code == "FAILED_PRECONDITION"
    assert message == (
        f"volume vg0/{V} is of on-disk format 7 (csi-local.format), newer than format 1, the "
        f"newest this csi-local ({__version__}) knows: a newer csi-local made or changed it. "
        "Refusing to touch it; upgrade csi-local on this node (docs/on-disk-format.md)")


# what a new LV carries ----------------------------------------------------------------------


def _formats(w: World) -> dict[str, set[str]]:
    return {name: {t for t in lv.tags if t.startswith(naming.TAG_FORMAT)}
            for name, lv in w.n.host.lvs.items() if name != "pool0"}


def _make_everything(w: World) -> None:
    chain(ok("CreateVolume", cv()),
          ok("CreateSnapshot", pb.CreateSnapshotRequest(name="snap", source_volume_id=NEW)),
          ok("CreateVolume", pb.CreateVolumeRequest(
              name="clone", volume_capabilities=[EXT4],
              volume_content_source=pb.VolumeContentSource(
                  volume=pb.VolumeContentSource.VolumeSource(volume_id=NEW)))),
          ok("CreateVolumeGroupSnapshot",
             pb.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=[NEW])))(w)


def test_format_1_writes_no_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the format is 1 a new LV's tags are what they always were: no
    byte more in the VG's metadata area, nothing an older version meets anew."""
    w = world(tmp_path, monkeypatch)
    _make_everything(w)
    assert len(_formats(w)) == 4 and not any(_formats(w).values())


def test_a_raised_format_is_written_on_every_new_lv_and_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the format is raised, each new volume, snapshot, clone and group
    member carries it (a copy takes the new LV's, not its source's), and the
    version that wrote it acts on them as on any other."""
    monkeypatch.setattr(naming, "FORMAT", 2)
    w = world(tmp_path, monkeypatch)
    chain(volume(V), ok("CreateSnapshot", pb.CreateSnapshotRequest(
        name="old", source_volume_id=V)))(w)
    _make_everything(w)
    got = _formats(w)
    assert got.pop(V) == set()  # made before: untagged, format 1
    assert all(tags == {NEWER} for tags in got.values()), got
    assert len(got) == 5
    chain(staged(NEW), published(NEW))(w)  # a format-2 plugin takes its own volumes


def test_a_format_3_volume_is_refused_by_a_format_2_plugin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(naming, "FORMAT", 2)
    w = world(tmp_path, monkeypatch)
    chain(volume(), newer(V, "3"))(w)
    code, message = send(w, "NodeStageVolume", stage()(w))
    assert code == "FAILED_PRECONDITION"
    assert "is of on-disk format 3 (csi-local.format), newer than format 2" in message


def _lv(*tags: str) -> LogicalVolume:
    return LogicalVolume(name="lv", vg="vg", size=GiB, tags=frozenset(tags), attr="Vwi-a-tz--",
                         pool="pool", origin="", path="/dev/vg/lv", data_percent=None,
                         metadata_percent=None, created=0, health="", kernel_major=-1,
                         kernel_minor=-1)


@pytest.mark.parametrize(("tags", "found"), [
    ((), 1),
    (("csi-local.format=1",), 1),
    (("csi-local.format=3",), 3),
    (("csi-local.format=3", "csi-local.format=2"), 3),  # the highest counts
    (("csi-local.format=x",), "x"),
    (("csi-local.format=",), ""),
    (("csi-local.format=٣",), "٣"),  # a digit, but not an ASCII one
    (("csi-local.formats=9", "csi-local-dhv.format=9"), 1),  # other tags
])
def test_lv_format(tags: tuple[str, ...], found: int | str) -> None:
    assert format_version.lv_format(_lv(*tags), naming.TAG_FORMAT) == found


def test_format_tags() -> None:
    assert format_version.format_tags(naming.TAG_FORMAT, 1) == []
    assert format_version.format_tags(naming.TAG_FORMAT, 4) == ["csi-local.format=4"]


# the state file --------------------------------------------------------------------------------


def _state(tmp_path: Path, version: object) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(exist_ok=True)
    path = directory / state_file.STATE_FILE
    path.write_text(json.dumps({"version": version, "volumes": {
        V: {"publishes": {}, "publish_count": 0,
            "staging": {"path": "/s", "access_type": "mount", "fs_type": "ext4",
                        "mount_flags": [], "access_mode": 1, "flags_known": True}}}}))
    return path


def test_a_newer_state_file_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    path = _state(tmp_path, 2)
    before = path.read_bytes()
    rebuilt: list[bool] = []

    def rebuild() -> dict[str, VolumeRecord]:
        rebuilt.append(True)
        return {}

    with pytest.raises(FormatTooNew) as err:
        StateStore(str(path.parent), rebuild=rebuild)
    assert err.value.message.startswith(
        f"state file {path} is of format 2, newer than format 1, the newest this csi-local "
        f"({__version__}) reads")
    assert path.read_bytes() == before and not rebuilt
    assert sorted(os.listdir(path.parent)) == sorted([state_file.LOCK_FILE,
                                                      state_file.STATE_FILE])
    _state(tmp_path, 1)
    store = StateStore(str(path.parent))  # the directory was let go
    assert store.get(V).staging is not None
    store.close()


def test_a_corrupt_state_file_is_still_set_aside(tmp_path: Path) -> None:
    """Only a newer format stops the plugin; a file that is not ours at all
    (version 0, no version) is set aside and rebuilt as before."""
    path = _state(tmp_path, 0)
    store = StateStore(str(path.parent), rebuild=dict)
    store.close()
    assert (path.parent / (state_file.STATE_FILE + ".corrupt")).exists()


def test_the_plugin_refuses_to_start_on_a_newer_state_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from csi_local.config import Config

    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    path = _state(tmp_path, 2)
    config = Config(endpoint=f"unix://{tmp_path}/csi.sock", node_id="n", volume_group="vg0",
                    thin_pool="pool0", state_dir=str(path.parent),
                    lock_dir=str(tmp_path / "locks"), lvm_shell=False)
    with pytest.raises(server_mod.ServerError, match="is of format 2, newer than format 1"):
        server_mod.serve(config)
    assert json.loads(path.read_text())["version"] == 2
    assert not Path(config.socket).exists()


# csi-local-dhv --------------------------------------------------------------------------------

HV_NEWER = f"{hvn.TAG_FORMAT}=2"
HV_REFUSED = "is of on-disk format 2 (csi-local-dhv.format), newer than format 1"


def hv_newer(lv_name: str) -> Callable[[Dhv], None]:
    return lambda d: d.host.lvs[lv_name].tags.add(HV_NEWER)


def _volume_lv(d: Dhv) -> str:
    return d.lv(SRC).name


def _snap_lv(d: Dhv) -> str:
    return d.snap_lv().name


DHV_ROWS = [
    # (id, setup, the newer LV, the action)
    pytest.param(source(), _volume_lv, lambda d: d.create(SRC, name="golden",
                                                          cap_min=320 << 20),
                 id="create-again"),
    pytest.param(source(), _volume_lv, lambda d: d.create(SRC, name="golden",
                                                          cap_min=640 << 20),
                 id="grow"),
    pytest.param(source(), _volume_lv, lambda d: d.delete(SRC), id="delete"),
    pytest.param(source(), _volume_lv, lambda d: d.plugin().snapshot_create(SRC, SNAP),
                 id="snapshot-of-it"),
    pytest.param(chain(source(), snapshot()), _snap_lv,
                 lambda d: d.plugin().snapshot_create(SRC, SNAP), id="snapshot-create-again"),
    pytest.param(chain(source(), snapshot()), _snap_lv,
                 lambda d: d.plugin().snapshot_delete(SNAP), id="snapshot-delete"),
    pytest.param(source(), _volume_lv,
                 lambda d: d.create("clone-1", params={"source_volume": SRC}),
                 id="clone-from-it"),
    pytest.param(chain(source(), snapshot()), _snap_lv,
                 lambda d: d.create("clone-1", params={"source_snapshot": SNAP}),
                 id="clone-from-its-snapshot"),
]


@pytest.mark.parametrize(("setup", "which", "action"), DHV_ROWS)
def test_dhv_and_a_newer_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                setup: Callable[[Dhv], object], which: Callable[[Dhv], str],
                                action: Callable[[Dhv], object]) -> None:
    d = make(tmp_path, monkeypatch)
    setup(d)
    hv_newer(which(d))(d)
    before = dhv_state(d)
    d.host.calls.clear()
    assert HV_REFUSED in refused(lambda: action(d))
    assert dhv_state(d) == before
    assert d.tools() <= {"lvs"}, d.host.calls


def test_dhv_tells_nomad_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nomad's delete gets the refusal as its error, exit status 1, the LV kept."""
    from csi_local.dhv import host_volumes

    d = make(tmp_path, monkeypatch)
    source()(d)
    hv_newer(_volume_lv(d))(d)
    write_config(Path(d.nomad.plugin_dir) / "csi-local-dhv.json", d)
    real = host_volumes.HostVolumes
    monkeypatch.setattr(host_volumes, "HostVolumes",
                        lambda config: real(config, runner=d.host, host=d.host))
    res = run(d.nomad, "delete", SRC, monkeypatch)
    failed(res, HV_REFUSED, "upgrade csi-local")
    assert d.has_lv(SRC)


def test_dhv_writes_a_raised_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hvn, "FORMAT", 2)
    d = make(tmp_path, monkeypatch)
    chain(source(), snapshot())(d)
    d.create("clone-1", params={"source_snapshot": SNAP})
    for lv in (d.lv(SRC), d.snap_lv(), d.lv("clone-1")):
        assert HV_NEWER in lv.tags, lv.tags
    d.delete("clone-1")  # and takes its own


def test_dhv_writes_no_format_tag_while_it_is_1(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = make(tmp_path, monkeypatch)
    chain(source(), snapshot())(d)
    assert not [t for lv in d.host.lvs.values() for t in lv.tags if "format" in t]
