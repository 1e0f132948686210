"""Device classes on the CSI servicers: several thin pools per node, a request
choosing one with the `deviceClass` parameter.

Two classes, in two layouts that every row runs on (unless it says `only`):
- "two-vgs": big on VG hdd (8 MiB extents), fast on VG nvme (4 MiB extents);
- "one-vg": both pools in VG vg0.
The default class, fast, is the *second* in the file, and the host's first VG
is big's, so nothing passes by taking the first class, the first VG or the
host's defaults. The classes differ in everything a row can observe: pool
size (big 30 GiB, fast 10 GiB), over-provisioning ratio (big 1.0 from the
flags, fast 2.0: fast has room for 20 GiB), default file system (big xfs,
fast ext4), extra lvcreate options and pool lock. Expectations are written
from the layouts below, never read back from the plugin's own Pools.

Every row checks the code, a piece of the message, exactly which tools ran,
and for a refusal that no LV of any VG changed; an OK row checks where
things landed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.identity_servicer import IdentityServicer
from csi_local.volumes import naming
from csi_local.volumes.known_vgs import KNOWN_VGS_FILE, KnownVolumeGroups
from csi_local.volumes.lock_keys import pool_key
from csi_local.volumes.naming import Source, SourceKind
from tests.unit import table
from tests.unit.servicers import (
    GiB,
    MiB,
    Node,
    block_cap,
    call,
    make_class_node,
    mount_cap,
    vol_id,
)
from tests.unit.table import Case

# Every test twice: reading the committed metadata, and every read an `lvs`.
pytestmark = pytest.mark.usefixtures("reads")

DEFAULT = "fast"
V, V2, NEW = vol_id("vol"), vol_id("vol2"), vol_id("new")
S, S2 = naming.snapshot_id_for("snap"), naming.snapshot_id_for("snap2")
KIND_V = f"{naming.TAG_KIND}={naming.KIND_VOLUME}"
KIND_S = f"{naming.TAG_KIND}={naming.KIND_SNAPSHOT}"
POOL_SIZES = {"big": 30 * GiB, "fast": 10 * GiB}
ROOM = {"big": 30 * GiB, "fast": 20 * GiB}  # pool size times ratio
# What each class adds to lvcreate of a volume, and the readahead that leaves.
CREATE_ARGS = {"big": ("--readahead", "none"),
               "fast": ("--readahead", "256")}
READAHEAD = {"big": "none", "fast": "256"}


def classes_toml(big_vg: str, fast_vg: str) -> str:
    return "\n".join([
        'default = "fast"',
        "",
        "[classes.big]",
        f'volume_group = "{big_vg}"',
        'thin_pool = "pool"',
        'default_fs_type = "xfs"',
        "",
        "[classes.big.lvcreate]",
        'readahead = "none"',
        "",
        "[classes.fast]",
        f'volume_group = "{fast_vg}"',
        'thin_pool = "thin"',
        "overprovision_ratio = 2.0",
        "",
        "[classes.fast.lvcreate]",
        "readahead = 256",
    ]) + "\n"


@dataclass(frozen=True)
class Layout:
    toml: str
    pools: dict[str, tuple[str, str]]  # class -> (VG, thin pool)
    extents: dict[str, int]  # VG -> extent size

    @property
    def vgs(self) -> list[str]:
        return list(dict.fromkeys(vg for vg, _ in self.pools.values()))


LAYOUTS = {
    "two-vgs": Layout(classes_toml("hdd", "nvme"), {"big": ("hdd", "pool"),
                                                   "fast": ("nvme", "thin")},
                      {"hdd": 8 * MiB, "nvme": 4 * MiB}),
    "one-vg": Layout(classes_toml("vg0", "vg0"), {"big": ("vg0", "pool"),
                                                 "fast": ("vg0", "thin")},
                     {"vg0": 4 * MiB}),
}


@dataclass
class World:
    """A node and the layout it was built from."""

    n: Node
    layout: Layout

    def vg(self, cls: str) -> str:
        return self.layout.pools[cls][0]

    def pool(self, cls: str) -> str:
        return self.layout.pools[cls][1]

    def pool_name(self, cls: str) -> str:
        return "/".join(self.layout.pools[cls])

    def extent(self, cls: str) -> int:
        return self.layout.extents[self.vg(cls)]

    def size(self, cls: str, size: int) -> int:
        """`size` rounded up to the class's VG's extents."""
        e = self.extent(cls)
        return -(-size // e) * e


def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str,
          **node: Any) -> World:
    lay = LAYOUTS[layout]
    n = make_class_node(tmp_path, monkeypatch, lay.toml, pool_sizes=POOL_SIZES,
                        extents=lay.extents, **node)
    return World(n, lay)


# setups -------------------------------------------------------------------------------

Step = Callable[[World], object]


def nothing(w: World) -> None:
    """No setup."""


def chain(*steps: Step) -> Step:
    def run(w: World) -> None:
        for step in steps:
            step(w)
    return run


def vol(cls: str, vid: str = V, size: int = GiB, *, active: bool = True,
        tags: Sequence[str] = ()) -> Step:
    """A CSI volume of class `cls` as CreateVolume would have left it."""
    return lambda w: w.n.host.add_lv(vid, size, vg=w.vg(cls), pool=w.pool(cls), active=active,
                                     tags=[KIND_V, f"{naming.TAG_SIZE}={size}", *tags])


def snap(cls: str, sid: str = S, source: str = V, size: int = GiB) -> Step:
    """A CSI snapshot of `source`, in class `cls`, as CreateSnapshot would have left it."""
    def setup(w: World) -> None:
        vg = w.vg(cls)
        w.n.host.add_lv(sid, size, vg=vg, pool=w.pool(cls), active=False, skip=True,
                        tags=[KIND_S, Source(SourceKind.VOLUME, source).tag()],
                        origin=source if source in w.n.host.vgs[vg].lvs else "")
    return setup


def vg_gone(cls: str) -> Step:
    return lambda w: w.n.host.set_vg_present(w.vg(cls), False)


def vg_back(cls: str) -> Step:
    return lambda w: w.n.host.set_vg_present(w.vg(cls), True)


def _backups(w: World) -> Path:
    """Where the node's LVM keeps its metadata backups (backup/backup_dir)."""
    return Path(w.n.backend.config.state_dir).parent / "lvm-backup"


def started(*, lvm_backups: bool = True) -> Step:
    """The plugin (re)starts: it reads its record of the VGs it has had, and
    records the VGs that are here (KnownVolumeGroups, as CsiPlugin wires it).
    Without `lvm_backups`, LVM keeps no metadata backups."""
    def setup(w: World) -> None:
        backups = _backups(w)
        backups.mkdir(exist_ok=True)
        pools = w.n.backend.pools
        pools.known_vgs = KnownVolumeGroups(w.n.backend.config.state_dir,
                                            lambda: str(backups) if lvm_backups else None)
        for pool in pools:
            pool.known_vgs = pools.known_vgs
        pools.note_volume_groups()
    return setup


