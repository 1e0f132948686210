"""ControllerServicer, RPC by RPC, on a FakeHost: every error branch and the main replies.

Each table row names one branch of csi_local/csi/controller_servicer.py (or of the volume,
pool, sizes and validation layers whose errors pass through it) and the code
the CSI spec's error table gives it, as the server's interceptor would send
it. Every row also checks what must not happen: which LVM tools ran (none at
all for a request refused on its face; never an lvcreate, lvextend or
lvremove that the branch forbids) and that no LV was created, removed, grown
or retagged. The success tests check the replies and the LVs behind them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.config import DEFAULT_DRIVER_NAME
from csi_local.csi.controller_servicer import ControllerServicer
from csi_local.host import filesystem_rules as fsrules
from csi_local.storage import vg_text
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import naming
from csi_local.volumes.lock_keys import pool_key, volume_key
from csi_local.volumes.naming import Source, SourceKind
from csi_local.volumes.node_records import AccessType, Publish, Staging
from csi_local.volumes.pool import COMMAND_TEXT_MAX, LV_TEXT_MAX, THIN_DEVICE_ID_MAX, PoolPolicy
from tests.unit.fakehost import FakeLv
from tests.unit.servicers import (
    GiB,
    MiB,
    Node,
    Setup,
    block_cap,
    call,
    chain,
    make_node,
    mount_cap,
    nothing,
    vol_id,
)
from tests.unit.table import Case, Table, expected, row

# Every test twice: reading the committed metadata, and every read an `lvs`.
pytestmark = pytest.mark.usefixtures("reads")

Mode = pb.VolumeCapability.AccessMode
RPC = pb.ControllerServiceCapability.RPC
TOPO_KEY = f"topology.{DEFAULT_DRIVER_NAME}/node"
NODE_ID = "node-1"  # make_node's
POOL = "pool0"


def snap_id(name: str) -> str:
    """The snapshot ID CreateSnapshot gives the name `name`."""
    return naming.snapshot_id_for(name)


V = vol_id("vol")  # an existing volume in most rows
V2 = vol_id("vol2")
NEW = vol_id("new")  # the volume CreateVolume rows ask for (name "new")
S = snap_id("snap")  # the snapshot CreateSnapshot rows ask for (name "snap")
S2 = snap_id("snap2")
FOREIGN = "data"  # an LV of the VG that is not a CSI object
KIND_V = f"{naming.TAG_KIND}={naming.KIND_VOLUME}"
KIND_S = f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}"
VG_GONE_STDERR = '  Volume group "vg0" not found\n  Cannot process volume group vg0\n'


# setups ------------------------------------------------------------------------------



def add_volume(n: Node, vid: str = V, size: int = GiB, *, requested: int | None = None,
               tags: Sequence[str] = (), active: bool = True) -> FakeLv:
    """A CSI volume as CreateVolume would have left it."""
    return n.host.add_lv(vid, size, active=active,
                         tags=[KIND_V, f"{naming.TAG_SIZE}={requested or size}", *tags])


def add_snapshot(n: Node, sid: str = S, source: str = V, size: int = GiB) -> FakeLv:
    """A CSI snapshot of `source` as CreateSnapshot would have left it."""
    return n.host.add_lv(sid, size, tags=[KIND_S, Source(SourceKind.VOLUME, source).tag()],
                         active=False, skip=True,
                         origin=source if source in n.host.lvs else "")


def vol(vid: str = V, size: int = GiB, **kw: Any) -> Setup:
    return lambda n: add_volume(n, vid, size, **kw)


def snap(sid: str = S, source: str = V, size: int = GiB) -> Setup:
    return lambda n: add_snapshot(n, sid, source, size)


def plain_lv(name: str = FOREIGN, size: int = GiB, tags: Sequence[str] = ()) -> Setup:
    """An LV that is not a CSI object (no kind tag, or a foreign name)."""
    return lambda n: n.host.add_lv(name, size, tags=tags)


def vg_gone(n: Node) -> None:
    n.host.vg_present = False


def pv_unreadable(n: Node) -> None:
    """The VG's PV cannot be read: every read is LVM's, on either path."""
    n.host.vgs["vg0"].pv_unreadable = True


def fail(tool: str, stderr: str = "  unexpected failure\n", rc: int = 5) -> Setup:
    return lambda n: n.host.fail_next((tool,), rc, stderr)


def stage_dir(n: Node) -> str:
    path = n.path("stage")
    Path(path).mkdir(exist_ok=True)
    return path


def staged(vid: str = V, access: AccessType = AccessType.MOUNT) -> Setup:
    """Volume `vid` staged: recorded, and (when its LV exists) mounted as the node
    leaves it, since a snapshot's flush reads the kernel's mount table."""
    def setup(n: Node) -> None:
        path = stage_dir(n)
        mount = access is AccessType.MOUNT
        n.state.set_staging(vid, Staging(path, access, "ext4" if mount else ""))
        if vid not in n.host.lvs:
            return
        device = n.host.lv_path(vid)
        if mount:
            n.host.set_content(vid, "ext4")
            n.host.run(["mount", "-t", "ext4", device, path])
        else:
            target = Path(path, vid)
            target.touch()
            n.host.run(["mount", "--bind", device, str(target)])
    return setup


def published(vid: str = V) -> Setup:
    return lambda n: n.state.add_publish(vid, n.path("target"), Publish())


def mda_left(free: int) -> Setup:
    """The VG's metadata area with `free` bytes left for more text (LVM's own
    refusal in the fake still comes only when a section does not fit)."""
    def setup(n: Node) -> None:
        fvg = n.host.vgs[n.host.vg]
        fvg.mda_padding += vg_text.max_text_size(fvg.mda_size) - fvg.mda_text - free
    return setup


def thin_id_at(top: int, vid: str = V) -> Setup:
    """Volume `vid`, made with thin device ID `top` (LVM gives the next one top + 1)."""
    def setup(n: Node) -> None:
        add_volume(n, vid, GiB)
        n.host.lv(vid).thin_id = top
    return setup


def pool_usage(data: float = 0.0, metadata: float = 0.0) -> Setup:
    """The pool's data and metadata fill, in percent."""
    def setup(n: Node) -> None:
        pool = n.host.lv(POOL)
        pool.data_percent, pool.metadata_percent = data, metadata
    return setup




# the row runner -----------------------------------------------------------------------


def lv_state(n: Node) -> dict[str, tuple[int, frozenset[str], bool]]:
    return {name: (lv.size, frozenset(lv.tags), lv.active) for name, lv in n.host.lvs.items()}


def tools(n: Node) -> set[str]:
    return {c[0] for c in n.host.calls}


def ran(n: Node, named: str) -> set[str]:
    """The tools of `named` that run on this node (table.expected: a tool in
    parentheses only when the node does not read the committed metadata)."""
    return set(expected(named, n.host.pv_metadata))


# Every row, OK ones too, leaves the LVs as they were: an LV created, removed,
# grown or retagged fails it.
TABLE = Table[Node](
    send=lambda n, method, request: call(getattr(n.controller, method), request),
    host=lambda n: n.host, locks=lambda n: n.backend.locks,
    kept=lambda n: {"lvs": lv_state(n)})


def run_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
            case: Case) -> tuple[Node, Any]:
    """Run one row: the code, the message, the tools that ran, and no LV changed."""
    n = make_node(tmp_path, monkeypatch, **case.world)
    return n, TABLE.run(n, case, method)


# requests ---------------------------------------------------------------------------


def topology(*node_ids: str) -> list[pb.Topology]:
    return [pb.Topology(segments={TOPO_KEY: i}) for i in node_ids]


def cv(name: str = "new", caps: Sequence[pb.VolumeCapability] | None = None, *,
       rng: tuple[int, int] | None = None, params: dict[str, str] | None = None,
       snapshot: str | None = None, volume: str | None = None,
       requisite: Sequence[str] | None = None, preferred: Sequence[str] = (),
       empty_source: bool = False) -> pb.CreateVolumeRequest:
    source = None
    if snapshot is not None:
        source = pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot))
    elif volume is not None:
        source = pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=volume))
    elif empty_source:
        source = pb.VolumeContentSource()
    topo = None
    if requisite is not None or preferred:
        topo = pb.TopologyRequirement(requisite=topology(*(requisite or ())),
                                      preferred=topology(*preferred))
    return pb.CreateVolumeRequest(
        name=name,
        volume_capabilities=[mount_cap()] if caps is None else caps,
        capacity_range=pb.CapacityRange(required_bytes=rng[0], limit_bytes=rng[1])
        if rng is not None else None,
        parameters=params or {},
        volume_content_source=source,
        accessibility_requirements=topo,
    )


def ce(vid: str = V, rng: tuple[int, int] | None = (2 * GiB, 0),
       cap: pb.VolumeCapability | None = None) -> pb.ControllerExpandVolumeRequest:
    return pb.ControllerExpandVolumeRequest(
        volume_id=vid, volume_capability=cap,
        capacity_range=pb.CapacityRange(required_bytes=rng[0], limit_bytes=rng[1])
        if rng is not None else None)


def cs(name: str = "snap", source: str = V,
       params: dict[str, str] | None = None) -> pb.CreateSnapshotRequest:
    return pb.CreateSnapshotRequest(name=name, source_volume_id=source, parameters=params or {})


def no_type_cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))


def no_mode_cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(fs_type="ext4"))


# CreateVolume -------------------------------------------------------------------------

