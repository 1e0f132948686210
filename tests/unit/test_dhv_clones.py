"""csi-local-dhv's golden-volume clones (the source_volume and source_snapshot
parameters), its operator snapshots (`csi-local-dhv snapshot ...`) and its
refusal of attachment_mode=block-device, on a FakeHost.

Tables in the style of test_node.py: one row per branch, with the request, the
setup, the fragment of the error that names the branch, and what must not have
changed (refusals leave no LV, no mount and no directory, and run nothing but
`lvs`). Success tests check the LV (a thin snapshot of its source, its tags),
the mount, and the exact commands (never a mkfs; btrfstune before a btrfs
clone's first mount; syncfs of a mounted source before lvcreate --snapshot).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from csi_local.dhv import removal as dhv_removal
from csi_local.dhv import snapshot as dhv_snapshot
from csi_local.dhv.config import PluginConfig
from csi_local.dhv.host_volumes import HostVolumes
from csi_local.dhv.request import (
    DhvError,
    Parameters,
    lv_name_for,
    parse_parameters,
    snapshot_lv_name,
)
from csi_local.errors import StorageError
from csi_local.host.runner import Result
from csi_local.host.volume_users import VolumeUsers
from csi_local.storage import vg_text
from csi_local.storage.lvm import hex_tag
from csi_local.volumes.host_volume_names import (
    TAG_FRESH,
    TAG_FS,
    TAG_GROW_FS,
    TAG_ID,
    TAG_KIND,
    TAG_NAME,
    TAG_NAMESPACE,
    TAG_NEW_FSID,
    TAG_SNAPSHOT,
    TAG_SOURCE,
    TAG_SOURCE_NAME,
)
from tests.dhvharness import Nomad, failed, run, run_main
from tests.unit.dhvnode import DhvNode
from tests.unit.fakehost import FakeHost, FakeLv, GiB, MiB
from tests.unit.fakes.common import WholeOutputStreams

VG, POOL = "vg0", "pool0"
SRC, SRC_NAME = "golden-1", "golden"  # the source volume: its Nomad ID and name
SRC2 = "golden-2"  # another volume (same name in some rows)
NEW, NEW_NAME = "clone-1", "clone"  # the volume being created
SNAP, SNAP2 = "gold-v1", "gold-v2"
NS, NS2 = "default", "prod"
SRC_SIZE = 320 * MiB  # above mkfs.xfs's minimum, so every fs can be the source's
GROWN = 420 * MiB  # a capacity_min above the source's size (whole 4 MiB extents)


def hexed(text: str) -> str:
    return text.encode().hex()


# the node ---------------------------------------------------------------------------------


class Dhv(DhvNode):
    """One node: its fake host and the plugin's configuration."""

    def lv(self, vid: str) -> FakeLv:
        return self.host.lvs[lv_name_for(vid)]

    def has_lv(self, vid: str) -> bool:
        return lv_name_for(vid) in self.host.lvs

    def snap_lv(self, name: str = SNAP) -> FakeLv:
        return self.host.lvs[snapshot_lv_name(name)]


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, pool_size: int = 10 * GiB,
         ratio: float = 1.0) -> Dhv:
    # delete looks for users in /proc: none on a fake host
    monkeypatch.setattr(dhv_removal, "volume_users", lambda *a, **k: VolumeUsers((), ()))
    monkeypatch.setattr(dhv_removal, "_SETTLE", ())
    config = PluginConfig(volume_group=VG, thin_pool=POOL, lock_dir=str(tmp_path / "locks"),
                          overprovision_ratio=ratio)
    return Dhv(FakeHost(VG, POOL, pool_size=pool_size), config, tmp_path)


@pytest.fixture
def d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Dhv:
    return make(tmp_path, monkeypatch)


def message_of(err: BaseException) -> str:
    message = getattr(err, "message", None)
    return message if isinstance(message, str) and message else str(err)


def refused(fn: Callable[[], object]) -> str:
    """The message of the error `fn` raises (a DhvError or a StorageError)."""
    try:
        fn()
    except (DhvError, StorageError) as err:  # StorageError: NoRoom, CommandError, ...
        return message_of(err)
    raise AssertionError("no error")


def state(d: Dhv) -> dict[str, object]:
    return {
        "lvs": {name: (lv.size, frozenset(lv.tags), lv.active, lv.skip, lv.origin,
                       dataclasses.astuple(lv.content)) for name, lv in d.host.lvs.items()},
        "mounts": d.host.mounts(),
    }


def index(calls: Sequence[tuple[str, ...]], pred: Callable[[tuple[str, ...]], bool]) -> int:
    found = [i for i, c in enumerate(calls) if pred(c)]
    assert len(found) == 1, calls
    return found[0]


def is_snapshot_create(c: tuple[str, ...]) -> bool:
    return c[0] == "lvcreate" and "--snapshot" in c


def formatted(d: Dhv) -> list[tuple[str, ...]]:
    return [c for c in d.host.calls if c[0].startswith("mkfs") or c[0] == "wipefs"]


# setups: each brings the node to a state before the call ------------------------------------

Setup = Callable[[Dhv], object]


def chain(*steps: Setup) -> Setup:
    def run(d: Dhv) -> None:
        for step in steps:
            step(d)
    return run


def nothing(d: Dhv) -> None:
    """No setup."""


def source(fs: str = "ext4", *, vid: str = SRC, name: str = SRC_NAME, ns: str = NS,
           size: int = SRC_SIZE) -> Setup:
    """A volume made by the plugin (formatted with `fs`, mounted at its path)."""
    return lambda d: d.create(vid, name=name, params={"fs_type": fs}, cap_min=size, ns=ns)


def vol_tags(vid: str, name: str, ns: str, fs: str | None, *extra: str) -> list[str]:
    tags = [f"{TAG_KIND}=volume", f"{TAG_ID}={vid}", *hex_tag(TAG_NAME, name),
            *hex_tag(TAG_NAMESPACE, ns), *extra]
    return tags + ([f"{TAG_FS}={fs}"] if fs else [])