def record_lost(w: World) -> None:
    (Path(w.n.backend.config.state_dir) / KNOWN_VGS_FILE).unlink()


def lvm_backup_of(cls: str) -> Step:
    """LVM's metadata backup of the class's VG: the host changed it once."""
    return lambda w: (_backups(w) / w.vg(cls)).write_text("# lvm metadata backup\n")


def pool_usage(cls: str, data: float = 0.0, metadata: float = 0.0) -> Step:
    def setup(w: World) -> None:
        pool = w.n.host.lv(w.pool(cls), w.vg(cls))
        pool.data_percent, pool.metadata_percent = data, metadata
    return setup


def pool_inactive(cls: str) -> Step:
    return lambda w: setattr(w.n.host.lv(w.pool(cls), w.vg(cls)), "active", False)


def pool_lv_gone(cls: str) -> Step:
    return lambda w: w.n.host.vgs[w.vg(cls)].lvs.pop(w.pool(cls))


# requests -----------------------------------------------------------------------------


def params(cls: str | None) -> dict[str, str]:
    return {} if cls is None else {"deviceClass": cls}


def cv(cls: str | None = None, name: str = "new",
       caps: Sequence[pb.VolumeCapability] | None = None, rng: tuple[int, int] | None = None,
       snapshot: str | None = None, volume: str | None = None) -> pb.CreateVolumeRequest:
    source = None
    if snapshot is not None:
        source = pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot))
    elif volume is not None:
        source = pb.VolumeContentSource(
            volume=pb.VolumeContentSource.VolumeSource(volume_id=volume))
    return pb.CreateVolumeRequest(
        name=name, volume_capabilities=[mount_cap()] if caps is None else caps,
        capacity_range=pb.CapacityRange(required_bytes=rng[0], limit_bytes=rng[1])
        if rng is not None else None,
        parameters={"csi.storage.k8s.io/pvc/name": "claim", **params(cls)},
        volume_content_source=source)


def cs(cls: str | None = None, source: str = V, name: str = "snap") -> pb.CreateSnapshotRequest:
    return pb.CreateSnapshotRequest(name=name, source_volume_id=source, parameters=params(cls))


def gc(cls: str | None = None) -> pb.GetCapacityRequest:
    return pb.GetCapacityRequest(parameters=params(cls), volume_capabilities=[mount_cap()])


def ce(vid: str = V, required: int = 2 * GiB) -> pb.ControllerExpandVolumeRequest:
    return pb.ControllerExpandVolumeRequest(
        volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=required))


def stage(cap: pb.VolumeCapability, vid: str = V) -> Callable[[World], pb.NodeStageVolumeRequest]:
    return lambda w: pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=w.n.path("st"),
                                               volume_capability=cap)


def validate(cls: str | None, vid: str = V) -> pb.ValidateVolumeCapabilitiesRequest:
    return pb.ValidateVolumeCapabilitiesRequest(volume_id=vid, parameters=params(cls),
                                                volume_capabilities=[mount_cap()])


# checks of OK rows --------------------------------------------------------------------

Check = Callable[[World, Any], None]


def checks(*all_: Check) -> Check:
    def run(w: World, answer: Any) -> None:
        for c in all_:
            c(w, answer)
    return run


def only_in(w: World, cls: str, name: str) -> None:
    """LV `name` exists once on the node: in class `cls`'s VG and thin pool."""
    assert [vg for vg, lv in w.n.host.all_lvs() if lv == name] == [w.vg(cls)]
    assert w.n.host.lv(name, w.vg(cls)).pool == w.pool(cls)


def _has_run(argv: Sequence[str], part: Sequence[str]) -> bool:
    return any(tuple(argv[i:i + len(part)]) == tuple(part) for i in range(len(argv)))


def made(cls: str, vid: str = NEW, *, size: int | None = None,
         source: str | None = None) -> Check:
    """One lvcreate made volume `vid` in class `cls`'s pool (from `source` in the same
    VG when given), with the class's own lvcreate options."""
    def check(w: World, reply: pb.CreateVolumeResponse) -> None:
        (argv,) = w.n.host.commands("lvcreate")
        if source is None:
            assert argv[argv.index("--thin") + 1] == w.pool_name(cls), argv
        else:
            assert "--snapshot" in argv and argv[-1] == f"{w.vg(cls)}/{source}", argv
        assert _has_run(argv, CREATE_ARGS[cls]), argv
        other = "fast" if cls == "big" else "big"
        assert not _has_run(argv, CREATE_ARGS[other][:2]), argv
        only_in(w, cls, vid)
        lv = w.n.host.lv(vid, w.vg(cls))
        assert lv.readahead == READAHEAD[cls]
        assert reply.volume.volume_id == vid
        if size is not None:
            assert reply.volume.capacity_bytes == lv.size == w.size(cls, size)
    return check


def reused(vid: str = NEW) -> Check:
    def check(w: World, reply: pb.CreateVolumeResponse) -> None:
        assert reply.volume.volume_id == vid and w.n.host.commands("lvcreate") == []
    return check


def snapshot_reused(w: World, reply: pb.CreateSnapshotResponse) -> None:
    assert reply.snapshot.snapshot_id == S and w.n.host.commands("lvcreate") == []


def snapped(cls: str, sid: str = S, source: str = V) -> Check:
    """One lvcreate made snapshot `sid` of `source` in class `cls`'s VG: an LVM
    snapshot object, inactive, without the class's volume options."""
    def check(w: World, reply: pb.CreateSnapshotResponse) -> None:
        (argv,) = w.n.host.commands("lvcreate")
        assert argv[-1] == f"{w.vg(cls)}/{source}", argv
        assert _has_run(argv, ("--setactivationskip", "y")) and "--readahead" not in argv
        only_in(w, cls, sid)
        assert (reply.snapshot.snapshot_id, reply.snapshot.source_volume_id) == (sid, source)
    return check


def removed(cls: str, name: str) -> Check:
    def check(w: World, reply: Any) -> None:
        assert w.n.host.commands("lvremove") == [("lvremove", "--yes", f"{w.vg(cls)}/{name}")]
        assert all(lv != name for _, lv in w.n.host.all_lvs())
    return check


def capacity(cls: str, available: int) -> Check:
    """GetCapacity's answer: `available` bytes (0: room for nothing), in whole extents
    of the class's VG."""
    def check(w: World, reply: pb.GetCapacityResponse) -> None:
        assert reply.available_capacity == available
        if available:
            assert reply.maximum_volume_size.value == available
            assert reply.minimum_volume_size.value == w.extent(cls)
        else:
            assert not reply.HasField("minimum_volume_size")
    return check