CREATE_ERRORS = [
    # The request on its face: refused before any lock or command.
    row("missing-name", cv(name=""), "INVALID_ARGUMENT", "name is required"),
    row("missing-capabilities", cv(caps=[]), "INVALID_ARGUMENT",
        "volume_capabilities is required"),
    row("capability-without-access-type", cv(caps=[no_type_cap()]), "INVALID_ARGUMENT",
        "needs an access type"),
    row("capability-without-access-mode", cv(caps=[no_mode_cap()]), "INVALID_ARGUMENT",
        "needs an access mode"),
    row("multi-node-writer", cv(caps=[mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)]),
        "INVALID_ARGUMENT", "MULTI_NODE_MULTI_WRITER is not supported"),
    row("multi-node-reader-block", cv(caps=[block_cap(Mode.MULTI_NODE_READER_ONLY)]),
        "INVALID_ARGUMENT", "MULTI_NODE_READER_ONLY is not supported"),
    row("unsupported-fs", cv(caps=[mount_cap("ntfs")]), "INVALID_ARGUMENT",
        "fs type 'ntfs' is not supported"),
    row("forbidden-mount-flag", cv(caps=[mount_cap(flags=("ro", "bind"))]),
        "INVALID_ARGUMENT", "mount flag refused"),
    row("forbidden-mount-flag-prefix", cv(caps=[mount_cap(flags=("X-mount.mkdir",))]),
        "INVALID_ARGUMENT", "is not allowed"),
    row("malformed-mount-flag", cv(caps=[mount_cap(flags=("rw,,noatime",))]),
        "INVALID_ARGUMENT", "invalid mount option"),
    row("one-bad-capability-of-two", cv(caps=[block_cap(), mount_cap("ntfs")]),
        "INVALID_ARGUMENT", "'ntfs'"),
    row("unknown-parameter", cv(params={"csi.storage.k8s.io/pvc/name": "x", "fs": "ext4"}),
        "INVALID_ARGUMENT", "unknown parameter 'fs'"),
    row("requisite-topology-excludes-node", cv(requisite=["node-2"], preferred=[NODE_ID]),
        "RESOURCE_EXHAUSTED", "requisite topology excludes this node"),
    row("content-source-without-type", cv(empty_source=True), "INVALID_ARGUMENT",
        "needs a snapshot or a volume"),
    row("malformed-snapshot-source-id", cv(snapshot="../x"), "INVALID_ARGUMENT",
        "volume_content_source.snapshot_id '../x' is not a valid ID"),
    row("empty-volume-source-id", cv(volume=""), "INVALID_ARGUMENT",
        "volume_content_source.volume_id is required"),
    # A negative size is wrong whatever LVM says: refused before anything runs.
    row("negative-required", cv(rng=(-1, 0)), "INVALID_ARGUMENT", "must not be negative"),
    row("negative-limit", cv(rng=(0, -1)), "INVALID_ARGUMENT", "must not be negative"),
    # Sizes: checked against the report's extent size, under the pool lock.
    row("required-above-limit", cv(rng=(2 * GiB, GiB)), "OUT_OF_RANGE",
        "exceed the limit", ran="(lvs)"),
    row("limit-below-one-extent", cv(rng=(0, MiB)), "OUT_OF_RANGE", "whole extents",
        ran="(lvs)"),
    row("required-rounds-up-past-limit", cv(rng=(5 * MiB, 6 * MiB)), "OUT_OF_RANGE",
        "whole extents", ran="(lvs)"),
    row("limit-below-xfs-minimum", cv(caps=[mount_cap("xfs")], rng=(0, 200 * MiB)),
        "OUT_OF_RANGE", f"at least {300 * MiB} bytes", ran="(lvs)"),
    row("limit-below-btrfs-minimum", cv(caps=[mount_cap("btrfs")], rng=(0, 100 * MiB)),
        "OUT_OF_RANGE", f"at least {128 * MiB} bytes", ran="(lvs)"),
    row("limit-below-xfs-minimum-with-block-too",
        cv(caps=[block_cap(), mount_cap("xfs")], rng=(MiB, 100 * MiB)),
        "OUT_OF_RANGE", f"at least {300 * MiB} bytes", ran="(lvs)"),
    row("limit-below-source-snapshot", cv(snapshot=S, rng=(0, GiB)), "OUT_OF_RANGE",
        "smaller than the source's", setup=chain(vol(size=2 * GiB), snap(size=2 * GiB)),
        ran="lvs"),
    row("limit-below-source-volume", cv(volume=V, rng=(GiB, GiB)), "OUT_OF_RANGE",
        "smaller than the source's", setup=vol(size=2 * GiB), ran="lvs"),
    # Room in the pool: checked before any lvcreate.
    row("pool-full", cv(rng=(11 * GiB, 0)), "RESOURCE_EXHAUSTED", "has room for", ran="(lvs)"),
    row("pool-full-with-volumes", cv(rng=(3 * GiB, 0)), "RESOURCE_EXHAUSTED",
        "has room for 2147483648", setup=vol(size=8 * GiB), ran="(lvs)"),
    row("pool-full-over-ratio", cv(rng=(16 * GiB, 0)), "RESOURCE_EXHAUSTED",
        "over-provisioning ratio 1.5", ran="(lvs)", ratio=1.5),
    row("pool-full-clone", cv(volume=V), "RESOURCE_EXHAUSTED", "has room for",
        setup=vol(size=6 * GiB), ran="lvs"),
    row("pool-full-restore-counts-snapshots", cv(snapshot=S), "RESOURCE_EXHAUSTED",
        "has room for", setup=chain(vol(size=4 * GiB), snap(size=4 * GiB)), ran="lvs"),
    row("pool-full-restore-bigger", cv(snapshot=S, rng=(9 * GiB, 0)), "RESOURCE_EXHAUSTED",
        "has room for", setup=chain(vol(), snap()), ran="lvs"),
    # Above a high-water mark no new volume is made, whatever the room.
    row("pool-above-data-high-water", cv(), "RESOURCE_EXHAUSTED",
        "above its high-water mark: data 90.0% full", setup=pool_usage(data=90.0), ran="(lvs)"),
    row("pool-above-metadata-high-water", cv(), "RESOURCE_EXHAUSTED",
        "metadata 80.0% full (limit 80%)", setup=pool_usage(metadata=80.0), ran="(lvs)",
        policy=PoolPolicy(90.0, 80.0)),
    row("clone-above-high-water", cv(volume=V), "RESOURCE_EXHAUSTED", "high-water mark",
        setup=chain(vol(), pool_usage(data=95.0)), ran="lvs"),
    row("restore-above-high-water", cv(snapshot=S), "RESOURCE_EXHAUSTED", "high-water mark",
        setup=chain(vol(), snap(), pool_usage(metadata=99.0)), ran="lvs"),
    # No room for another LV in the VG's metadata area or the pool's device
    # IDs, whatever the size: refused before lvcreate, LVM never fails half-way.
    row("metadata-area-full", cv(), "RESOURCE_EXHAUSTED",
        "the metadata area of volume group vg0 is", setup=mda_left(LV_TEXT_MAX), ran="(lvs)"),
    row("metadata-area-full-names-the-fix", cv(), "RESOURCE_EXHAUSTED",
        "pvcreate --metadatasize", setup=mda_left(0), ran="(lvs)"),
    row("metadata-area-full-clone", cv(volume=V), "RESOURCE_EXHAUSTED", "metadata area",
        setup=chain(vol(), mda_left(COMMAND_TEXT_MAX)), ran="lvs"),
    row("metadata-area-full-restore", cv(snapshot=S), "RESOURCE_EXHAUSTED", "metadata area",
        setup=chain(vol(), snap(), mda_left(100)), ran="lvs"),
    row("thin-device-ids-used-up", cv(name="other"), "RESOURCE_EXHAUSTED",
        f"has given out device ID {THIN_DEVICE_ID_MAX}",
        setup=thin_id_at(THIN_DEVICE_ID_MAX), ran="(lvs)"),
    # Sources.
    row("source-snapshot-missing", cv(snapshot=S), "NOT_FOUND", f"snapshot '{S}' not found",
        ran="lvs"),
    row("source-volume-missing", cv(volume=V), "NOT_FOUND", f"volume '{V}' not found",
        ran="lvs"),
    row("source-snapshot-is-a-volume", cv(snapshot=V), "NOT_FOUND", "not found",
        setup=vol(), ran="lvs"),
    row("source-volume-is-a-snapshot", cv(volume=S), "NOT_FOUND", "not found",
        setup=chain(vol(), snap()), ran="lvs"),
    row("source-volume-is-foreign-lv", cv(volume=FOREIGN), "NOT_FOUND", "not found",
        setup=plain_lv(), ran="lvs"),
    row("source-volume-is-the-pool", cv(volume=POOL), "NOT_FOUND", "not found", ran="lvs"),
    row("source-snapshot-without-kind-tag", cv(snapshot=S), "NOT_FOUND", "not found",
        setup=plain_lv(S), ran="lvs"),
    # The node's storage.
    row("vg-missing", cv(), "UNAVAILABLE", "volume group vg0 not found", setup=vg_gone,
        ran="lvs"),
    row("pool-lv-missing", cv(), "UNAVAILABLE", "thin pool pool0 not found", ran="(lvs) (vgs)",
        with_pool=False),
    row("pool-lv-not-a-thin-pool", cv(), "FAILED_PRECONDITION", "is not a thin pool",
        setup=plain_lv(POOL), ran="lvs", with_pool=False),
    row("lvcreate-fails", cv(), "INTERNAL", "lvcreate exited 5", setup=fail("lvcreate"),
        ran="(lvs) lvcreate"),
    row("clone-lvcreate-fails", cv(volume=V), "INTERNAL", "lvcreate exited 5",
        setup=chain(vol(), fail("lvcreate")), ran="lvs lvcreate"),
    # A clone bigger than its source whose lvextend fails leaves nothing behind.
    row("restore-lvextend-fails-removes-lv", cv(snapshot=S, rng=(2 * GiB, 0)), "INTERNAL",
        "lvextend exited 5", setup=chain(vol(), snap(), fail("lvextend")),
        ran="lvs lvcreate lvextend lvremove"),
    row("clone-sync-of-staged-source-fails", cv(volume=V), "INTERNAL", "sync exited 1",
        setup=chain(vol(), staged(), fail("sync", rc=1)), ran="lvs sync"),
    # Another operation holds a lock this one needs.
    row("lock-busy-volume", cv(), "ABORTED", "already in progress", busy=volume_key(NEW)),
    row("lock-busy-pool", cv(), "ABORTED", "already in progress", busy=pool_key("vg0", "pool0")),
    row("lock-busy-clone-source", cv(volume=V), "ABORTED", f"volume:{V}", setup=vol(),
        busy=volume_key(V)),
    # The name is taken (the ID is derived from it): incompatible retries.
    row("name-maps-to-non-csi-lv", cv(), "ALREADY_EXISTS", "which is not a volume",
        setup=plain_lv(NEW), ran="(lvs)"),
    row("name-maps-to-lv-of-snapshot-kind", cv(), "ALREADY_EXISTS", "which is not a volume",
        setup=plain_lv(NEW, tags=[KIND_S]), ran="(lvs)"),
    row("retry-needs-more", cv(rng=(2 * GiB, 0)), "ALREADY_EXISTS", "outside the requested",
        setup=vol(NEW), ran="(lvs)"),
    row("retry-allows-less", cv(rng=(0, 512 * MiB)), "ALREADY_EXISTS",
        "outside the requested", setup=vol(NEW), ran="(lvs)"),
    row("retry-by-requested-size-tag", cv(rng=(0, GiB)), "ALREADY_EXISTS",
        f"exists with {2 * GiB} bytes", setup=vol(NEW, GiB, requested=2 * GiB), ran="(lvs)"),
    row("retry-without-size-tag-uses-lv-size", cv(rng=(2 * GiB, 0)), "ALREADY_EXISTS",
        f"exists with {GiB} bytes", setup=plain_lv(NEW, tags=[KIND_V]), ran="(lvs)"),
    row("retry-adds-a-source", cv(snapshot=S), "ALREADY_EXISTS", "another content source",
        setup=chain(vol(), snap(), vol(NEW)), ran="lvs"),
    row("retry-drops-the-source", cv(), "ALREADY_EXISTS", "another content source",
        setup=vol(NEW, tags=[Source(SourceKind.SNAPSHOT, S).tag()]), ran="(lvs)"),
    row("retry-other-source-snapshot", cv(snapshot=S2), "ALREADY_EXISTS",
        "another content source",
        setup=chain(vol(), snap(), snap(S2), vol(NEW, tags=[Source(SourceKind.SNAPSHOT, S).tag()])),
        ran="lvs"),
    row("retry-volume-source-with-same-id-as-snapshot-source", cv(volume=V), "ALREADY_EXISTS",
        "another content source",
        setup=chain(vol(), vol(NEW, tags=[Source(SourceKind.SNAPSHOT, V).tag()])), ran="lvs"),
]