def lv_only(vid: str = SRC, *, name: str = SRC_NAME, ns: str = NS, fs: str | None = "ext4",
            tags: Sequence[str] = (), content: str | None = "ext4") -> Setup:
    """A volume's LV as an earlier run left it (unmounted), with these tags."""
    return lambda d: d.host.add_lv(lv_name_for(vid), SRC_SIZE,
                                   tags=vol_tags(vid, name, ns, fs, *tags), fs=content)


def never_formatted(vid: str = SRC, name: str = SRC_NAME) -> Setup:
    """A volume whose first create has not got past mkfs."""
    return lv_only(vid, name=name, tags=[TAG_FRESH], content=None)


def snapshot(vid: str = SRC, name: str = SNAP) -> Setup:
    return lambda d: d.plugin().snapshot_create(vid, name)


def deleted(vid: str) -> Setup:
    return lambda d: d.delete(vid)


def snapshot_deleted(name: str = SNAP) -> Setup:
    return lambda d: d.plugin().snapshot_delete(name)


def metadata_area_full(d: Dhv) -> None:
    """The VG's metadata area with no room for one more LV (pool.lvs_that_fit)."""
    fvg = d.host.vgs[VG]
    fvg.mda_padding += vg_text.max_text_size(fvg.mda_size) - fvg.mda_text - 1024


def pool_percent(data: float) -> Setup:
    def run(d: Dhv) -> None:
        d.host.lvs[POOL].data_percent = data
    return run


# parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,want", [
    pytest.param({"source_volume": SRC}, Parameters(None, (), source_volume=SRC), id="by-id"),
    pytest.param({"source_volume": "my golden volume"},
                 Parameters(None, (), source_volume="my golden volume"), id="by-name"),
    pytest.param({"source_volume": "  golden "}, Parameters(None, (), source_volume="golden"),
                 id="trimmed"),
    pytest.param({"source_snapshot": SNAP}, Parameters(None, (), source_snapshot=SNAP),
                 id="snapshot"),
    pytest.param({"source_volume": "", "source_snapshot": SNAP},
                 Parameters(None, (), source_snapshot=SNAP), id="empty-one-is-none"),
    pytest.param({"source_volume": SRC, "fs_type": "xfs", "mount_options": "noatime"},
                 Parameters("xfs", ("noatime",), source_volume=SRC), id="with-fs-and-options"),
    pytest.param({"attachment_mode": "file-system"}, Parameters(None, ()),
                 id="file-system-no-effect"),
    pytest.param({"attachment_mode": "file-system", "source_snapshot": SNAP},
                 Parameters(None, (), source_snapshot=SNAP), id="file-system-with-source"),
])
def test_parameters_accepted(raw: dict[str, str], want: Parameters) -> None:
    params = parse_parameters(json.dumps(raw))
    assert params == want
    kind = "volume" if want.source_volume else "snapshot" if want.source_snapshot else None
    assert params.source == (None if kind is None else
                             (kind, want.source_volume or want.source_snapshot))


@pytest.mark.parametrize("raw,says", [
    pytest.param({"source_volume": SRC, "source_snapshot": SNAP}, "not both", id="both"),
    *[pytest.param({"source_snapshot": bad}, "snapshot name", id=f"snapshot-name-{i}")
      for i, bad in enumerate(["-x", "a/b", "a..b", "..", "x" * 129, "é", "a b", ".x"])],
    pytest.param({"source_volume": "gol\nden"}, "is not a volume ID, name", id="newline"),
    pytest.param({"source_volume": "a\x00b"}, "is not a volume ID, name", id="nul"),
    pytest.param({"source_volume": "gol\tden"}, "is not a volume ID, name", id="tab"),
    pytest.param({"source_snapshot": "a\x1bb"}, "is not a volume ID, name", id="escape"),
    pytest.param({"source_volume": "x" * 257}, "is not a volume ID, name", id="too-long"),
    pytest.param({"source_volume": 5}, "must be a string", id="not-a-string"),
    pytest.param({"attachment_mode": "block-device"}, "block-device", id="block-device"),
    pytest.param({"attachment_mode": "block-device", "source_volume": SRC}, "block-device",
                 id="block-device-clone"),
    pytest.param({"attachment_mode": "block"}, "unknown attachment_mode 'block'",
                 id="attachment-block"),
    pytest.param({"attachment_mode": "File-System"}, "unknown attachment_mode",
                 id="attachment-case"),
])
def test_parameters_refused(raw: dict[str, object], says: str) -> None:
    with pytest.raises(DhvError) as err:
        parse_parameters(json.dumps(raw))
    assert says in str(err.value), str(err.value)


def test_block_device_message_says_nomad_does_not_support_it() -> None:
    with pytest.raises(DhvError) as err:
        parse_parameters('{"attachment_mode":"block-device"}')
    assert "block-device" in str(err.value) and "Nomad" in str(err.value)
    assert "not supported" in str(err.value)