def committed_answers(w: World) -> bool:
    """Whether the node reads the classes' VGs' committed metadata and every
    one of them answers (none is missing)."""
    return w.n.host.pv_metadata and all(w.n.host.vgs[vg].present for vg in w.layout.vgs)


def one_lvs(w: World, reply: Any) -> None:
    """One `lvs`, over every class's VG; none where their committed metadata
    answers for all of them."""
    if committed_answers(w):
        assert w.n.host.commands("lvs") == []
        return
    (argv,) = w.n.host.commands("lvs")
    for vg in w.layout.vgs:
        assert vg in argv, argv


def searched(*names: str) -> Check:
    """One `lvs --select` looked for `names` in every class's VG at once."""
    def check(w: World, answer: Any) -> None:
        want = " || ".join(f'lv_name="{n}"' for n in names)
        hits = [c for c in w.n.host.commands("lvs")
                if "--select" in c and c[c.index("--select") + 1] == want
                and all(vg in c for vg in w.layout.vgs)]
        assert len(hits) == 1, w.n.host.commands("lvs")
    return check


def listed(*ids: str) -> Check:
    def check(w: World, reply: Any) -> None:
        got = [e.volume.volume_id if hasattr(e, "volume") else e.snapshot.snapshot_id
               for e in reply.entries]
        assert sorted(got) == sorted(ids)
    return check


def condition(vid: str, abnormal: bool, says: str = "") -> Check:
    def check(w: World, reply: pb.ListVolumesResponse) -> None:
        (entry,) = [e for e in reply.entries if e.volume.volume_id == vid]
        cond = entry.status.volume_condition
        assert cond.abnormal == abnormal, cond.message
        assert says.format(big=w.pool_name("big"), fast=w.pool_name("fast")) in cond.message
    return check


def got_volume(vid: str, says: str) -> Check:
    def check(w: World, reply: pb.ControllerGetVolumeResponse) -> None:
        assert reply.volume.volume_id == vid
        message = reply.status.volume_condition.message
        assert says.format(big=w.pool_name("big"), fast=w.pool_name("fast")) in message
    return check


def grown(cls: str, vid: str, size: int) -> Check:
    def check(w: World, reply: Any) -> None:
        (argv,) = w.n.host.commands("lvextend")
        assert argv[-1] == f"{w.vg(cls)}/{vid}", argv
        got = reply.volume.capacity_bytes if hasattr(reply, "volume") else reply.capacity_bytes
        assert got == w.n.host.lv(vid, w.vg(cls)).size == w.size(cls, size)
    return check


def names_pool(cls: str) -> Check:
    """The error names class `cls`'s thin pool (or its lock)."""
    def check(w: World, message: str) -> None:
        assert w.pool_name(cls) in message, message
    return check


def staged_with(cls: str, fs: str | None) -> Check:
    """Staged from class `cls`'s VG: every lvchange names it, and the file system
    is `fs` (None: a block volume)."""
    def check(w: World, reply: Any) -> None:
        target = f"{w.vg(cls)}/{V}"
        changes = w.n.host.commands("lvchange")
        assert changes and all(c[-1] == target for c in changes), changes
        assert ("lvchange", "--activate", "y", "--ignoreactivationskip", target) in changes
        staging = w.n.state.get(V).staging
        assert staging is not None
        if fs is None:
            assert w.n.host.lv(V, w.vg(cls)).content.fs is None
            return
        (mkfs,) = w.n.host.commands(f"mkfs.{fs}")
        assert mkfs[-1] == f"/dev/{w.vg(cls)}/{V}"
        assert staging.fs_type == fs and w.n.host.lv(V, w.vg(cls)).content.fs == fs
    return check


def validated(message: str) -> Check:
    def check(w: World, reply: pb.ValidateVolumeCapabilitiesResponse) -> None:
        assert reply.message == message and reply.HasField("confirmed") == (not message)
    return check


# the row runner -----------------------------------------------------------------------


def row(id: str, method: str, request: Any, code: str, says: str = "", *,
        setup: Step = nothing, **kw: Any) -> Any:
    """A row of the kit's, its RPC named first (the tables mix Controller and
    Node). `ran`: the tools, or {layout: the tools} where the layouts differ;
    `only`: the one layout the row applies to."""
    return table.row(id, request, code, says, setup=setup, method=method, **kw)


def lv_state(n: Node) -> dict[tuple[str, str], tuple[int, frozenset[str], bool, str]]:
    return {key: (lv.size, frozenset(lv.tags), lv.active, lv.pool)
            for key, lv in n.host.all_lvs().items()}


def by_layout(rows: list[Any]) -> list[Any]:
    """Each row once per layout it applies to."""
    return table.by_variant(rows, list(LAYOUTS))


def send(w: World, method: str, request: Any) -> tuple[str, Any]:
    servicer = w.n.controller if hasattr(w.n.controller, method) else w.n.node
    return call(getattr(servicer, method), request)


# An error row leaves the LVs as they were; an OK row's check says what it made.
# A busy row holds the pool lock of the class it names.
TABLE = table.Table[World](
    send=send, host=lambda w: w.n.host, locks=lambda w: w.n.backend.locks,
    kept=lambda w: {"lvs": lv_state(w.n)}, ok_changes="lvs",
    busy_key=lambda w, cls: pool_key(*w.layout.pools[cls]))


def run_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case, layout: str) -> None:
    TABLE.run(build(tmp_path, monkeypatch, layout, **case.world), case, variant=layout)


# CreateVolume -------------------------------------------------------------------------

CV = "CreateVolume"
KNOWN = "(this node has: big, fast)"

# What CreateVolume reads first: with two VGs, one `lvs` over both (the name
# may be in the other); with one, its VG's report, which the committed
# metadata answers where the node reads it.
READ = {"two-vgs": "lvs", "one-vg": "(lvs)"}
READ_CREATE = {"two-vgs": "lvs lvcreate", "one-vg": "(lvs) lvcreate"}