@pytest.mark.parametrize("case", CREATE_ERRORS)
def test_create_volume_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              case: Case) -> None:
    run_row(tmp_path, monkeypatch, "CreateVolume", case)


def test_create_volume_fs_missing_on_node(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: fs != "xfs")
    code, msg = call(n.controller.CreateVolume, cv(caps=[mount_cap("xfs")]))
    assert code == "INVALID_ARGUMENT" and "mkfs.xfs is missing" in msg
    assert n.host.calls == []
    assert call(n.controller.CreateVolume, cv(caps=[mount_cap("ext4")]))[0] == "OK"


def test_the_class_default_fs_is_checked_by_the_class(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A capability that names no fs type means the class's default: the
    volume layer checks that one (its mkfs here), before any lock or `lvs`;
    an fs type named, or a block volume, does not need it."""
    n = make_node(tmp_path, monkeypatch)
    monkeypatch.setattr(fsrules, "mkfs_available", lambda fs: fs != "ext4")
    code, msg = call(n.controller.CreateVolume, cv(caps=[mount_cap("")]))
    assert code == "INVALID_ARGUMENT" and "mkfs.ext4 is missing" in msg, msg
    assert n.host.calls == []
    assert call(n.controller.CreateVolume, cv(name="pvc-block", caps=[block_cap()]))[0] == "OK"
    code, reply = call(n.controller.CreateVolume, cv(name="pvc-xfs", caps=[mount_cap("xfs")]))
    assert code == "OK" and reply.volume.capacity_bytes >= fsrules.min_size("xfs")


def test_create_volume_reply_and_lv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    code, reply = call(n.controller.CreateVolume, cv())
    assert code == "OK", reply
    assert reply.volume.volume_id == NEW
    assert reply.volume.capacity_bytes == GiB  # the default size
    assert [dict(t.segments) for t in reply.volume.accessible_topology] == [
        {TOPO_KEY: NODE_ID}]
    assert not reply.volume.HasField("content_source")
    lv = n.host.lv(NEW)
    assert (lv.size, lv.active, lv.skip) == (GiB, True, False)
    assert lv.tags == {KIND_V, f"{naming.TAG_SIZE}={GiB}"}  # no "fresh" tag: see node
    assert len(n.host.commands("lvcreate")) == 1


@pytest.mark.parametrize(("caps", "rng", "size"), [
    pytest.param(None, None, GiB, id="no-range-default"),
    pytest.param(None, (1, 0), 4 * MiB, id="one-byte-one-extent"),
    pytest.param(None, (5 * MiB, 0), 8 * MiB, id="required-rounded-up"),
    pytest.param(None, (0, 512 * MiB), 512 * MiB, id="limit-below-default"),
    pytest.param(None, (0, 10 * MiB + 1), 8 * MiB, id="limit-rounded-down"),
    pytest.param(None, (0, 4 * GiB), GiB, id="limit-above-default"),
    pytest.param(None, (GiB, GiB), GiB, id="exact"),
    pytest.param([mount_cap("xfs")], (1, 0), 300 * MiB, id="xfs-minimum"),
    pytest.param([mount_cap("btrfs")], (1, 0), 128 * MiB, id="btrfs-minimum"),
    pytest.param([mount_cap("btrfs")], (0, 200 * MiB), 200 * MiB, id="btrfs-limit-only"),
    pytest.param([block_cap()], (1, 0), 4 * MiB, id="block-no-minimum"),
    pytest.param([block_cap(), mount_cap("xfs")], (1, 0), 300 * MiB, id="largest-minimum"),
])
def test_create_volume_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             caps: list[pb.VolumeCapability] | None,
                             rng: tuple[int, int] | None, size: int) -> None:
    n = make_node(tmp_path, monkeypatch)
    code, reply = call(n.controller.CreateVolume, cv(caps=caps, rng=rng))
    assert code == "OK", reply
    assert reply.volume.capacity_bytes == size
    (create,) = n.host.commands("lvcreate")
    assert create[create.index("--virtualsize") + 1] == f"{size}b"
    assert n.host.lv(NEW).size == size
    assert f"{naming.TAG_SIZE}={size}" in n.host.lv(NEW).tags


@pytest.mark.parametrize("request_", [
    pytest.param(cv(params={"csi.storage.k8s.io/pvc/name": "claim"}), id="co-parameters"),
    pytest.param(cv(requisite=["node-2", NODE_ID]), id="requisite-includes-node"),
    pytest.param(cv(preferred=["node-2"]), id="only-preferred-elsewhere"),
    pytest.param(cv(caps=[mount_cap("", Mode.SINGLE_NODE_READER_ONLY, ("noatime",))]),
                 id="default-fs-read-only-with-flags"),
    pytest.param(cv(caps=[block_cap(Mode.SINGLE_NODE_MULTI_WRITER)]),
                 id="block-single-node-multi-writer"),
])
def test_create_volume_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               request_: pb.CreateVolumeRequest) -> None:
    n = make_node(tmp_path, monkeypatch)
    code, reply = call(n.controller.CreateVolume, request_)
    assert code == "OK", reply
    assert NEW in n.host.lvs


def test_create_volume_records_the_co_names(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    names = {"csi.storage.k8s.io/pvc/name": "data-0", "csi.storage.k8s.io/pvc/namespace": "db",
             "csi.storage.k8s.io/pv/name": "pvc-1"}
    assert call(n.controller.CreateVolume, cv(params=names))[0] == "OK"
    assert call(n.controller.CreateVolume, cv("clone", volume=V, params=names))[0] == "OK"
    for vid in (NEW, vol_id("clone")):
        tags = n.host.lv(vid).tags
        assert {f"{naming.TAG_PVC_NAME}={b'data-0'.hex()}",
                f"{naming.TAG_PVC_NAMESPACE}={b'db'.hex()}"} <= tags
        assert len([t for t in tags if t.startswith("csi-local.pvc-")]) == 2
    # An empty name records nothing; one too long for an LVM tag neither.
    odd = {"csi.storage.k8s.io/pvc/name": "", "csi.storage.k8s.io/pvc/namespace": "n" * 257}
    assert call(n.controller.CreateVolume, cv("odd", params=odd))[0] == "OK"
    assert not [t for t in n.host.lv(vol_id("odd")).tags if t.startswith("csi-local.pvc-")]


def test_create_volume_raised_high_water_mark(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch, policy=PoolPolicy(100.0, 100.0))
    pool_usage(99.9, 99.9)(n)
    assert call(n.controller.CreateVolume, cv())[0] == "OK"


def test_retries_and_growth_above_the_high_water_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The mark refuses new volumes and snapshots; what exists keeps answering, and (as
    # Pool.grow is written) an existing volume may still grow within the pool's room.
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    volume = call(n.controller.CreateVolume, cv())
    snapshot = call(n.controller.CreateSnapshot, cs())
    assert volume[0] == snapshot[0] == "OK"
    pool_usage(95.0, 95.0)(n)
    assert call(n.controller.CreateVolume, cv()) == volume
    assert call(n.controller.CreateSnapshot, cs()) == snapshot
    assert len(n.host.commands("lvcreate")) == 2
    assert call(n.controller.CreateVolume, cv("other"))[0] == "RESOURCE_EXHAUSTED"
    code, reply = call(n.controller.ControllerExpandVolume, ce(NEW, (2 * GiB, 0)))
    assert (code, reply.capacity_bytes) == ("OK", 2 * GiB), reply


def test_create_volume_over_provisioned(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch, ratio=2.0)
    add_volume(n, V, 8 * GiB)
    code, reply = call(n.controller.CreateVolume, cv(rng=(12 * GiB, 0)))
    assert code == "OK", reply
    assert n.host.lv(NEW).size == 12 * GiB


def test_create_volume_retry_is_idempotent(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    first = call(n.controller.CreateVolume, cv(rng=(GiB, 2 * GiB)))
    again = call(n.controller.CreateVolume, cv(rng=(GiB, 2 * GiB)))
    wider = call(n.controller.CreateVolume, cv(rng=(512 * MiB, 0)))  # still compatible
    unset = call(n.controller.CreateVolume, cv())
    assert first[0] == "OK", first
    assert again == wider == unset == first
    assert len(n.host.commands("lvcreate")) == 1
    assert not n.host.commands("lvextend")


def test_create_volume_retry_finishes_interrupted_clone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Killed between the snapshot and its lvextend: the tag says 2 GiB, the LV is 1 GiB.
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    add_snapshot(n)
    add_volume(n, NEW, GiB, requested=2 * GiB, tags=[Source(SourceKind.SNAPSHOT, S).tag()])
    code, reply = call(n.controller.CreateVolume, cv(snapshot=S, rng=(2 * GiB, 0)))
    assert code == "OK", reply
    assert reply.volume.capacity_bytes == 2 * GiB
    assert reply.volume.content_source.snapshot.snapshot_id == S
    assert n.host.lv(NEW).size == 2 * GiB
    assert len(n.host.commands("lvextend")) == 1
    assert not n.host.commands("lvcreate")


@pytest.mark.parametrize(("required", "size", "grows"), [
    pytest.param(0, GiB, False, id="same-size"),
    pytest.param(GiB // 2, GiB, False, id="required-below-source"),
    pytest.param(3 * GiB, 3 * GiB, True, id="bigger"),
])
def test_create_volume_from_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     required: int, size: int, grows: bool) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    add_snapshot(n)
    code, reply = call(n.controller.CreateVolume,
                       cv(snapshot=S, rng=(required, 0) if required else None))
    assert code == "OK", reply
    assert reply.volume.capacity_bytes == size
    assert reply.volume.content_source.snapshot.snapshot_id == S
    lv = n.host.lv(NEW)
    assert (lv.size, lv.origin, lv.active, lv.skip) == (size, S, True, False)
    expected = {KIND_V, f"{naming.TAG_SIZE}={size}", f"{naming.TAG_SOURCE}=snapshot:{S}",
                naming.TAG_NEW_FSID}
    assert lv.tags == (expected | {naming.TAG_GROW_FS} if grows else expected)  # never fresh
    assert len(n.host.commands("lvextend")) == (1 if grows else 0)
    assert not n.host.commands("sync")  # a snapshot is not mounted


@pytest.mark.parametrize(("setup", "syncs"), [
    pytest.param(nothing, False, id="source-not-staged"),
    pytest.param(staged(V, AccessType.BLOCK), False, id="source-staged-block"),
    pytest.param(staged(V, AccessType.MOUNT), True, id="source-staged-mount"),
    pytest.param(staged(V2, AccessType.MOUNT), False, id="another-volume-staged"),
])
def test_create_volume_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             setup: Setup, syncs: bool) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, V, 2 * GiB)
    add_volume(n, V2)
    setup(n)
    code, reply = call(n.controller.CreateVolume, cv(volume=V))
    assert code == "OK", reply
    assert reply.volume.capacity_bytes == 2 * GiB  # the source's size, not the default
    assert reply.volume.content_source.volume.volume_id == V
    lv = n.host.lv(NEW)
    assert lv.origin == V
    assert lv.tags == {KIND_V, f"{naming.TAG_SIZE}={2 * GiB}", f"{naming.TAG_SOURCE}=volume:{V}",
                       naming.TAG_NEW_FSID}
    names = [c[0] for c in n.host.calls]
    if syncs:
        assert ("sync", "--file-system", n.path("stage")) in n.host.calls
        assert names.index("sync") < names.index("lvcreate")
    else:
        assert "sync" not in names
    again = call(n.controller.CreateVolume, cv(volume=V))
    assert again == (code, reply)
    assert len(n.host.commands("lvcreate")) == 1


@pytest.mark.parametrize("kind", ["volume", "snapshot"])
def test_clone_of_a_source_whose_fs_is_not_grown_grows_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The source is itself a clone extended past its own source and never
    staged (its grow-fs tag still on): its file system is smaller than its LV,
    and so is the copy's, however large the copy asks to be. The tag is carried
    on, through a snapshot too (once only the host volume plugin did that)."""
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, V, tags=[naming.TAG_GROW_FS])
    if kind == "snapshot":
        assert call(n.controller.CreateSnapshot, cs())[0] == "OK"
        assert naming.TAG_GROW_FS in n.host.lv(S).tags
    request = cv(snapshot=S) if kind == "snapshot" else cv(volume=V)
    code, reply = call(n.controller.CreateVolume, request)
    assert code == "OK", reply
    assert {naming.TAG_GROW_FS, naming.TAG_NEW_FSID} <= n.host.lv(NEW).tags
    assert not n.host.commands("lvextend")  # the copy is its source's size