def test_block_device_create_fails_with_json_before_any_work(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # no configuration file at all: refused on the request alone
    res = run(Nomad(str(tmp_path / "v"), str(tmp_path)), "create", NEW, monkeypatch,
              cap_min=SRC_SIZE, params={"attachment_mode": "block-device"}, namespace=NS)
    assert res.rc == 1
    failed(res, "block-device")
    assert not (tmp_path / "v").exists()


# clones ---------------------------------------------------------------------------------------

VIA = {
    # how the request names the source: parameters, the source tag, asked by name
    "id": ({"source_volume": SRC}, f"volume:{SRC}", False),
    "name": ({"source_volume": SRC_NAME}, f"volume:{SRC}", True),
    "snapshot": ({"source_snapshot": SNAP}, f"snapshot:{SNAP}", False),
}


@pytest.mark.parametrize("via", list(VIA))
@pytest.mark.parametrize("fs", ["ext4", "xfs", "btrfs"])
def test_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str, via: str) -> None:
    d = make(tmp_path, monkeypatch)
    source(fs)(d)
    if via == "snapshot":
        snapshot()(d)
    params, source_tag, _ = VIA[via]
    origin = snapshot_lv_name(SNAP) if via == "snapshot" else lv_name_for(SRC)
    src_before = state(d)["lvs"]
    d.host.calls.clear()

    assert d.create(NEW, name=NEW_NAME, params={**params, "mount_options": "noatime"}) \
        == (d.path(NEW), SRC_SIZE)

    lv = d.lv(NEW)
    calls = d.host.calls
    # a writable thin snapshot of the source, active, with its source's file system
    assert lv.origin == origin and lv.kind == "thin"
    assert lv.active and not lv.skip
    assert lv.content.fs == fs and lv.size == SRC_SIZE
    assert [c[-1] for c in calls if is_snapshot_create(c)] == [f"{VG}/{origin}"]
    assert formatted(d) == []  # never formatted
    # Tagged new-fsid whatever its file system (the CSI plugin's rule too: see
    # volumes/lifecycle), the tag dropped at its first mount.
    (made,) = [c for c in calls if is_snapshot_create(c)]
    assert TAG_NEW_FSID in made[made.index("--addtag"):]
    assert ("lvchange", "--deltag", TAG_NEW_FSID, f"{VG}/{lv.name}") in calls
    want = {f"{TAG_KIND}=volume", f"{TAG_ID}={NEW}", f"{TAG_FS}={fs}",
            f"{TAG_SOURCE}={source_tag}", f"{TAG_NAME}={hexed(NEW_NAME)}",
            f"{TAG_NAMESPACE}={hexed(NS)}"}
    if via != "snapshot":  # a volume source's name is kept, whichever way it was named
        want.add(f"{TAG_SOURCE_NAME}={hexed(SRC_NAME)}")
    assert lv.tags == want  # no fresh, new-fsid or grow-fs tag
    # mounted at its path, with its mount options, beside its (mounted) source
    d.mounted(NEW, fs)
    d.mounted(SRC, fs)
    top = d.host.top_mount(d.path(NEW))
    assert top is not None and "noatime" in top.options
    (mount,) = [c for c in calls if c[0] == "mount"]
    assert mount[-2:] == (d.host.lv_path(lv.name), d.path(NEW))
    if fs == "xfs":
        assert "nouuid" in mount[mount.index("-o") + 1].split(",")
    tune = [i for i, c in enumerate(calls) if c[0] == "btrfstune"]
    if fs == "btrfs":
        assert [calls[i] for i in tune] == [("btrfstune", "-f", "-m",
                                             d.host.lv_path(lv.name))]
        assert tune[0] < calls.index(mount)
        assert lv.content.uuid != d.lv(SRC).content.uuid
    else:
        assert tune == []
        assert lv.content.uuid == d.lv(SRC).content.uuid  # a copy, left as it is
    # a mounted source's file system is committed just before the snapshot
    syncs = [i for i, c in enumerate(calls) if c[0] == "sync"]
    if via == "snapshot":
        assert syncs == []  # an inactive snapshot: nothing mounted to commit
    else:
        assert [calls[i] for i in syncs] == [("sync", "--file-system", d.path(SRC))]
        assert syncs[0] < index(calls, is_snapshot_create)
    # the source is untouched
    after = state(d)["lvs"]
    assert isinstance(after, dict) and isinstance(src_before, dict)
    assert {k: v for k, v in after.items() if k != lv.name} == src_before


@pytest.mark.parametrize("fs,grow", [
    ("ext4", ("resize2fs", "@dev")),
    ("xfs", ("xfs_growfs", "@path")),
    ("btrfs", ("btrfs", "filesystem", "resize", "max", "@path")),
])
@pytest.mark.parametrize("via", ["id", "snapshot"])
def test_grown_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str,
                     grow: tuple[str, ...], via: str) -> None:
    d = make(tmp_path, monkeypatch)
    source(fs)(d)
    if via == "snapshot":
        snapshot()(d)
    d.host.calls.clear()
    params = VIA[via][0]
    assert d.create(NEW, params=params, cap_min=GROWN - MiB, cap_max=GiB) \
        == (d.path(NEW), GROWN)
    lv = d.lv(NEW)
    calls = d.host.calls
    assert lv.size == GROWN and lv.content.fs_size == GROWN  # the fs spans the LV
    assert d.lv(SRC).size == SRC_SIZE
    assert ("lvextend", "--size", f"{GROWN}b", f"{VG}/{lv.name}") in calls
    want = tuple({"@dev": d.host.lv_path(lv.name), "@path": d.path(NEW)}.get(a, a)
                 for a in grow)
    grew = index(calls, lambda c: c == want)
    assert grew > index(calls, lambda c: c[0] == "mount")  # online, at its first mount
    assert TAG_GROW_FS not in lv.tags and TAG_NEW_FSID not in lv.tags
    assert formatted(d) == []
    d.mounted(NEW, fs)


@pytest.mark.parametrize("readable", [True, False])
def test_fresh_tag_alone_never_formats(d: Dhv, readable: bool) -> None:
    """A volume whose first create stopped inside mkfs (blocks mapped, nothing
    blkid knows, the fresh tag still on): formatted again while the kernel's
    count of its mapped blocks can be read, never when it cannot (the tag
    alone once sufficed). The rule is both plugins': lifecycle.freshness."""
    never_formatted()(d)
    d.lv(SRC).content.written = True
    if not readable:
        d.host.thin_status_error = True  # a failed pool: no count
    d.host.calls.clear()
    if readable:
        source()(d)
        assert [c[0] for c in formatted(d)] == ["mkfs.ext4"]
        assert TAG_FRESH not in d.lv(SRC).tags
        d.mounted(SRC, "ext4")
    else:
        assert "has been used before" in refused(lambda: source()(d))
        assert formatted(d) == [] and d.lv(SRC).content.fs is None
        assert TAG_FRESH in d.lv(SRC).tags


def test_clone_by_name_is_found_in_its_own_namespace(d: Dhv) -> None:
    source(vid=SRC, ns=NS)(d)
    source(vid=SRC2, ns=NS2)(d)  # the same name in another namespace
    d.create(NEW, params={"source_volume": SRC_NAME}, ns=NS)
    d.create("clone-2", params={"source_volume": SRC_NAME}, ns=NS2)
    assert d.lv(NEW).origin == lv_name_for(SRC)
    assert d.lv("clone-2").origin == lv_name_for(SRC2)
    assert f"{TAG_NAMESPACE}={hexed(NS2)}" in d.lv("clone-2").tags