CREATE = [
    # The class a request names, or the default one.
    row("names-big", CV, cv("big"), "OK", ran=READ_CREATE, check=made("big", size=GiB)),
    row("names-fast", CV, cv("fast"), "OK", ran=READ_CREATE, check=made("fast", size=GiB)),
    row("names-none-default", CV, cv(), "OK", ran=READ_CREATE, check=made("fast")),
    row("names-empty-default", CV, cv(""), "OK", ran=READ_CREATE, check=made("fast")),
    row("unknown-class", CV, cv("gold"), "INVALID_ARGUMENT",
        f"unknown device class 'gold' {KNOWN}"),
    row("class-names-are-exact", CV, cv("Fast"), "INVALID_ARGUMENT",
        f"unknown device class 'Fast' {KNOWN}"),
    # The class's default file system, when the capability names none.
    row("big-fs-default-xfs-minimum", CV, cv("big", caps=[mount_cap("")], rng=(1, 0)), "OK",
        ran=READ_CREATE, check=made("big", size=300 * MiB)),
    row("fast-fs-default-ext4", CV, cv("fast", caps=[mount_cap("")], rng=(1, 0)), "OK",
        ran=READ_CREATE, check=made("fast", size=4 * MiB)),
    # A name is one volume, whatever the class.
    row("name-taken-in-other-class", CV, cv("fast"), "ALREADY_EXISTS",
        "exists in device class 'big', not in 'fast'", setup=vol("big", NEW), ran=READ),
    row("name-taken-in-other-class-default", CV, cv(), "ALREADY_EXISTS",
        "exists in device class 'big', not in 'fast' (the default)", setup=vol("big", NEW),
        ran=READ),
    row("name-taken-in-default-class", CV, cv("big"), "ALREADY_EXISTS",
        "exists in device class 'fast', not in 'big'", setup=vol("fast", NEW), ran=READ),
    row("retry-same-class", CV, cv("big"), "OK", setup=vol("big", NEW), ran=READ,
        check=reused()),
    row("retry-default-class", CV, cv(), "OK", setup=vol("fast", NEW), ran=READ,
        check=reused()),
    # Restores and clones stay in their source's class.
    row("restore-in-source-class", CV, cv("big", snapshot=S), "OK",
        setup=chain(vol("big"), snap("big")), ran="lvs lvcreate",
        check=made("big", source=S, size=GiB)),
    row("restore-bigger-in-source-class", CV, cv("big", snapshot=S, rng=(2 * GiB, 0)), "OK",
        setup=chain(vol("big"), snap("big")), ran="lvs lvcreate lvextend",
        check=checks(made("big", source=S), grown("big", NEW, 2 * GiB))),
    row("restore-naming-other-class", CV, cv("fast", snapshot=S), "INVALID_ARGUMENT",
        f"snapshot {S} is in device class 'big', and what is made from it stays there (a "
        "thin snapshot lives in its origin's pool), but deviceClass asks for 'fast': leave "
        "deviceClass out or set it to 'big'", setup=chain(vol("big"), snap("big")), ran="lvs"),
    # No deviceClass: the source's class (its default file system too).
    row("restore-naming-none-follows-source", CV, cv(snapshot=S, caps=[mount_cap("")],
                                                    rng=(1, 0)), "OK",
        setup=chain(vol("big"), snap("big")), ran="lvs lvcreate",
        check=made("big", source=S, size=GiB)),
    row("restore-naming-none-xfs-minimum-of-source-class", CV,
        cv(snapshot=S, caps=[mount_cap("")], rng=(1, 0)), "OK",
        setup=chain(vol("big", size=100 * MiB), snap("big", size=100 * MiB)),
        ran="lvs lvcreate lvextend", check=made("big", source=S, size=300 * MiB)),
    row("restore-naming-none-source-in-default", CV, cv(snapshot=S), "OK",
        setup=chain(vol("fast"), snap("fast")), ran="lvs lvcreate",
        check=made("fast", source=S)),
    row("restore-naming-unknown-class", CV, cv("gold", snapshot=S), "INVALID_ARGUMENT",
        "unknown device class 'gold'", setup=chain(vol("big"), snap("big"))),
    row("clone-in-source-class", CV, cv("big", volume=V), "OK", setup=vol("big"),
        ran="lvs lvcreate", check=made("big", source=V)),
    row("clone-naming-other-class", CV, cv("fast", volume=V), "INVALID_ARGUMENT",
        f"volume {V} is in device class 'big'", setup=vol("big"), ran="lvs"),
    row("clone-naming-none-source-in-default", CV, cv(volume=V), "OK", setup=vol("fast"),
        ran="lvs lvcreate", check=made("fast", source=V)),
    row("clone-naming-none-follows-source", CV, cv(volume=V), "OK", setup=vol("big"),
        ran="lvs lvcreate", check=made("big", source=V)),
    row("clone-source-missing-in-every-class", CV, cv("big", volume=V), "NOT_FOUND",
        f"volume '{V}' not found", ran="lvs", check=searched(NEW, V)),
    # Each class's room: its own pool, its own ratio, its own high-water marks.
    row("fast-room-is-its-pool-times-its-ratio", CV, cv("fast", rng=(15 * GiB, 0)), "OK",
        ran=READ_CREATE, check=made("fast", size=15 * GiB)),
    row("fast-full-while-big-has-room", CV, cv("fast", rng=(25 * GiB, 0)), "RESOURCE_EXHAUSTED",
        f"has room for {20 * GiB} more bytes", ran=READ, check=names_pool("fast")),
    row("big-has-room-fast-has-not", CV, cv("big", rng=(25 * GiB, 0)), "OK",
        ran=READ_CREATE, check=made("big", size=25 * GiB)),
    row("big-room-less-its-volumes", CV, cv("big", rng=(23 * GiB, 0)), "RESOURCE_EXHAUSTED",
        f"has room for {22 * GiB} more bytes",
        setup=chain(vol("big", V, 8 * GiB), vol("fast", V2, 8 * GiB)), ran=READ,
        check=names_pool("big")),
    row("fast-room-not-taken-by-big-volumes", CV, cv("fast", rng=(20 * GiB, 0)), "OK",
        setup=vol("big", V, 20 * GiB), ran=READ_CREATE, check=made("fast")),
    row("big-above-high-water", CV, cv("big"), "RESOURCE_EXHAUSTED",
        "above its high-water mark: data 95.0% full", setup=pool_usage("big", 95.0),
        ran=READ, check=names_pool("big")),
    row("fast-below-high-water-while-big-above", CV, cv("fast"), "OK",
        setup=pool_usage("big", 95.0), ran=READ_CREATE, check=made("fast")),
    # Each class's pool lock.
    # (With two VGs, one `lvs` over both first: the name may be in the other.)
    row("takes-its-pool-lock", CV, cv("big"), "ABORTED", "already in progress", busy="big",
        ran={"two-vgs": "lvs", "one-vg": ""}, check=names_pool("big")),
    row("not-held-up-by-other-pool-lock", CV, cv("big"), "OK", busy="fast",
        ran=READ_CREATE, check=made("big")),
    # A VG missing: nothing is made in it. Nor in another class while a VG the
    # node has had is missing: the name may be there (volumes/placement.py);
    # a VG the node never had holds nothing, and stops nothing.
    row("class-vg-missing", CV, cv("big"), "UNAVAILABLE", "volume group hdd not found",
        setup=vg_gone("big"), ran="lvs", only="two-vgs"),
    row("other-class-vg-missing", CV, cv("fast"), "UNAVAILABLE",
        f"volume group hdd not found: {NEW} may be there", setup=vg_gone("big"), ran="lvs",
        only="two-vgs"),
    row("other-class-vg-held-then-missing", CV, cv("fast"), "UNAVAILABLE",
        "volume group hdd not found", setup=chain(started(), vg_gone("big"), started()),
        ran="lvs", only="two-vgs"),
    row("other-class-vg-never-here", CV, cv("fast"), "OK",
        setup=chain(vg_gone("big"), started()), ran="lvs lvcreate", only="two-vgs",
        check=made("fast")),
    row("source-may-be-in-missing-vg", CV, cv("fast", volume=V), "UNAVAILABLE",
        "volume group hdd not found", setup=vg_gone("big"), ran="lvs", only="two-vgs"),
    row("source-in-present-vg-other-missing", CV, cv(volume=V), "UNAVAILABLE",
        f"volume group hdd not found: {NEW} may be there",
        setup=chain(vol("fast"), vg_gone("big")), ran="lvs", only="two-vgs"),
    row("source-in-present-vg-other-never-here", CV, cv(volume=V), "OK",
        setup=chain(vol("fast"), vg_gone("big"), started()), ran="lvs lvcreate",
        only="two-vgs", check=made("fast", source=V)),
    row("retry-in-present-vg-while-other-missing", CV, cv("fast"), "OK",
        setup=chain(vol("fast", NEW), vg_gone("big")), ran="lvs", only="two-vgs",
        check=reused()),
]