@pytest.mark.parametrize(("exists", "code"), [
    pytest.param(False, "NOT_FOUND", id="missing"),
    pytest.param(True, "ALREADY_EXISTS", id="exists"),
])
def test_create_volume_clone_of_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       exists: bool, code: str) -> None:
    n = make_node(tmp_path, monkeypatch)
    n.backend.locks.timeout = 0.02
    if exists:
        add_volume(n, NEW)
    assert call(n.controller.CreateVolume, cv(volume=NEW))[0] == code


def test_create_volume_retry_with_capabilities_it_cannot_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    assert call(n.controller.CreateVolume, cv(caps=[block_cap()], rng=(MiB, 0)))[0] == "OK"
    code, _ = call(n.controller.CreateVolume, cv(caps=[mount_cap("xfs")], rng=(MiB, 0)))
    assert code == "ALREADY_EXISTS"


def test_create_volume_retry_finishing_a_clone_checks_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first try passed the room check (1 + 6 of 10 GiB), made the 1 GiB snapshot and
    # was killed; a 7 GiB volume was made since. Growing the clone now would need 14 GiB.
    n = make_node(tmp_path, monkeypatch)  # 10 GiB, ratio 1
    add_volume(n, V, GiB)
    add_volume(n, NEW, GiB, requested=6 * GiB, tags=[Source(SourceKind.VOLUME, V).tag()])
    add_volume(n, V2, 7 * GiB)
    code, _ = call(n.controller.CreateVolume, cv(volume=V, rng=(6 * GiB, 0)))
    assert code == "RESOURCE_EXHAUSTED"
    assert n.host.lv(NEW).size == GiB


# DeleteVolume ---------------------------------------------------------------------------


def dv(vid: str = V) -> pb.DeleteVolumeRequest:
    return pb.DeleteVolumeRequest(volume_id=vid)