def test_clone_of_a_clone_and_of_an_unmounted_source(d: Dhv) -> None:
    lv_only(fs="ext4")(d)  # not mounted (a node restart, say): nothing to sync
    d.create(NEW, params={"source_volume": SRC})
    d.host.calls.clear()
    d.create("clone-2", params={"source_volume": NEW})
    assert d.lv("clone-2").origin == d.lv(NEW).name
    assert ("sync", "--file-system", d.path(NEW)) in d.host.calls
    lv_only(vid=SRC2, name="cold")(d)
    d.host.calls.clear()
    d.create("clone-3", params={"source_volume": SRC2})
    assert "sync" not in d.tools() and formatted(d) == []
    d.mounted("clone-3", "ext4")


# refusals: nothing made ------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    params: dict[str, str]
    says: str
    setup: Setup
    ns: str = NS
    cap_min: int = 0
    cap_max: int = 0
    pool_size: int = 10 * GiB


SOURCE = source()  # the source of most rows: an ext4 volume, mounted


def refusal(id: str, params: dict[str, str], says: str, setup: Setup = SOURCE, *,
            xfail: str = "", **kw: Any) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(Refusal(params, says, setup, **kw), id=id, marks=marks)


BY_ID, BY_NAME, BY_SNAP = ({"source_volume": SRC}, {"source_volume": SRC_NAME},
                           {"source_snapshot": SNAP})
SNAPPED = chain(source(), snapshot())

REFUSALS = [
    refusal("unknown-id", {"source_volume": "no-such-id"},
            "source_volume 'no-such-id': no host volume with that ID, or that name"),
    refusal("unknown-name", {"source_volume": "no such name"},
            "no host volume with that ID, or that name in namespace 'default'"),
    refusal("unknown-snapshot", {"source_snapshot": "nope"}, "source_snapshot 'nope' not found"),
    refusal("snapshot-deleted", BY_SNAP, "not found", chain(SNAPPED, snapshot_deleted())),
    refusal("no-source-at-all", BY_ID, "no host volume", nothing),
    refusal("id-in-another-namespace", BY_ID,
            "source volume 'golden-1' is in namespace 'prod', not 'default'", source(ns=NS2)),
    refusal("name-in-another-namespace", BY_NAME,
            "source volume 'golden' is in namespace 'prod', not 'default'", source(ns=NS2)),
    refusal("snapshot-in-another-namespace", BY_SNAP,
            "source snapshot 'gold-v1' is in namespace 'prod', not 'default'",
            chain(source(ns=NS2), snapshot())),
    refusal("never-formatted-by-id", BY_ID, "was never formatted", never_formatted()),
    refusal("never-formatted-by-name", BY_NAME, "was never formatted", never_formatted()),
    refusal("no-fs-tag", BY_ID, "has no usable csi-local-dhv.fs tag", lv_only(fs=None)),
    refusal("capacity-max-below-source", BY_ID, "more than capacity_max",
            cap_max=SRC_SIZE - 4 * MiB),
    refusal("capacity-max-below-snapshot", BY_SNAP, "more than capacity_max", SNAPPED,
            cap_max=100 * MiB),
    refusal("fs-type-differs", {**BY_ID, "fs_type": "xfs"},
            "the source holds a ext4 file system, not xfs"),
    refusal("fs-type-differs-from-snapshot", {**BY_SNAP, "fs_type": "btrfs"},
            "holds a ext4 file system, not btrfs", SNAPPED),
    refusal("name-matches-two-volumes", BY_NAME, "names 2 host volumes in namespace 'default'",
            chain(source(), source(vid=SRC2))),
    refusal("pool-without-room", BY_ID, "has room for", pool_size=600 * MiB),
    refusal("pool-without-room-for-snapshot-clone", BY_SNAP, "has room for",
            # the snapshot made at room; the pool then filled by another volume
            chain(SNAPPED, source(vid=SRC2, name="filler", size=1100 * MiB)),
            pool_size=2 * GiB),
    refusal("pool-without-room-once-grown", BY_ID, "has room for", cap_min=800 * MiB,
            pool_size=GiB),
    refusal("pool-above-high-water-mark", BY_ID, "above its high-water mark",
            chain(source(), pool_percent(95.0))),
    # The same rule as the CSI plugin's (Pool.admit): no LV LVM would fail to record.
    refusal("metadata-area-full", {}, "the metadata area of volume group vg0 is",
            metadata_area_full),
    refusal("metadata-area-full-clone", BY_ID, "pvcreate --metadatasize",
            chain(source(), metadata_area_full)),
]


@pytest.mark.parametrize("row", REFUSALS)
def test_clone_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: Refusal) -> None:
    d = make(tmp_path, monkeypatch, pool_size=row.pool_size)
    row.setup(d)
    before = state(d)
    d.host.calls.clear()
    says = refused(lambda: d.create(NEW, params=row.params, cap_min=row.cap_min,
                                       cap_max=row.cap_max, ns=row.ns))
    assert row.says in says, says
    assert d.tools() == {"lvs"}, d.host.calls  # looked, made nothing
    assert state(d) == before
    assert not d.has_lv(NEW)
    assert not os.path.lexists(d.path(NEW))


def test_name_in_another_namespace_says_so(d: Dhv) -> None:
    source(ns=NS2)(d)
    says = refused(lambda: d.create(NEW, params=BY_NAME, ns=NS))
    assert "namespace 'prod'" in says, says


# idempotency -------------------------------------------------------------------------------------