@pytest.mark.parametrize(("case", "layout"), by_layout(CREATE))
def test_create_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case,
                       layout: str) -> None:
    run_row(tmp_path, monkeypatch, case, layout)


# CreateSnapshot -----------------------------------------------------------------------

CS = "CreateSnapshot"

SNAPSHOT = [
    row("of-big-volume", CS, cs(), "OK", setup=vol("big"), ran="lvs lvcreate",
        check=snapped("big")),
    row("of-fast-volume", CS, cs(), "OK", setup=vol("fast"), ran="lvs lvcreate",
        check=snapped("fast")),
    row("of-big-volume-naming-big", CS, cs("big"), "OK", setup=vol("big"), ran="lvs lvcreate",
        check=snapped("big")),
    row("of-big-volume-naming-fast", CS, cs("fast"), "INVALID_ARGUMENT",
        f"volume {V} is in device class 'big', and what is made from it stays there",
        setup=vol("big"), ran="lvs"),
    row("naming-unknown-class", CS, cs("gold"), "INVALID_ARGUMENT",
        f"unknown device class 'gold' {KNOWN}", setup=vol("big")),
    row("retry-in-big", CS, cs(), "OK", setup=chain(vol("big"), snap("big")), ran="lvs",
        check=snapshot_reused),
    row("retry-in-big-naming-fast", CS, cs("fast"), "INVALID_ARGUMENT",
        f"snapshot {S} is in device class 'big'", setup=chain(vol("big"), snap("big")),
        ran="lvs"),
    row("source-missing-in-every-class", CS, cs("big"), "NOT_FOUND", f"volume '{V}' not found",
        ran="lvs", check=searched(S, V)),
    row("room-of-its-class", CS, cs(), "RESOURCE_EXHAUSTED", f"has room for {14 * GiB}",
        setup=vol("big", V, 16 * GiB), ran="lvs", check=names_pool("big")),
    row("high-water-of-its-class", CS, cs(), "RESOURCE_EXHAUSTED", "high-water mark",
        setup=chain(vol("big"), pool_usage("big", metadata=95.0)), ran="lvs",
        check=names_pool("big")),
    row("other-class-above-high-water", CS, cs(), "OK",
        setup=chain(vol("big"), pool_usage("fast", data=99.0)), ran="lvs lvcreate",
        check=snapped("big")),
    row("takes-its-pool-lock", CS, cs(), "ABORTED", "already in progress", setup=vol("big"),
        busy="big", ran="lvs", check=names_pool("big")),
    row("not-held-up-by-other-pool-lock", CS, cs(), "OK", setup=vol("big"), busy="fast",
        ran="lvs lvcreate", check=snapped("big")),
    row("source-in-missing-vg", CS, cs(), "UNAVAILABLE", "volume group hdd not found",
        setup=chain(vol("big"), vg_gone("big")), ran="lvs", only="two-vgs"),
    # A snapshot lives in its source's pool, but a snapshot of the same name (of
    # another volume) may be in another class's VG that is missing: nothing is
    # made until it is back (volumes/placement.py), unless the node never had it.
    row("source-present-other-vg-missing", CS, cs(), "UNAVAILABLE",
        f"volume group hdd not found: {S} may be there",
        setup=chain(vol("fast"), vg_gone("big")), ran="lvs", only="two-vgs"),
    row("source-present-other-vg-never-here", CS, cs(), "OK",
        setup=chain(vol("fast"), vg_gone("big"), started()), ran="lvs lvcreate",
        only="two-vgs", check=snapped("fast")),
    row("retry-present-other-vg-missing", CS, cs(), "OK",
        setup=chain(vol("fast"), snap("fast"), vg_gone("big")), ran="lvs", only="two-vgs",
        check=snapshot_reused),
]


@pytest.mark.parametrize(("case", "layout"), by_layout(SNAPSHOT))
def test_create_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case,
                         layout: str) -> None:
    run_row(tmp_path, monkeypatch, case, layout)


# DeleteVolume, DeleteSnapshot ---------------------------------------------------------

DV, DS = "DeleteVolume", "DeleteSnapshot"

DELETE = [
    row("volume-in-big", DV, pb.DeleteVolumeRequest(volume_id=V), "OK",
        setup=chain(vol("big"), vol("fast", V2)), ran="(lvs) lvremove",
        check=removed("big", V)),
    row("volume-in-fast", DV, pb.DeleteVolumeRequest(volume_id=V2), "OK",
        setup=chain(vol("big"), vol("fast", V2)), ran="(lvs) lvremove",
        check=removed("fast", V2)),
    row("snapshot-in-big", DS, pb.DeleteSnapshotRequest(snapshot_id=S), "OK",
        setup=chain(vol("big"), snap("big")), ran="lvs lvremove", check=removed("big", S)),
    row("snapshot-in-fast", DS, pb.DeleteSnapshotRequest(snapshot_id=S2), "OK",
        setup=chain(vol("big"), snap("big"), vol("fast", V2), snap("fast", S2, V2)),
        ran="lvs lvremove", check=removed("fast", S2)),
    # (One VG: `lvs VG/ID`, as with the flags' one class.)
    row("volume-unknown", DV, pb.DeleteVolumeRequest(volume_id=V), "OK", ran="lvs",
        check=searched(V), only="two-vgs"),
    row("snapshot-unknown", DS, pb.DeleteSnapshotRequest(snapshot_id=S), "OK", ran="lvs",
        check=searched(S), only="two-vgs"),
    # A VG missing: what is not found may be there, so it is never "gone".
    row("volume-unknown-vg-missing", DV, pb.DeleteVolumeRequest(volume_id=V), "UNAVAILABLE",
        "volume group hdd not found", setup=vg_gone("big"), ran="lvs", only="two-vgs"),
    row("volume-in-missing-vg", DV, pb.DeleteVolumeRequest(volume_id=V), "UNAVAILABLE",
        "volume group hdd not found", setup=chain(vol("big"), vg_gone("big")), ran="lvs",
        only="two-vgs"),
    row("volume-in-present-vg-other-missing", DV, pb.DeleteVolumeRequest(volume_id=V2), "OK",
        setup=chain(vol("big"), vol("fast", V2), vg_gone("big")), ran="lvs lvremove",
        only="two-vgs", check=removed("fast", V2)),
    row("snapshot-unknown-vg-missing", DS, pb.DeleteSnapshotRequest(snapshot_id=S),
        "UNAVAILABLE", "volume group hdd not found", setup=vg_gone("big"), ran="lvs",
        only="two-vgs"),
    row("volume-unknown-default-vg-missing", DV, pb.DeleteVolumeRequest(volume_id=V),
        "UNAVAILABLE", "volume group nvme not found", setup=chain(vol("big", V2),
                                                                  vg_gone("fast")),
        ran="lvs", only="two-vgs"),
]