DELETE_ROWS = [
    row("missing-id", dv(""), "INVALID_ARGUMENT", "volume_id is required"),
    row("malformed-id", dv("a/b"), "INVALID_ARGUMENT", "not a valid ID"),
    row("not-our-id-is-never-touched", dv(FOREIGN), "OK", setup=plain_lv()),
    row("snapshot-id", dv(S), "OK", setup=chain(vol(), snap())),
    row("missing", dv(), "OK", ran="lvs"),
    row("our-id-but-not-a-csi-volume", dv(), "OK", setup=plain_lv(V), ran="(lvs)"),
    row("gone-before-lvremove", dv(), "OK", setup=chain(
        vol(), fail("lvremove", '  Failed to find logical volume "vg0/x"\n')),
        ran="(lvs) lvremove"),
    row("staged", dv(), "FAILED_PRECONDITION", "still staged or published",
        setup=chain(vol(), staged())),
    row("published", dv(), "FAILED_PRECONDITION", "target",
        setup=chain(vol(), published())),
    row("lv-open", dv(), "FAILED_PRECONDITION", "in use",
        setup=chain(vol(), lambda n: n.host.set_busy(V)), ran="(lvs) lvremove"),
    row("vg-missing", dv(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(vol(), vg_gone), ran="lvs"),
    row("vg-missing-at-lvremove", dv(), "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(vol(), fail("lvremove", VG_GONE_STDERR)), ran="(lvs) lvremove"),
    row("lvremove-fails", dv(), "INTERNAL", "lvremove exited 5",
        setup=chain(vol(), fail("lvremove")), ran="(lvs) lvremove"),
    row("lock-busy", dv(), "ABORTED", "already in progress", setup=vol(),
        busy=volume_key(V)),
]


@pytest.mark.parametrize("case", DELETE_ROWS)
def test_delete_volume_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            case: Case) -> None:
    _, answer = run_row(tmp_path, monkeypatch, "DeleteVolume", case)
    if case.code == "OK":
        assert answer == pb.DeleteVolumeResponse()


def test_delete_volume_removes_it_and_keeps_its_snapshots(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    add_snapshot(n)
    add_volume(n, V2)
    assert call(n.controller.DeleteVolume, dv()) == ("OK", pb.DeleteVolumeResponse())
    assert V not in n.host.lvs
    assert {S, V2} <= set(n.host.lvs)  # thin snapshots are independent
    assert n.host.commands("lvremove") == [("lvremove", "--yes", f"vg0/{V}")]
    assert call(n.controller.DeleteVolume, dv())[0] == "OK"  # and again
    assert len(n.host.commands("lvremove")) == 1


def test_delete_volume_drops_a_formatting_mark_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage killed inside its mkfs leaves a mark keyed by the LV's ID; the
    volume's deletion takes it along (another volume's mark stays)."""
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    add_volume(n, V2)
    uuid, uuid2 = n.host.lv(V).uuid, n.host.lv(V2).uuid
    n.state.mark_formatting(uuid)
    n.state.mark_formatting(uuid2)
    assert call(n.controller.DeleteVolume, dv())[0] == "OK"
    assert not n.state.formatting(uuid)
    assert n.state.formatting(uuid2)


# ValidateVolumeCapabilities ---------------------------------------------------------------


def vvc(vid: str = V, caps: Sequence[pb.VolumeCapability] | None = None,
        params: dict[str, str] | None = None) -> pb.ValidateVolumeCapabilitiesRequest:
    return pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vid, volume_capabilities=[mount_cap()] if caps is None else caps,
        parameters=params or {}, volume_context={"k": "v"})


VALIDATE_ERRORS = [
    row("missing-id", vvc(""), "INVALID_ARGUMENT", "volume_id is required"),
    row("malformed-id", vvc(".."), "INVALID_ARGUMENT", "not a valid ID"),
    row("missing-capabilities", vvc(caps=[]), "INVALID_ARGUMENT",
        "volume_capabilities is required", setup=vol()),
    row("not-our-id", vvc(FOREIGN), "NOT_FOUND", "not found", setup=plain_lv()),
    row("snapshot-id", vvc(S), "NOT_FOUND", "not found", setup=chain(vol(), snap())),
    row("missing", vvc(), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("not-a-csi-volume", vvc(), "NOT_FOUND", "not found", setup=plain_lv(V), ran="lvs"),
    row("vg-missing", vvc(), "UNAVAILABLE", "volume group", setup=chain(vol(), vg_gone),
        ran="lvs"),
]


@pytest.mark.parametrize("case", VALIDATE_ERRORS)
def test_validate_volume_capabilities_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             case: Case) -> None:
    run_row(tmp_path, monkeypatch, "ValidateVolumeCapabilities", case)


@pytest.mark.parametrize(("caps", "params", "problem"), [
    pytest.param([mount_cap()], None, "", id="mount"),
    pytest.param([block_cap(), mount_cap("xfs", flags=("noatime",))], None, "",
                 id="block-and-xfs"),
    pytest.param([mount_cap()], {"csi.storage.k8s.io/pv/name": "p"}, "", id="co-parameter"),
    pytest.param([mount_cap(mode=Mode.MULTI_NODE_SINGLE_WRITER)], None,
                 "MULTI_NODE_SINGLE_WRITER is not supported", id="multi-node"),
    pytest.param([block_cap(), mount_cap("vfat")], None, "'vfat' is not supported",
                 id="second-capability-unsupported"),
    pytest.param([mount_cap(flags=("remount",))], None, "mount flag refused",
                 id="forbidden-flag"),
    pytest.param([no_mode_cap()], None, "needs an access mode", id="no-access-mode"),
    pytest.param([mount_cap()], {"size": "1G"}, "unknown parameter 'size'",
                 id="unknown-parameter"),
])
def test_validate_volume_capabilities_replies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caps: list[pb.VolumeCapability],
        params: dict[str, str] | None, problem: str) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    request = vvc(caps=caps, params=params)
    code, reply = call(n.controller.ValidateVolumeCapabilities, request)
    assert code == "OK", reply
    if problem:
        assert not reply.HasField("confirmed")
        assert problem in reply.message
    else:
        assert reply.message == ""
        assert list(reply.confirmed.volume_capabilities) == caps
        assert dict(reply.confirmed.volume_context) == {"k": "v"}
        assert dict(reply.confirmed.parameters) == (params or {})


# ListVolumes and ControllerGetVolume -------------------------------------------------------


def lv_volume_ids(reply: pb.ListVolumesResponse) -> list[str]:
    return [e.volume.volume_id for e in reply.entries]


def test_list_volumes_lists_csi_volumes_only(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, V2, 2 * GiB)
    add_volume(n, V)
    add_snapshot(n)
    add_volume(n, NEW, tags=[Source(SourceKind.SNAPSHOT, S).tag()])
    n.host.add_lv(FOREIGN, GiB, tags=[KIND_V])  # a volume kind, but not our name
    n.host.add_lv(vol_id("untagged"), GiB)  # our name, but no kind
    code, reply = call(n.controller.ListVolumes, pb.ListVolumesRequest())
    assert code == "OK", reply
    assert lv_volume_ids(reply) == sorted([V, V2, NEW])
    assert reply.next_token == ""
    by_id = {e.volume.volume_id: e for e in reply.entries}
    assert by_id[V2].volume.capacity_bytes == 2 * GiB
    assert by_id[NEW].volume.content_source.snapshot.snapshot_id == S
    assert not by_id[V].volume.HasField("content_source")
    for e in reply.entries:
        assert [dict(t.segments) for t in e.volume.accessible_topology] == [
            {TOPO_KEY: NODE_ID}]
        assert not e.status.volume_condition.abnormal
        assert e.status.volume_condition.message == "volume is healthy"
    assert tools(n) == ran(n, "(lvs)")


def pool_health_failed(n: Node) -> None:
    """The pool has failed: lvs says its lv_health_status is "failed"."""
    n.host.lv(POOL).failed = True


def lv_inactive(n: Node) -> None:
    n.host.lv(V).active = False


@pytest.mark.parametrize("rpc", ["ListVolumes", "ControllerGetVolume"])
@pytest.mark.parametrize(("setup", "node", "abnormal", "message"), [
    pytest.param(pool_usage(89.9, 89.9), {}, False, "volume is healthy", id="healthy"),
    pytest.param(pool_usage(99.9, 99.9), {"policy": PoolPolicy(100.0, 100.0)}, False,
                 "volume is healthy", id="healthy-below-raised-high-water-marks"),
    pytest.param(pool_usage(data=90.0), {}, True,
                 "thin pool vg0/pool0 is above its high-water mark: data 90.0% full "
                 "(limit 90%)", id="pool-data-above-high-water"),
    pytest.param(pool_usage(metadata=95.0), {"policy": PoolPolicy(99.0, 95.0)}, True,
                 "above its high-water mark: metadata 95.0% full (limit 95%)",
                 id="pool-metadata-above-high-water"),
    pytest.param(lv_inactive, {}, True, "logical volume is not active", id="lv-inactive"),
    pytest.param(pool_usage(data=100.0), {}, True, "out of data space", id="pool-data-full"),
    pytest.param(pool_usage(metadata=100.0), {}, True, "out of metadata space",
                 id="pool-metadata-full"),
    pytest.param(pool_health_failed, {}, True, "thin pool health is failed",
                 id="pool-health"),
    pytest.param(nothing, {"with_pool": False}, True, "thin pool vg0/pool0 is missing",
                 id="pool-missing"),
])
def test_volume_condition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rpc: str,
                          setup: Setup, node: dict[str, Any], abnormal: bool,
                          message: str) -> None:
    n = make_node(tmp_path, monkeypatch, **node)
    add_volume(n)
    setup(n)
    if rpc == "ListVolumes":
        code, reply = call(n.controller.ListVolumes, pb.ListVolumesRequest())
        assert code == "OK", reply
        (entry,) = reply.entries
        cond = entry.status.volume_condition
    else:
        code, reply = call(n.controller.ControllerGetVolume,
                           pb.ControllerGetVolumeRequest(volume_id=V))
        assert code == "OK", reply
        assert reply.volume.volume_id == V
        cond = reply.status.volume_condition
    assert cond.abnormal is abnormal
    assert message in cond.message


def test_list_volumes_condition_names_every_problem(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, active=False)
    pool_usage(100.0, 100.0)(n)
    code, reply = call(n.controller.ListVolumes, pb.ListVolumesRequest())
    assert code == "OK", reply
    assert reply.entries[0].status.volume_condition.message == (
        "logical volume is not active; thin pool is out of data space; "
        "thin pool is out of metadata space")


def test_list_volumes_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    ids = sorted(vol_id(f"v{i}") for i in range(5))
    for vid in ids:
        add_volume(n, vid)
    code, first = call(n.controller.ListVolumes, pb.ListVolumesRequest(max_entries=2))
    assert code == "OK", first
    assert lv_volume_ids(first) == ids[:2] and first.next_token
    del n.host.lvs[ids[1]]  # the last one returned goes away between pages
    code, second = call(n.controller.ListVolumes, pb.ListVolumesRequest(
        max_entries=2, starting_token=first.next_token))
    assert code == "OK", second
    assert lv_volume_ids(second) == ids[2:4] and second.next_token
    code, last = call(n.controller.ListVolumes, pb.ListVolumesRequest(
        max_entries=2, starting_token=second.next_token))
    assert (code, lv_volume_ids(last), last.next_token) == ("OK", ids[4:], "")
    code, whole = call(n.controller.ListVolumes, pb.ListVolumesRequest(max_entries=0))
    assert (code, len(whole.entries), whole.next_token) == ("OK", 4, "")


def test_list_volumes_takes_an_entry_again_only_for_the_same_lv_and_condition(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader of the committed metadata gives the same LV object while
    nothing of it changed, and ListVolumes then reuses that volume's entry:
    the reply is the same, byte for byte, as one made from scratch. An LV
    that changed (a new object) or whose condition changed gets a new entry;
    the entries of volumes gone are forgotten."""
    n = make_node(tmp_path, monkeypatch)
    ids = sorted(vol_id(f"v{i}") for i in range(4))
    for i, vid in enumerate(ids):
        add_volume(n, vid, (i + 1) * GiB, tags=[Source(SourceKind.SNAPSHOT, S).tag()]
                   if i == 2 else ())
    listed = n.backend.pools.listing()
    monkeypatch.setattr(n.backend.pools, "listing", lambda: listed)  # the same objects

    def reply(node: Node) -> bytes:
        code, got = call(node.controller.ListVolumes, pb.ListVolumesRequest())
        assert code == "OK", got
        return bytes(got.SerializeToString())

    def fresh() -> bytes:  # a servicer of its own: nothing kept
        return reply(Node(n.host, n.backend, ControllerServicer(n.backend),
                          n.node, n.root))

    made: list[str] = []
    real_fill = ControllerServicer._fill_volume

    def fill(msg: pb.Volume, lv: LogicalVolume, src: Source | None,
             topology: pb.Topology) -> None:
        made.append(lv.name)
        real_fill(msg, lv, src, topology)
    monkeypatch.setattr(ControllerServicer, "_fill_volume", staticmethod(fill))
    first = reply(n)
    assert made == ids and first == fresh()
    made.clear()
    assert reply(n) == first and made == []  # every entry taken again
    # One LV changed (a new object, a new size), one is gone.
    lvs = [lv for _, lv in listed[0]]
    pool_of = {lv.name: p for p, lv in listed[0]}
    grown = {ids[0]: dataclasses.replace(
        next(lv for lv in lvs if lv.name == ids[0]), size=9 * GiB)}
    now = [(pool_of[lv.name], grown.get(lv.name, lv)) for lv in lvs if lv.name != ids[3]]
    monkeypatch.setattr(n.backend.pools, "listing", lambda: (now, listed[1]))
    made.clear()
    second = reply(n)
    assert made == [ids[0]] and second == fresh()
    # The same LV objects, but their pool is full now: every condition changed.
    now[:] = [(p, dataclasses.replace(lv, data_percent=100.0) if lv.is_thin_pool else lv)
              for p, lv in now]
    made.clear()
    third = reply(n)
    assert made == ids[:3] and third == fresh()
    got = pb.ListVolumesResponse.FromString(third)
    by_id = {e.volume.volume_id: e for e in got.entries}
    assert sorted(by_id) == ids[:3] and by_id[ids[0]].volume.capacity_bytes == 9 * GiB
    assert all(e.status.volume_condition.abnormal for e in got.entries)
    assert sorted(n.controller._listed_entries) == ids[:3]  # the one gone is forgotten


class _PruneMeetsInsert(dict[str, Any]):
    """ListVolumes' map of entries whose pruning, part-way through its items,
    lets `meanwhile` run in another thread (at most `wait` seconds)."""

    def __init__(self, entries: dict[str, Any], meanwhile: Callable[[], object],
                 wait: float) -> None:
        super().__init__(entries)
        self.meanwhile, self.wait = meanwhile, wait

    def items(self) -> Any:
        def gen() -> Iterator[tuple[str, Any]]:
            for i, item in enumerate(super(_PruneMeetsInsert, self).items()):
                if i == 1:
                    other = threading.Thread(target=self.meanwhile)
                    other.start()
                    other.join(self.wait)
                yield item
        return gen()


def test_list_volumes_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ListVolumes at once: one forgets the entries of volumes gone while
    the other adds the entry of a new volume. Both answer, each with what it
    listed (an unguarded map failed the first: "dictionary changed size during
    iteration", INTERNAL)."""
    n = make_node(tmp_path, monkeypatch)
    ids = sorted(vol_id(f"v{i}") for i in range(4))
    for vid in ids:
        add_volume(n, vid)
    code, reply = call(n.controller.ListVolumes, pb.ListVolumesRequest())
    assert code == "OK", reply
    del n.host.lvs[ids[3]]  # gone: the next listing prunes its entry
    other: list[tuple[str, Any]] = []
    new = vol_id("new")

    def list_a_new_volume() -> None:
        add_volume(n, new)
        other.append(call(n.controller.ListVolumes, pb.ListVolumesRequest()))

    kept = n.controller._listed_entries
    n.controller._listed_entries = _PruneMeetsInsert(kept, list_a_new_volume, 0.5)
    code, reply = call(n.controller.ListVolumes, pb.ListVolumesRequest())
    assert code == "OK", reply
    assert lv_volume_ids(reply) == ids[:3]
    deadline = time.monotonic() + 10
    while not other and time.monotonic() < deadline:
        time.sleep(0.01)
    ((code, second),) = other
    assert code == "OK", second
    assert lv_volume_ids(second) == sorted([*ids[:3], new])


LIST_VOLUMES_ERRORS = [
    row("token-not-ours", pb.ListVolumesRequest(starting_token="Y3NpLXY.0123456789abcdef01234567"),
        "ABORTED", "not issued by this plugin", setup=vol(), ran="(lvs)"),
    row("token-garbage", pb.ListVolumesRequest(starting_token="garbage"), "ABORTED",
        "invalid starting_token", setup=vol(), ran="(lvs)"),
    row("negative-max-entries", pb.ListVolumesRequest(max_entries=-1), "INVALID_ARGUMENT",
        "max_entries", setup=vol(), ran="(lvs)"),
    row("vg-missing", pb.ListVolumesRequest(), "UNAVAILABLE", "volume group",
        setup=chain(vol(), vg_gone), ran="lvs"),
]


@pytest.mark.parametrize("case", LIST_VOLUMES_ERRORS)
def test_list_volumes_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             case: Case) -> None:
    run_row(tmp_path, monkeypatch, "ListVolumes", case)


def cgv(vid: str = V) -> pb.ControllerGetVolumeRequest:
    return pb.ControllerGetVolumeRequest(volume_id=vid)


GET_VOLUME_ERRORS = [
    row("missing-id", cgv(""), "INVALID_ARGUMENT", "volume_id is required"),
    row("malformed-id", cgv("a\nb"), "INVALID_ARGUMENT", "not a valid ID"),
    row("missing", cgv(), "NOT_FOUND", f"volume '{V}' not found", ran="(lvs)"),
    row("snapshot-id", cgv(S), "NOT_FOUND", "not found", setup=chain(vol(), snap()), ran="(lvs)"),
    row("foreign-lv", cgv(FOREIGN), "NOT_FOUND", "not found", setup=plain_lv(), ran="(lvs)"),
    row("not-a-csi-volume", cgv(), "NOT_FOUND", "not found", setup=plain_lv(V), ran="(lvs)"),
    row("vg-missing", cgv(), "UNAVAILABLE", "volume group", setup=chain(vol(), vg_gone),
        ran="lvs"),
]


@pytest.mark.parametrize("case", GET_VOLUME_ERRORS)
def test_controller_get_volume_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      case: Case) -> None:
    run_row(tmp_path, monkeypatch, "ControllerGetVolume", case)