@pytest.mark.parametrize("via", list(VIA))
@pytest.mark.parametrize("fs", ["ext4", "btrfs"])
def test_clone_create_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str,
                            via: str) -> None:
    d = make(tmp_path, monkeypatch)
    chain(source(fs), snapshot())(d)
    params = VIA[via][0]
    first = d.create(NEW, params=params, cap_min=GROWN)
    before = state(d)
    d.host.calls.clear()
    assert d.create(NEW, params=params, cap_min=GROWN) == first == (d.path(NEW), GROWN)
    assert state(d) == before
    assert d.tools() <= {"lvs", "blkid"}, d.host.calls  # no lvcreate, lvextend, mount...
    # the node restarts: nothing mounted; Nomad repeats the create
    for vid in (NEW, SRC):
        d.host.run(["umount", d.path(vid)])
    source(fs)(d)  # the source first, so a btrfs clone must mount beside it
    d.host.calls.clear()
    assert d.create(NEW, params=params, cap_min=GROWN) == first
    assert d.tools() <= {"lvs", "blkid", "mount"}, d.host.calls  # no btrfstune, no mkfs
    d.mounted(NEW, fs)
    d.mounted(SRC, fs)


CHANGED = [
    pytest.param(BY_ID, {"source_volume": SRC2}, "was made from volume:golden-1",
                 id="by-id-other-id"),
    pytest.param(BY_NAME, {"source_volume": "other"}, "its source cannot change to volume "
                 "'other'", id="by-name-other-name"),
    pytest.param(BY_NAME, {"source_volume": SRC2}, "its source cannot change",
                 id="by-name-other-id"),
    pytest.param(BY_ID, BY_SNAP, "its source cannot change to snapshot 'gold-v1'",
                 id="volume-to-snapshot"),
    pytest.param(BY_SNAP, BY_ID, "was made from snapshot:gold-v1", id="snapshot-to-volume"),
    pytest.param(BY_SNAP, {"source_snapshot": SNAP2}, "its source cannot change",
                 id="other-snapshot"),
    pytest.param({}, BY_ID, "was not made from a source", id="plain-volume-given-a-source"),
]


@pytest.mark.parametrize("made,again,says", CHANGED)
def test_changed_source_refused(d: Dhv, made: dict[str, str], again: dict[str, str],
                                says: str) -> None:
    chain(source(), source(vid=SRC2, name="other"), snapshot(), snapshot(SRC2, SNAP2))(d)
    d.create(NEW, params=made or None)
    before = state(d)
    d.host.calls.clear()
    message = refused(lambda: d.create(NEW, params=again))
    assert says in message and f"volume {NEW} exists" in message, message
    assert state(d) == before and d.tools() == {"lvs"}
    d.mounted(NEW, "ext4")


SAME = [
    pytest.param(BY_ID, BY_ID, deleted(SRC), id="by-id-source-deleted"),
    pytest.param(BY_NAME, BY_NAME, deleted(SRC), id="by-name-source-deleted"),
    pytest.param(BY_NAME, BY_NAME, chain(deleted(SRC), source(vid=SRC2)),
                 id="by-name-name-now-another-volumes"),
    pytest.param(BY_NAME, BY_ID, nothing, id="made-by-name-asked-by-id"),
    pytest.param(BY_SNAP, BY_SNAP, chain(snapshot_deleted(), deleted(SRC)),
                 id="snapshot-deleted"),
    pytest.param(BY_ID, {}, deleted(SRC), id="source-dropped"),
    pytest.param(BY_ID, BY_NAME, nothing, id="made-by-id-asked-by-name"),
]


@pytest.mark.parametrize("made,again,then", SAME)
def test_same_source_passes(d: Dhv, made: dict[str, str], again: dict[str, str],
                            then: Setup) -> None:
    """Nomad repeats create at every client start, also after the source is gone."""
    chain(source(), snapshot())(d)
    first = d.create(NEW, params=made)
    then(d)
    before = state(d)["lvs"]
    d.host.calls.clear()
    assert d.create(NEW, params=again or None) == first
    assert "lvcreate" not in d.tools() and formatted(d) == []
    assert state(d)["lvs"] == before
    d.mounted(NEW, "ext4")


# a first create that fails part-way leaves nothing behind -----------------------------------


@pytest.mark.parametrize("fs,fail,cap_min", [
    ("ext4", "mount", 0),
    ("btrfs", "btrfstune", 0),
    ("ext4", "lvextend", GROWN),
    ("xfs", "xfs_growfs", GROWN),  # after the mount: unmounted again
    ("btrfs", "btrfs", GROWN),
])
@pytest.mark.parametrize("via", ["id", "snapshot"])
def test_failed_clone_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str,
                                     fail: str, cap_min: int, via: str) -> None:
    d = make(tmp_path, monkeypatch)
    chain(source(fs), snapshot())(d)
    before = state(d)
    d.host.calls.clear()
    d.host.fail_next([fail], 1, f"{fail}: boom\n")
    params = VIA[via][0]
    says = refused(lambda: d.create(NEW, params=params, cap_min=cap_min))
    assert "boom" in says, says
    assert any(is_snapshot_create(c) for c in d.host.calls)  # it had got that far
    assert ("lvremove", "--yes", f"{VG}/{lv_name_for(NEW)}") in d.host.calls
    assert state(d) == before  # no LV, no mount; the source as it was
    assert not os.path.lexists(d.path(NEW))
    # and nothing stands in the way of the same create again
    assert d.create(NEW, params=params, cap_min=cap_min)[0] == d.path(NEW)
    d.mounted(NEW, fs)