@pytest.mark.parametrize(("case", "layout"), by_layout(DELETE))
def test_delete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case,
                layout: str) -> None:
    run_row(tmp_path, monkeypatch, case, layout)


# GetCapacity --------------------------------------------------------------------------

GC = "GetCapacity"

CAPACITY = [
    row("fast", GC, gc("fast"), "OK", ran="(lvs)", check=capacity("fast", 20 * GiB)),
    row("big", GC, gc("big"), "OK", ran="(lvs)", check=capacity("big", 30 * GiB)),
    row("default", GC, gc(), "OK", ran="(lvs)", check=capacity("fast", 20 * GiB)),
    row("unknown-class-is-zero", GC, gc("gold"), "OK", check=capacity("fast", 0)),
    row("big-less-its-volumes", GC, gc("big"), "OK",
        setup=chain(vol("big", V, 8 * GiB), vol("fast", V2, 3 * GiB)), ran="(lvs)",
        check=capacity("big", 22 * GiB)),
    row("fast-less-its-volumes", GC, gc("fast"), "OK",
        setup=chain(vol("big", V, 8 * GiB), vol("fast", V2, 3 * GiB)), ran="(lvs)",
        check=capacity("fast", 17 * GiB)),
    row("big-above-high-water", GC, gc("big"), "OK", setup=pool_usage("big", 95.0), ran="(lvs)",
        check=capacity("big", 0)),
    row("fast-while-big-above-high-water", GC, gc("fast"), "OK",
        setup=pool_usage("big", 95.0), ran="(lvs)", check=capacity("fast", 20 * GiB)),
    row("flag-ratio-for-class-without-one", GC, gc("big"), "OK", ran="(lvs)",
        check=capacity("big", 45 * GiB), ratio=1.5),
    row("own-ratio-over-flag-ratio", GC, gc("fast"), "OK", ran="(lvs)",
        check=capacity("fast", 20 * GiB), ratio=1.5),
    row("class-vg-missing-is-zero", GC, gc("big"), "OK", setup=vg_gone("big"), ran="lvs",
        check=capacity("big", 0), only="two-vgs"),
    row("other-class-vg-missing", GC, gc("fast"), "OK", setup=vg_gone("big"), ran="(lvs)",
        check=capacity("fast", 20 * GiB), only="two-vgs"),
    # (Big's VG empty: its extent size from vgs.)
    row("class-pool-missing-is-zero", GC, gc("big"), "OK", setup=pool_lv_gone("big"),
        ran={"two-vgs": "(lvs) (vgs)", "one-vg": "(lvs)"}, check=capacity("big", 0)),
]


@pytest.mark.parametrize(("case", "layout"), by_layout(CAPACITY))
def test_get_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case,
                      layout: str) -> None:
    run_row(tmp_path, monkeypatch, case, layout)


# ListVolumes, ListSnapshots, ControllerGetVolume, ValidateVolumeCapabilities ---------

LV, LS = "ListVolumes", "ListSnapshots"
EVERYTHING = chain(vol("big"), snap("big"), vol("fast", V2), snap("fast", S2, V2))