def test_controller_get_volume_reply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, V, 2 * GiB)
    add_volume(n, NEW, tags=[Source(SourceKind.VOLUME, V).tag()])
    code, reply = call(n.controller.ControllerGetVolume, cgv(NEW))
    assert code == "OK", reply
    assert (reply.volume.volume_id, reply.volume.capacity_bytes) == (NEW, GiB)
    assert reply.volume.content_source.volume.volume_id == V
    assert [dict(t.segments) for t in reply.volume.accessible_topology] == [
        {TOPO_KEY: NODE_ID}]
    assert not reply.status.volume_condition.abnormal


# GetCapacity -----------------------------------------------------------------------------


def gc(*, topo: dict[str, str] | None = None, caps: Sequence[pb.VolumeCapability] = (),
       params: dict[str, str] | None = None) -> pb.GetCapacityRequest:
    return pb.GetCapacityRequest(
        volume_capabilities=caps, parameters=params or {},
        accessible_topology=pb.Topology(segments=topo) if topo is not None else None)


CAPACITY_ROWS = [
    row("unknown-parameter", gc(params={"pool": "other"}), "INVALID_ARGUMENT",
        "unknown parameter 'pool'"),
    row("vg-missing-reports-zero", gc(), "OK", setup=vg_gone, ran="lvs"),
    row("pool-missing-reports-zero", gc(), "OK", ran="(lvs) (vgs)", with_pool=False),
    row("foreign-topology-reports-zero", gc(topo={TOPO_KEY: "node-2"}), "OK"),
    row("topology-without-our-key-reports-zero", gc(topo={"zone": "a"}), "OK"),
    row("unsupported-capability-reports-zero",
        gc(caps=[mount_cap(), mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)]), "OK"),
    row("unsupported-fs-reports-zero", gc(caps=[mount_cap("zfs")]), "OK"),
    row("pool-lv-not-a-thin-pool", gc(), "FAILED_PRECONDITION", "is not a thin pool",
        setup=plain_lv(POOL), ran="lvs", with_pool=False),
    # The PV cannot be read (the committed metadata does not answer), and lvs fails.
    row("lvs-fails", gc(), "INTERNAL", "lvs exited 5", setup=chain(pv_unreadable, fail("lvs")),
        ran="lvs"),
]


@pytest.mark.parametrize("case", CAPACITY_ROWS)
def test_get_capacity_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           case: Case) -> None:
    _, answer = run_row(tmp_path, monkeypatch, "GetCapacity", case)
    if case.code == "OK":
        assert answer == pb.GetCapacityResponse(available_capacity=0)
        assert not answer.HasField("maximum_volume_size")


@pytest.mark.parametrize(("ratio", "setup", "request_", "available"), [
    pytest.param(1.0, nothing, gc(), 10 * GiB, id="empty-pool"),
    pytest.param(1.0, nothing, gc(topo={TOPO_KEY: NODE_ID}, caps=[block_cap()],
                                  params={"csi.storage.k8s.io/x": "y"}),
                 10 * GiB, id="our-topology-and-capabilities"),
    pytest.param(1.0, chain(vol(size=3 * GiB), snap(size=3 * GiB), plain_lv(size=GiB)),
                 gc(), 3 * GiB, id="every-thin-lv-counts"),
    pytest.param(2.0, vol(size=3 * GiB), gc(), 17 * GiB, id="over-provisioning-ratio"),
    pytest.param(1.0001, nothing, gc(), 10 * GiB, id="rounded-down-to-extents"),
    pytest.param(1.0, vol(size=12 * GiB), gc(), 0, id="over-committed-is-zero"),
])
def test_get_capacity_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                ratio: float, setup: Setup,
                                request_: pb.GetCapacityRequest, available: int) -> None:
    n = make_node(tmp_path, monkeypatch, ratio=ratio)
    setup(n)
    code, reply = call(n.controller.GetCapacity, request_)
    assert code == "OK", reply
    assert reply.available_capacity == available
    assert reply.maximum_volume_size.value == available
    assert reply.minimum_volume_size.value == 4 * MiB  # one extent
    assert tools(n) == ran(n, "(lvs)")


@pytest.mark.parametrize(("setup", "zero"), [
    pytest.param(mda_left(LV_TEXT_MAX + COMMAND_TEXT_MAX), False, id="one-more-fits"),
    pytest.param(mda_left(LV_TEXT_MAX + COMMAND_TEXT_MAX - 1), True, id="metadata-area-full"),
    pytest.param(thin_id_at(THIN_DEVICE_ID_MAX - 1), False, id="one-device-id-left"),
    pytest.param(thin_id_at(THIN_DEVICE_ID_MAX), True, id="device-ids-used-up"),
])
def test_get_capacity_zero_when_no_volume_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               setup: Setup, zero: bool) -> None:
    """GetCapacity is 0 exactly when CreateVolume refuses every size."""
    n = make_node(tmp_path, monkeypatch)
    setup(n)
    code, reply = call(n.controller.GetCapacity, gc())
    assert code == "OK", reply
    assert (reply.available_capacity == 0) is zero
    code, reply = call(n.controller.CreateVolume, cv(name="new", rng=(GiB, 0)))
    assert code == ("RESOURCE_EXHAUSTED" if zero else "OK"), reply