class FailAfterSnapshot(WholeOutputStreams):
    """The FakeHost as a Runner, whose next command after lvcreate --snapshot
    fails, whatever it is (a read-back, an activation, a probe, a mount)."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        result = self.host.run(argv, ok_codes=ok_codes, input=input, timeout=timeout)
        if is_snapshot_create(tuple(argv)):
            self.host.fail_next([], 5, "  Reading VG vg0 failed\n")
        return result


@pytest.mark.parametrize("via", ["id", "snapshot"])
def test_clone_whose_next_command_fails_is_rolled_back(d: Dhv, via: str) -> None:
    chain(source(), snapshot())(d)
    before = state(d)
    plugin = HostVolumes(d.config, runner=FailAfterSnapshot(d.host), host=d.host)
    says = refused(lambda: plugin.create(d.request(NEW, params=VIA[via][0])))
    assert "Reading VG" in says, says
    assert state(d) == before
    assert not d.has_lv(NEW) and not os.path.lexists(d.path(NEW))


def test_clone_whose_device_never_appears_is_rolled_back(
        d: Dhv, monkeypatch: pytest.MonkeyPatch) -> None:
    source()(d)
    before = state(d)
    clone_path = d.host.lv_path(lv_name_for(NEW))
    real = d.host.device_numbers
    # udev never makes /dev/vg0/<clone>: no node, so nothing can mount it either
    monkeypatch.setattr(d.host, "device_numbers",
                        lambda path: None if path == clone_path else real(path))
    says = refused(lambda: d.create(NEW, params=BY_ID))
    assert "did not appear" in says, says
    assert not d.has_lv(NEW), "the clone's LV was left behind"
    assert state(d) == before


def test_clone_of_a_source_with_a_pending_fs_grow_grows_its_fs(d: Dhv) -> None:
    lv_only(tags=[TAG_GROW_FS])(d)
    d.host.set_content(lv_name_for(SRC), "ext4", fs_size=SRC_SIZE - 64 * MiB)
    size = d.create(NEW, params=BY_ID)[1]
    lv = d.lv(NEW)
    assert size == lv.size == SRC_SIZE
    assert lv.content.fs_size == lv.size, "the clone's file system is smaller than its LV"


# snapshots ------------------------------------------------------------------------------------


def test_snapshot_create(d: Dhv) -> None:
    source("xfs", ns=NS2)(d)
    d.host.calls.clear()
    snap = d.plugin().snapshot_create(SRC, SNAP)
    lv = d.snap_lv()
    assert snap.name == lv.name == snapshot_lv_name(SNAP) and snap.size == SRC_SIZE
    assert lv.tags == {f"{TAG_KIND}=snapshot", f"{TAG_SNAPSHOT}={SNAP}",
                       f"{TAG_SOURCE}=volume:{SRC}", f"{TAG_FS}=xfs",
                       f"{TAG_NAMESPACE}={hexed(NS2)}"}
    assert not lv.active and lv.skip  # inactive, with LVM's activation skip
    assert snap.activation_skip and not snap.active
    assert lv.origin == lv_name_for(SRC) and lv.content.fs == "xfs"
    calls = d.host.calls
    assert index(calls, lambda c: c == ("sync", "--file-system", d.path(SRC))) \
        < index(calls, is_snapshot_create)
    assert "--setactivationskip" in calls[index(calls, is_snapshot_create)]
    d.mounted(SRC, "xfs")  # the volume keeps working
    before = state(d)
    d.host.calls.clear()
    again = d.plugin().snapshot_create(SRC, SNAP)  # idempotent
    assert (again.name, again.size, again.tags) == (snap.name, snap.size, snap.tags)
    assert state(d) == before and d.tools() == {"lvs"}


def foreign_snap_lv(tags: Sequence[str]) -> Setup:
    """An LV where snapshot SNAP's LV would be, that is not that snapshot."""
    return lambda d: d.host.add_lv(snapshot_lv_name(SNAP), SRC_SIZE, tags=tags, fs="ext4")


SNAPSHOT_REFUSALS = [
    pytest.param(SRC2, SNAP, "snapshot 'gold-v1' exists already, of volume:golden-1",
                 chain(source(), source(vid=SRC2, name="other"), snapshot()),
                 id="name-taken-by-another-volume"),
    pytest.param("no-such-volume", SNAP, "host volume 'no-such-volume' not found", source(),
                 id="unknown-volume"),
    pytest.param(SRC, SNAP, "not found", lv_only(tags=[], fs="ext4", ns=NS, name=SRC_NAME,
                                                 vid=SRC2), id="lv-of-another-id"),
    pytest.param(SRC, SNAP, "was never formatted", never_formatted(), id="never-formatted"),
    pytest.param(SRC, SNAP, "has room for", chain(source(), source(vid=SRC2, size=GiB)),
                 id="pool-without-room"),
    pytest.param(SRC, SNAP, "above its high-water mark", chain(source(), pool_percent(92.0)),
                 id="pool-above-high-water-mark"),
    pytest.param(SRC, SNAP, "the metadata area of volume group vg0 is",
                 chain(source(), metadata_area_full), id="metadata-area-full"),
    pytest.param("../x", SNAP, "DHV_VOLUME_ID '../x' is not a volume ID", source(),
                 id="invalid-volume-id"),
    pytest.param(SRC, "a/b", "snapshot name 'a/b' is not valid", source(), id="invalid-name"),
    pytest.param(SRC, SNAP, "is not snapshot 'gold-v1' made by this plugin",
                 chain(source(), foreign_snap_lv([f"{TAG_KIND}=volume"])), id="foreign-lv"),
    pytest.param(SRC, SNAP, "is not snapshot 'gold-v1'",
                 chain(source(), foreign_snap_lv([f"{TAG_KIND}=snapshot",
                                                  f"{TAG_SNAPSHOT}=other"])),
                 id="lv-of-another-snapshot-name"),
]


@pytest.mark.parametrize("vid,name,says,setup", SNAPSHOT_REFUSALS)
def test_snapshot_create_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vid: str,
                                 name: str, says: str, setup: Setup) -> None:
    d = make(tmp_path, monkeypatch, pool_size=GiB + 512 * MiB)
    setup(d)
    before = state(d)
    d.host.calls.clear()
    message = refused(lambda: d.plugin().snapshot_create(vid, name))
    assert says in message, message
    assert d.tools() <= {"lvs"} and state(d) == before


def test_snapshot_delete(d: Dhv) -> None:
    chain(source(), snapshot())(d)
    d.create(NEW, params=BY_SNAP)
    d.host.calls.clear()
    assert d.plugin().snapshot_delete(SNAP) is True
    assert snapshot_lv_name(SNAP) not in d.host.lvs
    assert ("lvremove", "--yes", f"{VG}/{snapshot_lv_name(SNAP)}") in d.host.calls
    d.mounted(NEW, "ext4")  # its clone keeps working
    d.mounted(SRC, "ext4")
    assert d.plugin().snapshot_delete(SNAP) is False  # gone already
    assert d.plugin().snapshot_delete("never-made") is False