LISTS = [
    row("volumes-of-both-classes", LV, pb.ListVolumesRequest(), "OK", setup=EVERYTHING,
        ran="(lvs)", check=checks(one_lvs, listed(V, V2), condition(V, False),
                                condition(V2, False))),
    row("snapshots-of-both-classes", LS, pb.ListSnapshotsRequest(), "OK", setup=EVERYTHING,
        ran="(lvs)", check=checks(one_lvs, listed(S, S2))),
    row("snapshots-of-a-big-source", LS, pb.ListSnapshotsRequest(source_volume_id=V), "OK",
        setup=EVERYTHING, ran="(lvs)", check=checks(one_lvs, listed(S))),
    row("snapshot-by-id-in-fast", LS, pb.ListSnapshotsRequest(snapshot_id=S2), "OK",
        setup=EVERYTHING, ran="(lvs)", check=checks(one_lvs, listed(S2))),
    row("condition-of-each-volume's-pool", LV, pb.ListVolumesRequest(), "OK",
        setup=chain(EVERYTHING, pool_usage("big", 95.0)), ran="(lvs)",
        check=checks(one_lvs, condition(V, True, "thin pool {big} is above its high-water"),
                     condition(V2, False))),
    row("condition-of-fast-pool-inactive", LV, pb.ListVolumesRequest(), "OK",
        setup=chain(EVERYTHING, pool_usage("fast", 100.0)), ran="(lvs)",
        check=checks(one_lvs, condition(V, False),
                     condition(V2, True, "thin pool is out of data space"))),
    row("volumes-vg-missing", LV, pb.ListVolumesRequest(), "UNAVAILABLE",
        "volume group hdd not found", setup=chain(EVERYTHING, vg_gone("big")), ran="lvs",
        only="two-vgs"),
    row("snapshots-vg-missing", LS, pb.ListSnapshotsRequest(), "UNAVAILABLE",
        "volume group nvme not found", setup=chain(EVERYTHING, vg_gone("fast")), ran="lvs",
        only="two-vgs"),
    # A pool the node never had fails no listing; one it had may hold volumes
    # (see KnownVolumeGroups), whatever restarts or a lost record in between.
    *[row(f"{what}-vg-never-here", rpc, req, "OK", setup=chain(
        vol("fast", V2), snap("fast", S2, V2), vg_gone("big"), started()), ran="lvs",
        check=checks(one_lvs, listed(found)), only="two-vgs")
      for what, rpc, req, found in (("volumes", LV, pb.ListVolumesRequest(), V2),
                                    ("snapshots", LS, pb.ListSnapshotsRequest(), S2))],
    row("volumes-vg-held-then-missing", LV, pb.ListVolumesRequest(), "UNAVAILABLE",
        "volume group hdd not found",
        setup=chain(EVERYTHING, started(), vg_gone("big"), started()), ran="lvs",
        only="two-vgs"),
    row("snapshots-vg-held-then-missing", LS, pb.ListSnapshotsRequest(), "UNAVAILABLE",
        "volume group hdd not found",
        setup=chain(EVERYTHING, started(), vg_gone("big"), started()), ran="lvs",
        only="two-vgs"),
    row("volumes-vg-missing-record-lost-lvm-had-it", LV, pb.ListVolumesRequest(),
        "UNAVAILABLE", "volume group hdd not found",
        setup=chain(EVERYTHING, started(), vg_gone("big"), record_lost, lvm_backup_of("big"),
                    started()), ran="lvs", only="two-vgs"),
    row("volumes-vg-missing-record-lost-lvm-keeps-no-backups", LV, pb.ListVolumesRequest(),
        "UNAVAILABLE", "volume group hdd not found",
        setup=chain(EVERYTHING, started(), vg_gone("big"), record_lost,
                    started(lvm_backups=False)), ran="lvs", only="two-vgs"),
    row("volumes-vg-never-here-record-lost", LV, pb.ListVolumesRequest(), "OK",
        setup=chain(vol("fast", V2), vg_gone("big"), started(), record_lost, started()),
        ran="lvs", check=listed(V2), only="two-vgs"),
    row("vg-appears-later-is-held", LV, pb.ListVolumesRequest(), "UNAVAILABLE",
        "volume group hdd not found",
        setup=chain(vg_gone("big"), started(), vg_back("big"), started(), vg_gone("big")),
        ran="lvs", only="two-vgs"),
    # Nothing is found where the node never had a pool: gone, not "maybe there".
    row("get-unknown-vg-never-here", "ControllerGetVolume",
        pb.ControllerGetVolumeRequest(volume_id=V), "NOT_FOUND", "not found",
        setup=chain(vol("fast", V2), vg_gone("big"), started()), ran="lvs", only="two-vgs"),
    row("delete-unknown-vg-never-here", "DeleteVolume", pb.DeleteVolumeRequest(volume_id=V),
        "OK", setup=chain(vol("fast", V2), vg_gone("big"), started()), ran="lvs",
        only="two-vgs"),
    row("delete-unknown-vg-held", "DeleteVolume", pb.DeleteVolumeRequest(volume_id=V),
        "UNAVAILABLE", "volume group hdd not found",
        setup=chain(vol("fast", V2), started(), vg_gone("big"), started()), ran="lvs",
        only="two-vgs"),
    # The node's only VG (both classes in it): the same, by `lvs VG/LV`.
    row("delete-unknown-only-vg-never-here", "DeleteVolume",
        pb.DeleteVolumeRequest(volume_id=V), "OK", setup=chain(vg_gone("big"), started()),
        ran="lvs", only="one-vg"),
    row("delete-unknown-only-vg-held", "DeleteVolume", pb.DeleteVolumeRequest(volume_id=V),
        "UNAVAILABLE", "volume group vg0 not found",
        setup=chain(started(), vg_gone("big"), started()), ran="lvs", only="one-vg"),
    row("volumes-only-vg-never-here", LV, pb.ListVolumesRequest(), "OK",
        setup=chain(vg_gone("big"), started()), ran="lvs", check=listed(), only="one-vg"),
    row("get-volume-in-big", "ControllerGetVolume", pb.ControllerGetVolumeRequest(volume_id=V),
        "OK", setup=chain(EVERYTHING, pool_usage("big", 95.0)), ran="(lvs)",
        check=checks(one_lvs, got_volume(V, "thin pool {big} is above its high-water"))),
    row("validate-naming-its-class", "ValidateVolumeCapabilities", validate("big"), "OK",
        setup=vol("big"), ran="lvs", check=validated("")),
    row("validate-naming-none", "ValidateVolumeCapabilities", validate(None), "OK",
        setup=vol("big"), ran="lvs", check=validated("")),
    row("validate-naming-other-class", "ValidateVolumeCapabilities", validate("fast"), "OK",
        setup=vol("big"), ran="lvs",
        check=validated("the volume is in device class 'big', not 'fast'")),
]


@pytest.mark.parametrize(("case", "layout"), by_layout(LISTS))
def test_lists_and_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case,
                           layout: str) -> None:
    run_row(tmp_path, monkeypatch, case, layout)


# NodeStageVolume, ControllerExpandVolume ----------------------------------------------

NS, CE = "NodeStageVolume", "ControllerExpandVolume"

NODE = [
    row("stage-big-without-fs-type-is-xfs", NS, stage(mount_cap("")), "OK",
        setup=vol("big", active=False), ran="lvs lvchange mkfs.xfs mount",
        check=staged_with("big", "xfs")),
    row("stage-fast-without-fs-type-is-ext4", NS, stage(mount_cap("")), "OK",
        setup=vol("fast", active=False), ran="lvs lvchange mkfs.ext4 mount",
        check=staged_with("fast", "ext4")),
    row("stage-big-fs-type-asked", NS, stage(mount_cap("btrfs")), "OK",
        setup=vol("big", active=False), ran="lvs lvchange mkfs.btrfs mount",
        check=staged_with("big", "btrfs")),
    row("stage-big-block", NS, stage(block_cap()), "OK",
        setup=vol("big", active=False), ran="lvs lvchange mount",
        check=staged_with("big", None)),
    row("expand-big-within-its-room", CE, ce(V, 25 * GiB), "OK", setup=vol("big"),
        ran="lvs lvextend", check=grown("big", V, 25 * GiB)),
    row("expand-fast-beyond-its-room", CE, ce(V2, 25 * GiB), "OUT_OF_RANGE",
        f"has room for {19 * GiB} more bytes", setup=vol("fast", V2), ran="lvs",
        check=names_pool("fast")),
    row("expand-fast-by-its-ratio", CE, ce(V2, 15 * GiB), "OK", setup=vol("fast", V2),
        ran="lvs lvextend", check=grown("fast", V2, 15 * GiB)),
    row("expand-takes-its-pool-lock", CE, ce(V), "ABORTED", "already in progress",
        setup=vol("big"), busy="big", ran="lvs", check=names_pool("big")),
    row("expand-not-held-up-by-other-pool-lock", CE, ce(V), "OK", setup=vol("big"),
        busy="fast", ran="lvs lvextend", check=grown("big", V, 2 * GiB)),
    row("expand-in-missing-vg", CE, ce(V), "UNAVAILABLE", "volume group hdd not found",
        setup=chain(vol("big"), vg_gone("big")), ran="lvs", only="two-vgs"),
]


@pytest.mark.parametrize(("case", "layout"), by_layout(NODE))
def test_stage_and_expand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case,
                          layout: str) -> None:
    run_row(tmp_path, monkeypatch, case, layout)


# Probe ---------------------------------------------------------------------------------