def test_create_volume_until_the_metadata_area_is_full(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Volumes are made until the VG's metadata area has room for no more:
    then refused before lvcreate, never by LVM, and GetCapacity is 0 then."""
    n = make_node(tmp_path, monkeypatch)
    n.host.vgs["vg0"].mda_size = 64 * 1024
    made = 0
    while True:
        n.host.calls.clear()
        code, reply = call(n.controller.CreateVolume, cv(name=f"pvc-{made}", rng=(4 * MiB, 0)))
        if code != "OK":
            break
        made += 1
    assert code == "RESOURCE_EXHAUSTED" and "metadata area of volume group vg0" in reply
    assert "lvcreate" not in tools(n)
    assert made > 10
    assert call(n.controller.GetCapacity, gc())[1].available_capacity == 0
    # A deletion makes room again.
    vid = next(name for name in n.host.lvs if name.startswith("csi-v-"))
    assert call(n.controller.DeleteVolume, pb.DeleteVolumeRequest(volume_id=vid))[0] == "OK"
    assert call(n.controller.GetCapacity, gc())[1].available_capacity > 0


def test_get_capacity_above_the_high_water_mark(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    pool_usage(data=95.0)(n)
    assert call(n.controller.CreateVolume, cv())[0] == "RESOURCE_EXHAUSTED"
    code, reply = call(n.controller.GetCapacity, gc())
    assert (code, reply.available_capacity) == ("OK", 0)


# ControllerGetCapabilities ----------------------------------------------------------------

ALWAYS = {RPC.CREATE_DELETE_VOLUME, RPC.GET_CAPACITY, RPC.LIST_VOLUMES, RPC.GET_VOLUME,
          RPC.VOLUME_CONDITION, RPC.CREATE_DELETE_SNAPSHOT, RPC.LIST_SNAPSHOTS,
          RPC.GET_SNAPSHOT, RPC.CLONE_VOLUME, RPC.SINGLE_NODE_MULTI_WRITER,
          RPC.MODIFY_VOLUME}


@pytest.mark.parametrize(("node_expansion_only", "expected"), [
    pytest.param(False, ALWAYS | {RPC.EXPAND_VOLUME}, id="default"),
    pytest.param(True, ALWAYS, id="node-expansion-only"),
])
def test_controller_get_capabilities(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     node_expansion_only: bool, expected: set[int]) -> None:
    n = make_node(tmp_path, monkeypatch, node_expansion_only=node_expansion_only)
    code, reply = call(n.controller.ControllerGetCapabilities,
                       pb.ControllerGetCapabilitiesRequest())
    assert code == "OK", reply
    got = [c.rpc.type for c in reply.capabilities]
    assert len(got) == len(set(got))
    assert set(got) == expected
    assert n.host.calls == []


# ControllerExpandVolume -------------------------------------------------------------------

EXPAND_ERRORS = [
    row("missing-id", ce(""), "INVALID_ARGUMENT", "volume_id is required"),
    row("malformed-id", ce("/x"), "INVALID_ARGUMENT", "not a valid ID"),
    row("missing-capacity-range", ce(rng=None), "INVALID_ARGUMENT",
        "capacity_range is required", setup=vol()),
    row("node-expansion-only", ce(), "FAILED_PRECONDITION", "--node-expansion-only",
        setup=vol(), node_expansion_only=True),
    row("not-our-id", ce(FOREIGN), "NOT_FOUND", "not found", setup=plain_lv()),
    row("snapshot-id", ce(S), "NOT_FOUND", "not found", setup=chain(vol(), snap())),
    row("missing", ce(), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("not-a-csi-volume", ce(), "NOT_FOUND", "not found", setup=plain_lv(V), ran="lvs"),
    row("shrink", ce(rng=(GiB, GiB)), "OUT_OF_RANGE", "shrinking a volume is not supported",
        setup=vol(size=2 * GiB), ran="lvs"),
    row("no-extent-fits-limit", ce(rng=(GiB + 1, GiB + 2 * MiB)), "OUT_OF_RANGE",
        "whole extents", setup=vol(), ran="lvs"),
    # The expansion table has no RESOURCE_EXHAUSTED: a full pool is OUT_OF_RANGE.
    row("pool-full", ce(rng=(11 * GiB, 0)), "OUT_OF_RANGE", "has room for", setup=vol(),
        ran="lvs"),
    row("pool-full-other-volumes", ce(rng=(3 * GiB, 0)), "OUT_OF_RANGE", "has room for",
        setup=chain(vol(), vol(V2, 8 * GiB)), ran="lvs"),
    row("vg-missing", ce(), "UNAVAILABLE", "volume group", setup=chain(vol(), vg_gone),
        ran="lvs"),
    row("lvextend-fails", ce(), "INTERNAL", "lvextend exited 5",
        setup=chain(vol(), fail("lvextend")), ran="lvs lvextend"),
    row("lock-busy-volume", ce(), "ABORTED", "already in progress", setup=vol(),
        busy=volume_key(V)),
    row("lock-busy-pool", ce(), "ABORTED", "'pool:vg0/pool0'", setup=vol(),
        busy=pool_key("vg0", "pool0"), ran="lvs"),
]


@pytest.mark.parametrize("case", EXPAND_ERRORS)
def test_controller_expand_volume_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         case: Case) -> None:
    run_row(tmp_path, monkeypatch, "ControllerExpandVolume", case)


@pytest.mark.parametrize(("cap", "node_expansion"), [
    pytest.param(block_cap(), False, id="block"),
    pytest.param(mount_cap(), True, id="mount"),
    pytest.param(None, True, id="no-capability"),
])
def test_controller_expand_volume_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        cap: pb.VolumeCapability | None,
                                        node_expansion: bool) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    code, reply = call(n.controller.ControllerExpandVolume, ce(rng=(2 * GiB + 1, 0), cap=cap))
    assert code == "OK", reply
    grown = 2 * GiB + 4 * MiB  # rounded up to whole extents
    assert (reply.capacity_bytes, reply.node_expansion_required) == (grown, node_expansion)
    assert n.host.lv(V).size == grown
    assert n.host.commands("lvextend") == [("lvextend", "--size", f"{grown}b", f"vg0/{V}")]


def test_controller_expand_volume_over_provisioned(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch, ratio=2.0)
    add_volume(n)
    code, reply = call(n.controller.ControllerExpandVolume, ce(rng=(15 * GiB, 0)))
    assert (code, reply.capacity_bytes) == ("OK", 15 * GiB), reply


@pytest.mark.parametrize("rng", [
    pytest.param((GiB, 0), id="required-equal"),
    pytest.param((GiB // 2, 0), id="required-smaller"),
    pytest.param((0, 0), id="empty-range"),
    pytest.param((GiB, 4 * GiB), id="within-limit"),
])
def test_controller_expand_volume_big_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             rng: tuple[int, int]) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    n.backend.locks.timeout = 0.02
    # nothing to grow: the pool lock is not needed
    with n.backend.locks.hold(pool_key("vg0", "pool0")):
        code, reply = call(n.controller.ControllerExpandVolume, ce(rng=rng, cap=mount_cap()))
    assert code == "OK", reply
    assert (reply.capacity_bytes, reply.node_expansion_required) == (GiB, True)
    assert not n.host.commands("lvextend")
    assert len(n.host.commands("lvs")) == 1


def test_controller_expand_volume_grown_meanwhile(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The LV read before the pool lock is 1 GiB; the report under the lock shows it already
    # grown (by the host volume plugin's lvextend in between): nothing more to do.
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, size=2 * GiB)
    real = n.backend.pools.default.lvm.get
    monkeypatch.setattr(n.backend.pools.default.lvm, "get", lambda name: dataclasses.replace(
        real(name), size=GiB))
    code, reply = call(n.controller.ControllerExpandVolume, ce(rng=(2 * GiB, 0)))
    assert (code, reply.capacity_bytes) == ("OK", 2 * GiB), reply
    assert not n.host.commands("lvextend")


# The RPCs a local volume has no use for --------------------------------------------------


@pytest.mark.parametrize(("rpc", "request_"), [
    ("ControllerPublishVolume", pb.ControllerPublishVolumeRequest(volume_id=V, node_id=NODE_ID)),
    ("ControllerUnpublishVolume", pb.ControllerUnpublishVolumeRequest(volume_id=V)),
])
def test_unimplemented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rpc: str,
                       request_: Any) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    code, _ = call(getattr(n.controller, rpc), request_)
    assert code == "UNIMPLEMENTED"
    assert n.host.calls == []


def test_every_controller_rpc_is_answered() -> None:
    # The generated base class answers with a context the tests (and call()) do not have.
    rpcs = [m for m in vars(csi_pb2_grpc.ControllerServicer) if m[0].isupper()]
    assert len(rpcs) == 15
    assert [m for m in rpcs if m not in vars(ControllerServicer)] == []


# CreateSnapshot --------------------------------------------------------------------------

SNAPSHOT_ERRORS = [
    row("missing-source", cs(source=""), "INVALID_ARGUMENT", "source_volume_id is required"),
    row("malformed-source", cs(source="x/../y"), "INVALID_ARGUMENT", "not a valid ID"),
    row("missing-name", cs(name=""), "INVALID_ARGUMENT", "name is required", setup=vol()),
    row("unknown-parameter", cs(params={"retain": "1"}), "INVALID_ARGUMENT",
        "unknown parameter 'retain'", setup=vol()),
    row("source-missing", cs(), "NOT_FOUND", f"volume '{V}' not found", ran="lvs"),
    row("source-foreign-lv", cs(source=FOREIGN), "NOT_FOUND", "not found", setup=plain_lv(),
        ran="lvs"),
    row("source-is-a-snapshot", cs(source=S2), "NOT_FOUND", "not found",
        setup=chain(vol(), snap(S2)), ran="lvs"),
    row("source-not-a-csi-volume", cs(), "NOT_FOUND", "not found", setup=plain_lv(V),
        ran="lvs"),
    row("name-taken-for-another-source", cs(source=V2), "ALREADY_EXISTS",
        "exists for another source volume", setup=chain(vol(), vol(V2), snap()), ran="lvs"),
    row("name-maps-to-non-snapshot-lv", cs(), "ALREADY_EXISTS", "another source volume",
        setup=chain(vol(), plain_lv(S, tags=[Source(SourceKind.VOLUME, V).tag()])),
        ran="lvs"),
    row("pool-full", cs(), "RESOURCE_EXHAUSTED", "has room for",
        setup=vol(size=6 * GiB), ran="lvs"),
    row("pool-above-high-water", cs(), "RESOURCE_EXHAUSTED",
        "above its high-water mark: data 91.0% full", setup=chain(vol(), pool_usage(91.0)),
        ran="lvs"),
    row("metadata-area-full", cs(), "RESOURCE_EXHAUSTED",
        "the metadata area of volume group vg0 is",
        setup=chain(vol(), mda_left(LV_TEXT_MAX + COMMAND_TEXT_MAX - 1)), ran="lvs"),
    row("thin-device-ids-used-up", cs(), "RESOURCE_EXHAUSTED", "device ID",
        setup=thin_id_at(THIN_DEVICE_ID_MAX), ran="lvs"),
    row("pool-missing", cs(), "UNAVAILABLE", "thin pool pool0 not found", setup=vol(),
        ran="lvs", with_pool=False),
    row("vg-missing", cs(), "UNAVAILABLE", "volume group", setup=chain(vol(), vg_gone),
        ran="lvs"),
    row("sync-fails", cs(), "INTERNAL", "sync exited 1",
        setup=chain(vol(), staged(), fail("sync", rc=1)), ran="lvs sync"),
    row("lvcreate-fails", cs(), "INTERNAL", "lvcreate exited 5",
        setup=chain(vol(), fail("lvcreate")), ran="lvs lvcreate"),
    row("lock-busy-snapshot", cs(), "ABORTED", f"volume:{S}", setup=vol(),
        busy=volume_key(S)),
    row("lock-busy-source", cs(), "ABORTED", f"volume:{V}", setup=vol(), busy=volume_key(V)),
    row("lock-busy-pool", cs(), "ABORTED", "'pool:vg0/pool0'", setup=vol(),
        busy=pool_key("vg0", "pool0")),
]


@pytest.mark.parametrize("case", SNAPSHOT_ERRORS)
def test_create_snapshot_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                case: Case) -> None:
    run_row(tmp_path, monkeypatch, "CreateSnapshot", case)


@pytest.mark.parametrize(("setup", "syncs"), [
    pytest.param(nothing, False, id="not-staged"),
    pytest.param(staged(V, AccessType.BLOCK), False, id="staged-block"),
    pytest.param(staged(V, AccessType.MOUNT), True, id="staged-mount"),
    pytest.param(chain(staged(V2, AccessType.MOUNT), published(V)), False,
                 id="published-only-and-another-staged"),
])
def test_create_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: Setup,
                         syncs: bool) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n, V, 2 * GiB)
    add_volume(n, V2)
    setup(n)
    code, reply = call(n.controller.CreateSnapshot,
                       cs(params={"csi.storage.k8s.io/volumesnapshot/name": "s"}))
    assert code == "OK", reply
    lv = n.host.lv(S)
    snap_ = reply.snapshot
    assert (snap_.snapshot_id, snap_.source_volume_id, snap_.size_bytes) == (S, V, 2 * GiB)
    assert snap_.ready_to_use
    assert snap_.creation_time.seconds == lv.created
    assert lv.tags == {KIND_S, f"{naming.TAG_SOURCE}=volume:{V}"}
    assert (lv.origin, lv.active, lv.skip) == (V, False, True)  # never activated
    names = [c[0] for c in n.host.calls]
    if syncs:
        assert ("sync", "--file-system", n.path("stage")) in n.host.calls
        assert names.index("sync") < names.index("lvcreate")
    else:
        assert "sync" not in names
    # A retry answers the same, without a second snapshot, even with the source gone.
    del n.host.lvs[V]
    assert call(n.controller.CreateSnapshot, cs()) == (code, reply)
    assert len(n.host.commands("lvcreate")) == 1


def test_create_snapshot_of_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    n.backend.locks.timeout = 0.02
    assert call(n.controller.CreateSnapshot, cs(source=S))[0] == "NOT_FOUND"


# DeleteSnapshot --------------------------------------------------------------------------


def ds(sid: str = S) -> pb.DeleteSnapshotRequest:
    return pb.DeleteSnapshotRequest(snapshot_id=sid)


DELETE_SNAPSHOT_ROWS = [
    row("missing-id", ds(""), "INVALID_ARGUMENT", "snapshot_id is required"),
    row("malformed-id", ds("."), "INVALID_ARGUMENT", "not a valid ID"),
    row("not-our-id-is-never-touched", ds(FOREIGN), "OK", setup=plain_lv()),
    row("volume-id", ds(V), "OK", setup=vol()),
    row("missing", ds(), "OK", ran="lvs"),
    row("our-id-but-not-a-csi-snapshot", ds(), "OK", setup=plain_lv(S), ran="lvs"),
    row("in-use", ds(), "FAILED_PRECONDITION", "in use",
        setup=chain(vol(), snap(), lambda n: n.host.set_busy(S)), ran="lvs lvremove"),
    row("vg-missing", ds(), "UNAVAILABLE", "volume group",
        setup=chain(vol(), snap(), vg_gone), ran="lvs"),
    row("lvremove-fails", ds(), "INTERNAL", "lvremove exited 5",
        setup=chain(vol(), snap(), fail("lvremove")), ran="lvs lvremove"),
    row("lock-busy", ds(), "ABORTED", "already in progress", setup=chain(vol(), snap()),
        busy=volume_key(S)),
]


@pytest.mark.parametrize("case", DELETE_SNAPSHOT_ROWS)
def test_delete_snapshot_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              case: Case) -> None:
    _, answer = run_row(tmp_path, monkeypatch, "DeleteSnapshot", case)
    if case.code == "OK":
        assert answer == pb.DeleteSnapshotResponse()


def test_delete_snapshot_keeps_volumes_made_from_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    add_volume(n)
    add_snapshot(n)
    assert call(n.controller.CreateVolume, cv(snapshot=S))[0] == "OK"
    assert call(n.controller.DeleteSnapshot, ds()) == ("OK", pb.DeleteSnapshotResponse())
    assert S not in n.host.lvs
    assert {V, NEW} <= set(n.host.lvs)
    assert call(n.controller.DeleteSnapshot, ds())[0] == "OK"
    assert len(n.host.commands("lvremove")) == 1


# ListSnapshots and GetSnapshot -------------------------------------------------------------


def snapshot_world(n: Node) -> None:
    """V has snapshots S and S2, V2 has snapshot S3; plus things that are not snapshots."""
    add_volume(n, V)
    add_volume(n, V2, 2 * GiB)
    add_snapshot(n, S, V)
    add_snapshot(n, S2, V)
    add_snapshot(n, snap_id("snap3"), V2, 2 * GiB)
    n.host.add_lv(snap_id("untagged"), GiB)
    n.host.add_lv("csi-s-short", GiB, tags=[KIND_S])


def ls_ids(reply: pb.ListSnapshotsResponse) -> list[str]:
    return [e.snapshot.snapshot_id for e in reply.entries]


@pytest.mark.parametrize(("request_", "expected"), [
    pytest.param(pb.ListSnapshotsRequest(), [S, S2, snap_id("snap3")], id="all"),
    pytest.param(pb.ListSnapshotsRequest(snapshot_id=S2), [S2], id="by-id"),
    pytest.param(pb.ListSnapshotsRequest(snapshot_id=snap_id("nope")), [], id="unknown-id"),
    pytest.param(pb.ListSnapshotsRequest(snapshot_id=V), [], id="volume-id"),
    pytest.param(pb.ListSnapshotsRequest(source_volume_id=V), [S, S2], id="by-source"),
    pytest.param(pb.ListSnapshotsRequest(source_volume_id=V2, snapshot_id=S), [],
                 id="id-and-other-source"),
    pytest.param(pb.ListSnapshotsRequest(source_volume_id=V, snapshot_id=S), [S],
                 id="id-and-its-source"),
    pytest.param(pb.ListSnapshotsRequest(source_volume_id=NEW), [], id="unknown-source"),
])
def test_list_snapshots_filters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                request_: pb.ListSnapshotsRequest,
                                expected: list[str]) -> None:
    n = make_node(tmp_path, monkeypatch)
    snapshot_world(n)
    code, reply = call(n.controller.ListSnapshots, request_)
    assert code == "OK", reply
    assert ls_ids(reply) == sorted(expected)
    assert reply.next_token == ""
    for e in reply.entries:
        lv = n.host.lv(e.snapshot.snapshot_id)
        assert e.snapshot.source_volume_id == (V2 if lv.size == 2 * GiB else V)
        assert (e.snapshot.size_bytes, e.snapshot.creation_time.seconds) == (lv.size,
                                                                             lv.created)
        assert e.snapshot.ready_to_use


def test_list_snapshots_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    snapshot_world(n)
    everything = sorted([S, S2, snap_id("snap3")])
    code, first = call(n.controller.ListSnapshots, pb.ListSnapshotsRequest(max_entries=2))
    assert (code, ls_ids(first)) == ("OK", everything[:2]) and first.next_token
    code, rest = call(n.controller.ListSnapshots, pb.ListSnapshotsRequest(
        max_entries=2, starting_token=first.next_token))
    assert (code, ls_ids(rest), rest.next_token) == ("OK", everything[2:], "")


LIST_SNAPSHOTS_ERRORS = [
    row("token-garbage", pb.ListSnapshotsRequest(starting_token="!!"), "ABORTED",
        "invalid starting_token", setup=snapshot_world, ran="(lvs)"),
    row("token-not-ours", pb.ListSnapshotsRequest(starting_token="eA.000000000000000000000000"),
        "ABORTED", "not issued by this plugin", setup=snapshot_world, ran="(lvs)"),
    row("negative-max-entries", pb.ListSnapshotsRequest(max_entries=-2), "INVALID_ARGUMENT",
        "max_entries", setup=snapshot_world, ran="(lvs)"),
    row("vg-missing", pb.ListSnapshotsRequest(), "UNAVAILABLE", "volume group",
        setup=chain(snapshot_world, vg_gone), ran="lvs"),
]


@pytest.mark.parametrize("case", LIST_SNAPSHOTS_ERRORS)
def test_list_snapshots_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               case: Case) -> None:
    run_row(tmp_path, monkeypatch, "ListSnapshots", case)


def gs(sid: str = S) -> pb.GetSnapshotRequest:
    return pb.GetSnapshotRequest(snapshot_id=sid)


GET_SNAPSHOT_ERRORS = [
    row("missing-id", gs(""), "INVALID_ARGUMENT", "snapshot_id is required"),
    row("malformed-id", gs("s" * 129), "INVALID_ARGUMENT", "not a valid ID"),
    row("not-our-id", gs(FOREIGN), "NOT_FOUND", "not found", setup=plain_lv()),
    row("volume-id", gs(V), "NOT_FOUND", f"snapshot '{V}' not found", setup=vol()),
    row("missing", gs(), "NOT_FOUND", f"snapshot '{S}' not found", ran="lvs"),
    row("not-a-csi-snapshot", gs(), "NOT_FOUND", "not found", setup=plain_lv(S), ran="lvs"),
    row("vg-missing", gs(), "UNAVAILABLE", "volume group",
        setup=chain(vol(), snap(), vg_gone), ran="lvs"),
]


@pytest.mark.parametrize("case", GET_SNAPSHOT_ERRORS)
def test_get_snapshot_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             case: Case) -> None:
    run_row(tmp_path, monkeypatch, "GetSnapshot", case)


def test_get_snapshot_reply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make_node(tmp_path, monkeypatch)
    snapshot_world(n)
    code, reply = call(n.controller.GetSnapshot, gs(S2))
    assert code == "OK", reply
    lv = n.host.lv(S2)
    assert reply.snapshot == pb.Snapshot(
        snapshot_id=S2, source_volume_id=V, size_bytes=GiB, ready_to_use=True,
        creation_time=Timestamp(seconds=lv.created))
    assert tools(n) == {"lvs"}


# LVM commands per RPC --------------------------------------------------------------

# Every lvm process costs a start and a scan of the devices (0.3-1 s under
# emulation, tens of ms on hardware) and holds the VG lock: each RPC runs the
# fewest, in order; in parentheses, those the committed metadata spares. A
# report the plugin read under the pool lock describes the LV it then makes
# or grows, so nothing is read back after lvcreate/lvextend.
@pytest.mark.parametrize(("method", "request_", "setup", "commands"), [
    pytest.param("CreateVolume", cv(rng=(GiB, 0)), nothing, "(lvs) lvcreate", id="create"),
    pytest.param("CreateVolume", cv(snapshot=S, rng=(GiB, 0)), chain(vol(), snap()),
                 "lvs lvcreate", id="restore"),
    pytest.param("CreateVolume", cv(volume=V, rng=(2 * GiB, 0)), vol(),
                 "lvs lvcreate lvextend", id="grown-clone"),
    pytest.param("CreateVolume", cv(name="vol", rng=(GiB, 0)), vol(vid=vol_id("vol")),
                 "(lvs)", id="retry"),
    pytest.param("ControllerExpandVolume", ce(rng=(2 * GiB, 0)), vol(),
                 "lvs lvs lvextend", id="expand"),
    # Read back: the snapshot's creation time is LVM's, the same in every later
    # reply (GetSnapshot, ListSnapshots, a retried CreateSnapshot).
    pytest.param("CreateSnapshot", cs(), vol(), "lvs lvcreate lvs", id="snapshot"),
    pytest.param("DeleteVolume", pb.DeleteVolumeRequest(volume_id=V), vol(),
                 "(lvs) lvremove", id="delete"),
    pytest.param("GetCapacity", pb.GetCapacityRequest(), nothing, "(lvs)", id="capacity"),
    pytest.param("ListVolumes", pb.ListVolumesRequest(), vol(), "(lvs)", id="list"),
])
def test_lvm_commands_per_rpc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                              request_: Any, setup: Setup, commands: str) -> None:
    n = make_node(tmp_path, monkeypatch)
    setup(n)
    n.host.calls.clear()
    code, reply = call(getattr(n.controller, method), request_)
    assert code == "OK", reply
    assert [c[0] for c in n.host.calls] == expected(commands, n.host.pv_metadata)