@pytest.mark.parametrize("tags", [
    pytest.param([f"{TAG_KIND}=volume", f"{TAG_ID}=x"], id="a-volume"),
    pytest.param([f"{TAG_KIND}=snapshot", f"{TAG_SNAPSHOT}=other"], id="another-snapshot"),
    pytest.param([], id="untagged"),
])
def test_snapshot_delete_refuses_what_is_not_that_snapshot(d: Dhv, tags: list[str]) -> None:
    foreign_snap_lv(tags)(d)
    before = state(d)
    message = refused(lambda: d.plugin().snapshot_delete(SNAP))
    assert "is not snapshot 'gold-v1' made by this plugin" in message, message
    assert state(d) == before and "lvremove" not in d.tools()


def test_snapshots_listed_and_filtered(d: Dhv) -> None:
    chain(source(), source(vid=SRC2, name="other"), snapshot(SRC, SNAP),
          snapshot(SRC2, SNAP2), snapshot(SRC, "gold-v3"))(d)
    d.create(NEW, params=BY_SNAP)  # a clone is a volume, not a snapshot
    d.host.add_lv("dhv-snap-" + "0" * 32, SRC_SIZE, tags=[f"{TAG_KIND}=snapshot"])  # no name
    names = [lv.tag_value(TAG_SNAPSHOT) for lv in d.plugin().snapshots()]
    assert names == [SNAP, SNAP2, "gold-v3"]  # in the order they were made
    assert [lv.tag_value(TAG_SNAPSHOT) for lv in d.plugin().snapshots(SRC)] == [SNAP, "gold-v3"]
    assert [lv.tag_value(TAG_SNAPSHOT) for lv in d.plugin().snapshots(SRC2)] == [SNAP2]
    assert d.plugin().snapshots(NEW) == [] and d.plugin().snapshots("nope") == []


def test_deleting_the_source_keeps_snapshots_and_clones(d: Dhv) -> None:
    chain(source("btrfs"), snapshot())(d)
    d.create(NEW, params=BY_ID)
    d.delete(SRC)
    assert not d.has_lv(SRC) and not os.path.lexists(d.path(SRC))
    d.mounted(NEW, "btrfs")
    assert [lv.name for lv in d.plugin().snapshots(SRC)] == [snapshot_lv_name(SNAP)]
    d.create("clone-2", params=BY_SNAP)
    d.mounted("clone-2", "btrfs")
    d.mounted(NEW, "btrfs")


# the command: csi-local-dhv snapshot create|delete|list -----------------------------------


@dataclass
class Cli:
    d: Dhv
    monkeypatch: pytest.MonkeyPatch
    configs: list[PluginConfig]  # what each run loaded

    @property
    def plugin_dir(self) -> Path:
        return self.d.root / "plugins"

    @property
    def exe(self) -> str:
        return str(self.plugin_dir / "csi-local-dhv")

    def __call__(self, *args: str, argv0: str | None = None) -> tuple[int, str]:
        rc, out, _ = run_main([self.exe if argv0 is None else argv0, "snapshot", *args],
                              self.monkeypatch)
        return rc, out

    def ok(self, *args: str, argv0: str | None = None) -> str:
        rc, out = self(*args, argv0=argv0)
        assert rc == 0, out
        assert out.endswith("\n") and out.count("\n") >= 1
        return out

    def error(self, *args: str, argv0: str | None = None) -> str:
        rc, out = self(*args, argv0=argv0)
        assert rc == 1, out
        answer = json.loads(out)
        assert list(answer) == ["error"], answer
        return str(answer["error"])


def write_config(path: Path, d: Dhv, **extra: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"volume_group": VG, "thin_pool": POOL,
                                "lock_dir": d.config.lock_dir, **extra}))


@pytest.fixture
def cli(d: Dhv, monkeypatch: pytest.MonkeyPatch) -> Cli:
    c = Cli(d, monkeypatch, [])
    write_config(c.plugin_dir / "csi-local-dhv.json", d)

    def plugin(config: PluginConfig) -> HostVolumes:
        c.configs.append(config)
        return HostVolumes(config, runner=d.host, host=d.host)

    monkeypatch.setattr(dhv_snapshot, "HostVolumes", plugin)
    # main's `out` defaults to the sys.stdout of its import: write to this test's
    real = dhv_snapshot.main
    monkeypatch.setattr(dhv_snapshot, "main",
                        lambda argv, argv0: real(argv, argv0, out=sys.stdout))
    return c


def test_cli_create(cli: Cli) -> None:
    source()(cli.d)
    out = cli.ok("create", SRC, SNAP)
    lv = f"{VG}/{snapshot_lv_name(SNAP)}"
    assert json.loads(out) == {"snapshot": SNAP, "volume_id": SRC, "lv": lv, "bytes": SRC_SIZE,
                               "device_class": "default"}
    assert list(json.loads(out)) == ["snapshot", "volume_id", "lv", "bytes", "device_class"]
    assert cli.d.snap_lv().tags >= {f"{TAG_SNAPSHOT}={SNAP}", f"{TAG_SOURCE}=volume:{SRC}"}
    assert cli.configs[0].lock_dir == cli.d.config.lock_dir  # the plugin dir's config
    cli.d.host.calls.clear()
    assert cli.ok("create", SRC, SNAP) == out  # the same again, nothing made
    assert "lvcreate" not in cli.d.tools()