def probe_row(id: str, setup: Step, ready: bool, *says: str, only: str = "") -> list[Any]:
    """One row per layout it applies to."""
    return [pytest.param(setup, ready, says, layout, id=f"{id}/{layout}")
            for layout in LAYOUTS if only in ("", layout)]


PROBE = [p for rows in [
    probe_row("every-pool-active", nothing, True),
    probe_row("big-pool-inactive", pool_inactive("big"), False,
              "class big: thin pool {big} is not active"),
    probe_row("fast-pool-inactive", pool_inactive("fast"), False,
              "class fast: thin pool {fast} is not active"),
    probe_row("fast-pool-missing", pool_lv_gone("fast"), False, "class fast:",
              "thin pool {fast} not found"),
    probe_row("both-pools-inactive", chain(pool_inactive("big"), pool_inactive("fast")), False,
              "class big: thin pool {big} is not active",
              "class fast: thin pool {fast} is not active"),
    # A node without a class's VG is ready (as without the flags' VG), and says which.
    probe_row("big-vg-missing", vg_gone("big"), True,
              "volume group hdd not found (device class big)", only="two-vgs"),
    probe_row("both-vgs-missing", chain(vg_gone("big"), vg_gone("fast")), True,
              "volume group hdd not found (device class big)",
              "volume group nvme not found (device class fast)", only="two-vgs"),
    probe_row("big-vg-missing-fast-pool-inactive", chain(vg_gone("big"), pool_inactive("fast")),
              False, "class fast: thin pool {fast} is not active", only="two-vgs"),
] for p in rows]


@pytest.mark.parametrize(("setup", "ready", "says", "layout"), PROBE)
def test_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: Step, ready: bool,
               says: tuple[str, ...], layout: str) -> None:
    w = build(tmp_path, monkeypatch, layout)
    setup(w)
    ident = IdentityServicer(w.n.backend.config, w.n.backend.pools)
    w.n.host.calls.clear()
    got, message = ident.pool_status()
    # One `lvs` selecting every class's pool over the classes' VGs, however many;
    # none where their committed metadata and the pools' status answer.
    if committed_answers(w):
        assert w.n.host.calls == []
    else:
        (call,) = w.n.host.calls
        assert call[0] == "lvs"
        for cls in ("big", "fast"):
            vg, _, pool = w.pool_name(cls).partition("/")
            assert vg in call and f'lv_name="{pool}"' in " ".join(call)
    assert got is ready, message
    if not says:
        assert message is None
    for piece in says:
        assert message is not None
        assert piece.format(big=w.pool_name("big"), fast=w.pool_name("fast")) in message, message
    if ready and message is not None:  # a missing VG does not hide another class's
        assert "not active" not in message


# The record of the VGs a node has had (KnownVolumeGroups) ------------------------------


def test_a_vg_is_on_record_before_its_first_volume(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that was not here at start and came later: its first CreateVolume
    records it (no restart in between), so once it goes missing again its
    volumes are never left out of a listing."""
    w = build(tmp_path, monkeypatch, "two-vgs")
    chain(vol("fast", V2), vg_gone("big"), started())(w)
    state = Path(w.n.backend.config.state_dir)
    assert json.loads((state / KNOWN_VGS_FILE).read_text())["volume_groups"] == ["nvme"]
    assert call(w.n.controller.ListVolumes, pb.ListVolumesRequest())[0] == "OK"
    vg_back("big")(w)
    code, reply = call(w.n.controller.CreateVolume, cv("big"))
    assert code == "OK", reply
    assert json.loads((state / KNOWN_VGS_FILE).read_text())["volume_groups"] == ["hdd", "nvme"]
    vg_gone("big")(w)
    code, says = call(w.n.controller.ListVolumes, pb.ListVolumesRequest())
    assert (code, "volume group hdd not found" in says) == ("UNAVAILABLE", True), says


def test_the_record_file(tmp_path: Path) -> None:
    asked: list[int] = []
    backups = tmp_path / "backup"
    backups.mkdir()
    (backups / "had").write_text("")

    def backup_dir() -> str:
        asked.append(1)
        return str(backups)

    state = tmp_path / "state"
    state.mkdir()
    known = KnownVolumeGroups(str(state), backup_dir)
    assert known.known(["x", "y"]) == ["x", "y"]  # before the first seed: all may hold volumes
    known.add("z")  # and nothing is recorded before it
    assert not (state / KNOWN_VGS_FILE).exists()
    known.seed(["here"], ["had", "never"])
    assert asked == [1]  # LVM's backups answer only for the missing VGs, once, at the seed
    assert known.known(["had", "never", "here"]) == ["had", "here"]
    text = (state / KNOWN_VGS_FILE).read_text()
    assert json.loads(text) == {"version": 1, "volume_groups": ["had", "here"]}
    assert [p.name for p in state.iterdir()] == [KNOWN_VGS_FILE]  # no temporary file left
    mtime = (state / KNOWN_VGS_FILE).stat().st_mtime_ns
    known.add("here")
    known.seed(["here"], ["never"])
    assert (state / KNOWN_VGS_FILE).stat().st_mtime_ns == mtime  # nothing new: not rewritten
    known.add("new")
    again = KnownVolumeGroups(str(state), backup_dir)  # a restart reads it back
    assert again.known(["had", "never", "new"]) == ["had", "new"]
    assert asked == [1]
    # A damaged record is made again from LVM, as a missing one.
    for damaged in ("{", '{"volume_groups": "x"}', "[]"):
        (state / KNOWN_VGS_FILE).write_text(damaged)
        known = KnownVolumeGroups(str(state), lambda: None)  # LVM keeps no backups
        assert known.known(["never"]) == ["never"]
        known.seed(["here"], ["never"])
        assert known.known(["never", "gone"]) == ["never"]


@pytest.mark.parametrize(("backups", "says"), [
    ("dir", "per LVM's metadata backups in {d}): had"),
    ("none", "LVM's metadata backups are off or their directory unknown, so every one "
             "counts): had, never"),
    ("missing", "LVM's metadata backup directory {d} does not exist, so every one counts): "
                "had, never")])
def test_the_log_says_how_missing_vgs_were_judged(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  backups: str, says: str) -> None:
    """"per LVM's metadata backups" only when there were backups to read:
    otherwise every missing VG counts as held, and the log says why."""
    directory = tmp_path / "backup"
    if backups == "dir":
        directory.mkdir()
        (directory / "had").write_text("")
    state = tmp_path / "state"
    state.mkdir()
    known = KnownVolumeGroups(str(state), lambda: None if backups == "none" else str(directory))
    with caplog.at_level(logging.INFO, logger="csi_local.volumes.known_vgs"):
        known.seed(["here"], ["had", "never"])
    (record,) = caplog.records
    assert record.getMessage() == ("volume groups missing at start: had, never; known to this "
                                   "node before (" + says.format(d=directory))
    assert "per LVM" not in record.getMessage() or backups == "dir"