def test_cli_list(cli: Cli) -> None:
    chain(source("xfs"), source(vid=SRC2, name="other"))(cli.d)
    assert json.loads(cli.ok("list", "--json")) == {"snapshots": []}
    header = cli.ok("list")
    assert header.split() == ["SNAPSHOT", "VOLUME", "ID", "SIZE", "FS", "CREATED", "CLASS", "LV"]
    cli.ok("create", SRC, SNAP)
    cli.ok("create", SRC2, SNAP2)
    entries = json.loads(cli.ok("list", "--json"))["snapshots"]
    first = {"snapshot": SNAP, "volume_id": SRC, "lv": f"{VG}/{snapshot_lv_name(SNAP)}",
             "bytes": SRC_SIZE, "fs_type": "xfs", "created": cli.d.snap_lv().created,
             "device_class": "default"}
    assert entries[0] == first and [e["snapshot"] for e in entries] == [SNAP, SNAP2]
    assert isinstance(first["created"], int) and first["created"] > 1_600_000_000
    assert json.loads(cli.ok("list", SRC2, "--json"))["snapshots"][0]["snapshot"] == SNAP2
    assert json.loads(cli.ok("list", "--json", NEW)) == {"snapshots": []}
    table = cli.ok("list").splitlines()
    assert table[0].startswith("SNAPSHOT") and len(table) == 3
    row = table[1].split()
    assert row[:4] == [SNAP, SRC, str(SRC_SIZE), "xfs"]
    assert row[-2:] == ["default", f"{VG}/{snapshot_lv_name(SNAP)}"]
    assert len(cli.ok("list", SRC).splitlines()) == 2


def test_cli_delete(cli: Cli) -> None:
    chain(source(), snapshot())(cli.d)
    assert json.loads(cli.ok("delete", SNAP)) == {}
    assert snapshot_lv_name(SNAP) not in cli.d.host.lvs
    assert json.loads(cli.ok("delete", SNAP)) == {}  # already gone: succeeds


@pytest.mark.parametrize("args,says,setup", [
    pytest.param(("create", "no-such-volume", SNAP), "host volume 'no-such-volume' not found",
                 source(), id="create-unknown-volume"),
    pytest.param(("create", SRC2, SNAP), "exists already, of volume:golden-1",
                 chain(source(), source(vid=SRC2, name="x"), snapshot()), id="create-name-taken"),
    pytest.param(("create", SRC, SNAP), "was never formatted", never_formatted(),
                 id="create-never-formatted"),
    pytest.param(("delete", SNAP), "is not snapshot 'gold-v1'",
                 foreign_snap_lv([f"{TAG_KIND}=volume"]), id="delete-foreign-lv"),
])
def test_cli_errors(cli: Cli, args: tuple[str, ...], says: str, setup: Setup) -> None:
    setup(cli.d)
    before = state(cli.d)
    message = cli.error(*args)
    assert says in message, message
    assert state(cli.d) == before


@pytest.mark.parametrize("args,says", [
    pytest.param(("create", "../x", SNAP), "'../x' is not a Nomad volume ID", id="create-id"),
    pytest.param(("create", "a b", SNAP), "is not a Nomad volume ID", id="create-id-space"),
    pytest.param(("create", "x" * 129, SNAP), "is not a Nomad volume ID", id="create-id-long"),
    pytest.param(("create", SRC, "a/b"), "snapshot name 'a/b' is not valid", id="create-name"),
    pytest.param(("create", SRC, "a..b"), "is not valid", id="create-name-dotdot"),
    pytest.param(("create", SRC, "é"), "is not valid", id="create-name-unicode"),
    pytest.param(("delete", "x" * 129), "is not valid", id="delete-name-long"),
    pytest.param(("delete", "a\nb"), "is not valid", id="delete-name-newline"),
    pytest.param(("list", "a/b"), "'a/b' is not a Nomad volume ID", id="list-id"),
])
def test_cli_invalid_arguments_refused_before_any_command(cli: Cli, args: tuple[str, ...],
                                                          says: str) -> None:
    message = cli.error(*args)
    assert says in message, message
    assert cli.d.host.calls == [] and cli.configs == []  # no configuration even loaded


def test_cli_plugin_dir_and_id_select_the_configuration(cli: Cli, tmp_path: Path) -> None:
    source()(cli.d)
    write_config(cli.plugin_dir / "fast.json", cli.d, overprovision_ratio=3.0)
    elsewhere = tmp_path / "etc" / "csi-local-dhv.json"
    write_config(elsewhere, cli.d, overprovision_ratio=2.0)

    cli.ok("list")  # the executable's directory, its name
    cli.ok("list", argv0=str(cli.plugin_dir / "fast"))  # installed under another name
    cli.ok("list", "--plugin-id", "fast")
    cli.ok("list", "--plugin-dir", str(elsewhere.parent), argv0="/usr/bin/csi-local-dhv")
    cli.ok("list", "--plugin-dir", str(cli.plugin_dir), "--plugin-id", "fast",
           argv0="/usr/bin/csi-local-dhv")
    cli.ok("list", "--plugin-dir", str(cli.plugin_dir), argv0="csi-local-dhv")
    assert [c.overprovision_ratio for c in cli.configs] == [1.0, 3.0, 3.0, 2.0, 3.0, 1.0]

    assert "give --plugin-dir" in cli.error("list", argv0="csi-local-dhv")
    message = cli.error("list", "--plugin-dir", str(tmp_path / "none"))
    assert f"no configuration at {tmp_path / 'none'}/csi-local-dhv.json" in message
    assert len(cli.configs) == 6


@pytest.mark.parametrize("args", [("create", SRC), ("rename", SNAP), ()])
def test_cli_usage_errors_are_json(cli: Cli, args: tuple[str, ...]) -> None:
    try:
        rc, out = cli(*args)
    except SystemExit as exc:
        stdout = sys.stdout
        assert isinstance(stdout, io.StringIO)
        rc, out = int(exc.code or 0), stdout.getvalue()
    assert rc == 1 and "error" in json.loads(out)


def test_clone_of_a_snapshot_taken_before_a_pending_fs_grow_grows_its_fs(d: Dhv) -> None:
    lv_only(tags=[TAG_GROW_FS])(d)
    d.host.set_content(lv_name_for(SRC), "ext4", fs_size=SRC_SIZE - 64 * MiB)
    snap = d.plugin().snapshot_create(SRC, SNAP)
    assert TAG_GROW_FS in snap.tags  # the snapshot knows its file system is short of its LV
    size = d.create(NEW, params=BY_SNAP)[1]
    lv = d.lv(NEW)
    assert size == lv.size == SRC_SIZE
    assert lv.content.fs_size == lv.size, "the clone's file system is smaller than its LV"
    assert TAG_GROW_FS not in lv.tags
