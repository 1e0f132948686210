"""csi-local-dhv's device classes: the `classes_file` configuration, the
`device_class` parameter, and volumes, clones and snapshots found in whatever
class they are, on a FakeHost with two classes.

Every behaviour runs on both layouts a node can have (the `layout` fixture):
the classes' pools in two volume groups, and two thin pools in one volume
group. Tables in the style of test_dhv_clones.py: one row per branch, with
the request, the setup, the fragment of the error that names the branch, and
what must not have changed (a refusal makes no LV, no mount and no directory,
and runs nothing but `lvs`).

The classes (CLASSES_TOML): `fast` (vg0/pool0, the default, the
configuration's fs_type and overprovision_ratio) and `big` (its own VG and
pool, or vg0/pool1; xfs by default, ratio 2.0, lvcreate --readahead 256).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from csi_local.dhv import config as dhv_config
from csi_local.dhv import removal as dhv_removal
from csi_local.dhv import snapshot as dhv_snapshot
from csi_local.dhv.config import PluginConfig, parse_config
from csi_local.dhv.host_volumes import HostVolumes
from csi_local.dhv.request import (
    DhvError,
    lv_name_for,
    parse_parameters,
    snapshot_lv_name,
)
from csi_local.errors import LockBusy, StorageError, VolumeGroupMissing
from csi_local.host.locks import Locks
from csi_local.host.volume_users import VolumeUsers
from csi_local.volumes.host_volume_names import TAG_FS, TAG_SOURCE
from csi_local.volumes.lock_keys import pool_key
from tests.dhvharness import Nomad, run, run_main
from tests.unit.dhvnode import DhvNode
from tests.unit.fakehost import FakeHost, FakeLv, GiB, MiB

VG, POOL = "vg0", "pool0"  # class fast, the default
FAST, BIG = "fast", "big"
NS = "default"
SRC, SRC_NAME, NEW, SNAP = "golden-1", "golden", "vol-1", "gold-v1"
SIZE = 320 * MiB  # above mkfs.xfs's minimum: every fs fits

# where class big's pool is, by layout
LAYOUTS = {"two-vgs": ("vg1", "pool1"), "one-vg": (VG, "pool1")}

CLASSES_TOML = """\
default = "fast"

[classes.fast]
volume_group = "vg0"
thin_pool = "pool0"

[classes.big]
volume_group = "{vg}"
thin_pool = "{pool}"
default_fs_type = "xfs"
overprovision_ratio = 2.0

[classes.big.lvcreate]
readahead = 256
"""


# the node ---------------------------------------------------------------------------------


@dataclass
class Node(DhvNode):
    """One node with two classes: its fake host, the plugin's configuration."""

    layout: str
    cap_min = SIZE

    @property
    def pools(self) -> dict[str, tuple[str, str]]:
        """{class: (VG, thin pool)}"""
        return {FAST: (VG, POOL), BIG: LAYOUTS[self.layout]}

    def find(self, lv_name: str) -> tuple[str, FakeLv] | None:
        """(VG, LV) of the one LV named `lv_name` in any VG."""
        found = [(vg, lv) for (vg, name), lv in self.host.all_lvs().items() if name == lv_name]
        assert len(found) <= 1, found
        return found[0] if found else None

    def where(self, vid: str) -> tuple[str, str] | None:
        """(VG, thin pool) of the volume's LV, None if it has none."""
        found = self.find(lv_name_for(vid))
        return (found[0], found[1].pool) if found else None

    def vg_of(self, vid: str) -> str | None:
        where = self.where(vid)
        assert where is not None, vid
        return where[0]

    def lv(self, vid: str) -> FakeLv:
        found = self.find(lv_name_for(vid))
        assert found is not None, vid
        return found[1]

    def lvcreates(self) -> list[tuple[str, ...]]:
        return self.host.commands("lvcreate")


def classes_file(root: Path, layout: str, text: str = CLASSES_TOML) -> Path:
    path = root / "etc" / "classes.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    vg, pool = LAYOUTS[layout]
    path.write_text(text.format(vg=vg, pool=pool))
    return path


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, *,
         pool_size: int = 4 * GiB, **config: Any) -> Node:
    # delete looks for users in /proc: none on a fake host
    monkeypatch.setattr(dhv_removal, "volume_users", lambda *a, **k: VolumeUsers((), ()))
    monkeypatch.setattr(dhv_removal, "_SETTLE", ())
    host = FakeHost(VG, POOL, pool_size=pool_size)
    vg, pool = LAYOUTS[layout]
    if vg == VG:
        host.add_pool(VG, pool, pool_size)
        host.vg_size = 2 * pool_size + GiB
    else:
        host.add_vg(vg, pool=pool, pool_size=pool_size)
    cfg = PluginConfig(classes_file=str(classes_file(tmp_path, layout)),
                       lock_dir=str(tmp_path / "locks"), **config)
    return Node(host, cfg, tmp_path, layout)


@pytest.fixture(params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> Node:
    return make(tmp_path, monkeypatch, layout)


def refused(fn: Callable[[], object]) -> str:
    """The message of the error `fn` raises (a DhvError or a StorageError)."""
    try:
        fn()
    except DhvError as err:
        return str(err)
    except StorageError as err:  # UnknownDeviceClass, VolumeGroupMissing, NoRoom, ...
        return err.message
    raise AssertionError("no error")


def state(n: Node) -> dict[str, object]:
    return {
        "lvs": {key: (lv.size, frozenset(lv.tags), lv.active, lv.pool, lv.origin,
                      dataclasses.astuple(lv.content))
                for key, lv in n.host.all_lvs().items()},
        "mounts": n.host.mounts(),
        "dirs": sorted(os.listdir(n.volumes_dir)) if os.path.isdir(n.volumes_dir) else [],
    }


# setups -------------------------------------------------------------------------------------

Setup = Callable[[Node], object]


def chain(*steps: Setup) -> Setup:
    def run(n: Node) -> None:
        for step in steps:
            step(n)
    return run


def nothing(n: Node) -> None:
    """No setup."""


def volume(vid: str = SRC, cls: str | None = BIG, *, name: str = SRC_NAME,
           fs: str = "ext4") -> Setup:
    """A volume made by the plugin in class `cls` (None: no device_class)."""
    params = {"fs_type": fs, **({"device_class": cls} if cls else {})}
    return lambda n: n.create(vid, name=name, params=params)


def snapshot(vid: str = SRC, name: str = SNAP) -> Setup:
    return lambda n: n.plugin().snapshot_create(vid, name)


def vg_gone(cls: str) -> Setup:
    """The volume group of class `cls` is missing (a disk not attached yet)."""
    return lambda n: n.host.set_vg_present(n.pools[cls][0], False)


# creating in a class ----------------------------------------------------------------------


@pytest.mark.parametrize("params,cls,fs", [
    pytest.param({}, FAST, "ext4", id="no-class-is-the-default"),
    pytest.param({"device_class": ""}, FAST, "ext4", id="empty-class-is-the-default"),
    pytest.param({"device_class": FAST}, FAST, "ext4", id="fast"),
    pytest.param({"device_class": BIG}, BIG, "xfs", id="big-its-default-fs"),
    pytest.param({"device_class": BIG, "fs_type": "btrfs"}, BIG, "btrfs", id="big-fs-given"),
    pytest.param({"fs_type": "xfs"}, FAST, "xfs", id="default-class-fs-given"),
])
def test_create_lands_in_its_class_pool(n: Node, params: dict[str, str], cls: str,
                                        fs: str) -> None:
    vg, pool = n.pools[cls]
    assert n.create(NEW, params=params) == (n.path(NEW), SIZE)
    (argv,) = n.lvcreates()
    assert argv[argv.index("--thin") + 1] == f"{vg}/{pool}"  # lvcreate names vg/pool
    # only big's class carries extra lvcreate options
    assert ("--readahead" in argv) == (cls == BIG)
    if cls == BIG:
        assert argv[argv.index("--readahead") + 1] == "256"
    assert n.where(NEW) == (vg, pool)
    assert f"{TAG_FS}={fs}" in n.lv(NEW).tags
    n.mounted(NEW, fs)
    # the same request again (Nomad, at every client start): nothing new
    n.host.calls.clear()
    assert n.create(NEW, params=params) == (n.path(NEW), SIZE)
    assert "lvcreate" not in n.tools()


def test_each_class_has_its_own_room_and_ratio(n: Node) -> None:
    # fast: 4 GiB at ratio 1.0; big: 4 GiB at ratio 2.0 (its own overprovision_ratio)
    n.create("a", params={"device_class": BIG}, cap_min=7 * GiB)
    message = refused(lambda: n.create("b", params={"device_class": FAST}, cap_min=5 * GiB))
    assert f"thin pool {VG}/{POOL} has room for" in message, message
    n.create("c", params={"device_class": FAST}, cap_min=4 * GiB)
    assert n.where("a") == n.pools[BIG] and n.where("c") == n.pools[FAST]


def test_a_pool_lock_is_its_own_class_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        layout: str) -> None:
    n = make(tmp_path, monkeypatch, layout, timeout_seconds=6.4)  # lock waits: 0.4 s
    locks = Locks(n.config.lock_dir)
    with locks.hold(pool_key(*n.pools[BIG])):  # big is busy: fast is not held up
        n.create(NEW, params={"device_class": FAST})
    with locks.hold(pool_key(*n.pools[FAST])):
        with pytest.raises(LockBusy):
            n.create("other", params={"device_class": FAST})
    assert n.where(NEW) == n.pools[FAST] and n.where("other") is None


# refusals: nothing made -------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    id: str
    vid: str
    params: dict[str, str]
    says: str
    setup: Setup
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    runs_nothing: bool = False  # refused before any command


def refusal(id: str, params: dict[str, str], says: str, setup: Setup = nothing, *,
            vid: str = NEW, **kw: Any) -> Refusal:
    return Refusal(id, vid, params, says, setup, **kw)


BY_ID, BY_NAME, BY_SNAP = ({"source_volume": SRC}, {"source_volume": SRC_NAME},
                           {"source_snapshot": SNAP})
IN_BIG = volume()  # the source of the clone rows: a volume in class big

REFUSALS = [
    refusal("unknown-class", {"device_class": "slow"},
            "unknown device class 'slow' (this node has: big, fast)", runs_nothing=True),
    refusal("unknown-class-for-a-clone", {**BY_ID, "device_class": "slow"},
            "unknown device class 'slow' (this node has: big, fast)", IN_BIG,
            runs_nothing=True),
    refusal("unknown-class-for-an-existing-volume", {"device_class": "slow"},
            "unknown device class 'slow'", IN_BIG, vid=SRC, runs_nothing=True),
    refusal("clone-by-id-into-another-class", {**BY_ID, "device_class": FAST},
            "source_volume 'golden-1' is in device class 'big', and what is made from it "
            "stays there", IN_BIG),
    refusal("clone-by-name-into-another-class", {**BY_NAME, "device_class": FAST},
            "source_volume 'golden' is in device class 'big'", IN_BIG),
    refusal("clone-of-a-snapshot-into-another-class", {**BY_SNAP, "device_class": FAST},
            "source_snapshot 'gold-v1' is in device class 'big'", chain(IN_BIG, snapshot())),
    refusal("clone-of-a-fast-volume-into-big", {**BY_ID, "device_class": BIG},
            "is in device class 'fast', and what is made from it stays there (a thin "
            "snapshot lives in its origin's pool), but device_class asks for 'big': leave "
            "device_class out or set it to 'fast'",
            volume(cls=FAST)),
    refusal("clone-of-a-default-class-volume-into-big", {**BY_ID, "device_class": BIG},
            "is in device class 'fast'", volume(cls=None)),
    refusal("re-create-in-another-class", {"device_class": FAST},
            "volume golden-1 exists in device class 'big', not 'fast'; a volume cannot "
            "change class", IN_BIG, vid=SRC),
    refusal("re-create-of-a-default-class-volume-in-big", {"device_class": BIG},
            "volume golden-1 exists in device class 'fast', not 'big'", volume(cls=None),
            vid=SRC),
    refusal("re-create-of-a-clone-in-another-class", {**BY_ID, "device_class": FAST},
            "volume vol-1 exists in device class 'big', not 'fast'",
            chain(IN_BIG, lambda n: n.create(NEW, params=BY_ID))),
    refusal("unknown-source-anywhere", {"source_volume": "nope"},
            "source_volume 'nope': no host volume with that ID, or that name in namespace "
            "'default'", IN_BIG),
    # a class's VG is missing: the volume (or its source) may be there
    refusal("new-volume-while-another-class-vg-is-missing", {"device_class": FAST},
            "volume group vg1 not found: volume vol-1 (or its source) may be there",
            vg_gone(BIG), layouts=("two-vgs",)),
    refusal("clone-while-another-class-vg-is-missing", BY_ID,
            "volume group vg1 not found", chain(volume(cls=FAST), vg_gone(BIG)),
            layouts=("two-vgs",)),
    refusal("new-volume-in-a-missing-vg", {"device_class": BIG}, "vg1 not found",
            vg_gone(BIG), layouts=("two-vgs",)),
    refusal("new-volume-with-the-only-vg-missing", {"device_class": BIG}, "vg0 not found",
            vg_gone(BIG), layouts=("one-vg",)),
]


@pytest.mark.parametrize("layout,row", [
    pytest.param(layout, row, id=f"{layout}-{row.id}")
    for row in REFUSALS for layout in row.layouts])
def test_create_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str,
                        row: Refusal) -> None:
    n = make(tmp_path, monkeypatch, layout)
    row.setup(n)
    before = state(n)
    n.host.calls.clear()
    message = refused(lambda: n.create(row.vid, params=row.params))
    assert row.says in message, message
    assert state(n) == before  # no LV, mount or directory made, none removed
    assert n.tools() <= ({"lvs"} if not row.runs_nothing else set()), n.host.calls


@pytest.mark.parametrize("raw,says", [
    pytest.param("Fast", "parameter device_class 'Fast' is not a device class name",
                 id="upper-case"),
    pytest.param("-fast", "is not a device class name", id="leading-dash"),
    pytest.param("a/b", "is not a device class name", id="slash"),
    pytest.param("x" * 64, "is not a device class name", id="too-long"),
])
def test_device_class_parameter_must_be_a_class_name(raw: str, says: str) -> None:
    with pytest.raises(DhvError) as err:
        parse_parameters(json.dumps({"device_class": raw}))
    assert says in str(err.value)
    assert parse_parameters('{"device_class": " big "}').device_class == "big"


def test_unknown_class_is_a_json_error_before_any_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the executable as Nomad runs it, with a real (Sh)runner: nothing may run
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "csi-local-dhv.json").write_text(json.dumps({
        "classes_file": str(classes_file(tmp_path, "two-vgs")),
        "lock_dir": str(tmp_path / "locks")}))
    res = run(Nomad(str(tmp_path / "v"), str(plugins)), "create", NEW, monkeypatch,
              cap_min=SIZE, params={"device_class": "slow"}, namespace=NS)
    assert res.rc == 1
    assert res.out == {"error": "unknown device class 'slow' (this node has: big, fast)"}
    assert not (tmp_path / "v").exists()


# clones and re-creates across classes -----------------------------------------------------


@pytest.mark.parametrize("params", [
    pytest.param(BY_ID, id="by-id-no-class"),
    pytest.param(BY_NAME, id="by-name-no-class"),
    pytest.param(BY_SNAP, id="snapshot-no-class"),
    pytest.param({**BY_ID, "device_class": BIG}, id="by-id-its-class"),
    pytest.param({**BY_SNAP, "device_class": BIG}, id="snapshot-its-class"),
])
def test_a_clone_is_made_in_its_source_class(n: Node, params: dict[str, str]) -> None:
    chain(IN_BIG, snapshot())(n)
    n.host.calls.clear()
    n.create(NEW, params=params)
    assert n.where(NEW) == n.pools[BIG]  # not the default class, fast
    origin = snapshot_lv_name(SNAP) if "source_snapshot" in params else lv_name_for(SRC)
    assert n.lv(NEW).origin == origin
    (argv,) = n.lvcreates()
    assert argv[-1] == f"{n.pools[BIG][0]}/{origin}" and "--snapshot" in argv
    assert argv[argv.index("--readahead") + 1] == "256"  # the class's lvcreate options
    assert not [c for c in n.host.calls if c[0].startswith("mkfs")]
    n.mounted(NEW, "ext4")  # the source's fs, not big's default (xfs)


def test_a_clone_of_a_fast_volume_stays_in_fast(n: Node) -> None:
    volume(cls=FAST)(n)
    n.create(NEW, params=BY_ID)
    assert n.where(NEW) == n.pools[FAST]
    assert "--readahead" not in n.lvcreates()[-1]


@pytest.mark.parametrize("params", [
    pytest.param({}, id="no-class"),
    pytest.param({"device_class": BIG}, id="its-class"),
    pytest.param({"fs_type": "ext4"}, id="fs-no-class"),
])
def test_re_create_finds_the_volume_in_its_class(n: Node, params: dict[str, str]) -> None:
    volume(cls=BIG)(n)  # made in big; re-created (Nomad: every client start) without it
    before = state(n)
    n.host.calls.clear()
    assert n.create(SRC, params=params) == (n.path(SRC), SIZE)
    assert state(n) == before
    # Mounted already: nothing to format, so not even a blkid (the mount shows its fs).
    assert n.tools() == {"lvs"}
    assert len(n.host.commands("lvs")) == 1  # one report over the classes' VGs


def test_re_create_after_the_default_class_changed(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   layout: str) -> None:
    n = make(tmp_path, monkeypatch, layout)
    volume(cls=None)(n)  # in fast, the default then
    path = Path(n.config.classes_file)
    path.write_text(path.read_text().replace('default = "fast"', 'default = "big"'))
    n.config = dataclasses.replace(n.config)  # read the file again
    assert n.config.classes.default == BIG
    n.create(SRC, params={"fs_type": "ext4"})  # the same request: still the volume in fast
    assert n.where(SRC) == n.pools[FAST]
    n.create(NEW, params={})  # a new one goes to the new default
    assert n.where(NEW) == n.pools[BIG]


def test_grow_happens_in_the_volume_s_class(n: Node) -> None:
    volume(cls=BIG)(n)
    n.host.calls.clear()
    assert n.create(SRC, params={}, cap_min=SIZE + 100 * MiB)[1] == SIZE + 100 * MiB
    vg = n.pools[BIG][0]
    assert ("lvextend", "--size", f"{SIZE + 100 * MiB}b", f"{vg}/{lv_name_for(SRC)}") \
        in n.host.calls


# delete -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [FAST, BIG])
def test_delete_finds_the_volume_in_its_class(n: Node, cls: str) -> None:
    volume(cls=cls)(n)
    n.host.calls.clear()
    n.delete(SRC)
    vg = n.pools[cls][0]
    assert n.host.commands("lvremove") == [("lvremove", "--yes", f"{vg}/{lv_name_for(SRC)}")]
    assert n.where(SRC) is None and not os.path.lexists(n.path(SRC))
    assert len(n.host.commands("lvs")) == 1  # one lvs found it, whichever class
    n.delete(SRC)  # gone: succeeds


def test_delete_of_a_volume_in_a_present_vg_while_another_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make(tmp_path, monkeypatch, "two-vgs")
    chain(volume(cls=FAST), vg_gone(BIG))(n)
    n.delete(SRC)  # found in vg0: vg1 cannot hold it too
    assert n.where(SRC) is None


@pytest.mark.parametrize("setup,says", [
    pytest.param(chain(volume(cls=BIG), vg_gone(BIG)), "volume group vg1 not found",
                 id="its-vg-missing"),
    pytest.param(vg_gone(BIG), "volume group vg1 not found", id="gone-or-in-the-missing-vg"),
])
def test_delete_fails_while_a_vg_that_may_hold_the_volume_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: Setup, says: str) -> None:
    n = make(tmp_path, monkeypatch, "two-vgs")
    setup(n)
    before = state(n)
    n.host.calls.clear()
    with pytest.raises(VolumeGroupMissing) as err:
        n.delete(SRC)
    assert says in err.value.message
    assert state(n) == before and n.tools() == {"lvs"}  # not unmounted, not called gone
    n.host.set_vg_present("vg1", True)
    n.delete(SRC)  # back: deleted (or found gone)
    assert n.where(SRC) is None and not os.path.lexists(n.path(SRC))


def test_a_volume_in_a_pool_that_is_no_class_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    # made in big, then big dropped from the file (the docs say: never do that)
    n = make(tmp_path, monkeypatch, layout)
    volume(cls=BIG)(n)
    path = Path(n.config.classes_file)
    text = path.read_text()
    path.write_text(text[:text.index("[classes.big]")].replace('default = "fast"\n', ""))
    n.config = dataclasses.replace(n.config)
    assert n.config.classes.names == [FAST]
    n.host.calls.clear()
    if layout == "one-vg":  # still in a class's VG: seen, and refused by name
        message = refused(lambda: n.create(SRC, params={}))
        assert f"in thin pool {VG}/pool1, which is no device class of this node" in message, \
            message
    # out of sight, but mounted where Nomad expects it: delete leaves it alone
    assert "leaving it alone" in refused(lambda: n.delete(SRC))
    assert n.where(SRC) == n.pools[BIG]  # never removed
    n.mounted(SRC, "ext4")
    assert "lvremove" not in n.tools() and "lvcreate" not in n.tools()


# snapshots ----------------------------------------------------------------------------------


def test_snapshot_of_a_volume_in_big(n: Node) -> None:
    volume(cls=BIG)(n)
    n.host.calls.clear()
    snap = n.plugin().snapshot_create(SRC, SNAP)
    vg, pool = n.pools[BIG]
    assert (snap.vg, snap.pool) == (vg, pool)
    assert n.where(SRC) == (vg, pool)
    assert n.host.lv(snapshot_lv_name(SNAP), vg).tags >= {f"{TAG_SOURCE}=volume:{SRC}"}
    (argv,) = n.lvcreates()
    assert argv[-1] == f"{vg}/{lv_name_for(SRC)}" and "--readahead" not in argv  # inactive
    assert n.plugin().class_of(snap) == BIG
    assert n.plugin().snapshot_create(SRC, SNAP, BIG).name == snap.name  # idempotent
    assert [lv.name for lv in n.plugin().snapshots()] == [snap.name]
    assert n.plugin().snapshot_delete(SNAP) is True
    assert ("lvremove", "--yes", f"{vg}/{snap.name}") in n.host.calls
    assert n.plugin().snapshot_delete(SNAP) is False


@pytest.mark.parametrize("vid,cls,says,setup", [
    pytest.param(SRC, FAST, "host volume 'golden-1' is in device class 'big', and what is "
                 "made from it stays there", volume(cls=BIG),
                 id="volume-in-another-class"),
    pytest.param(SRC, FAST, "snapshot 'gold-v1' is in device class 'big', and what is made "
                 "from it stays there", chain(volume(cls=BIG), snapshot()),
                 id="existing-in-another-class"),
    pytest.param(SRC, "slow", "unknown device class 'slow' (this node has: big, fast)",
                 volume(cls=BIG), id="unknown-class"),
    pytest.param("nope", None, "host volume 'nope' not found in the device classes of this "
                 "node (big, fast)", volume(cls=BIG), id="no-such-volume"),
    pytest.param(SRC, None, "snapshot names are unique in the device classes of this node",
                 chain(volume(cls=BIG), volume("other", FAST, name="other"),
                       snapshot("other")), id="name-taken-in-another-class"),
])
def test_snapshot_create_refused(n: Node, vid: str, cls: str | None, says: str,
                                 setup: Setup) -> None:
    setup(n)
    before = state(n)
    n.host.calls.clear()
    message = refused(lambda: n.plugin().snapshot_create(vid, SNAP, cls))
    assert says in message, message
    assert state(n) == before and n.tools() <= {"lvs"}


def test_snapshots_while_a_vg_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = make(tmp_path, monkeypatch, "two-vgs")
    chain(volume(cls=BIG), snapshot(), volume("other", FAST, name="other"),
          snapshot("other", "other-v1"), vg_gone(BIG))(n)
    before = state(n)
    # listed: what can be seen (with a warning); deleted: never called gone
    assert [lv.name for lv in n.plugin().snapshots()] == [snapshot_lv_name("other-v1")]
    assert "vg1 not found" in refused(lambda: n.plugin().snapshot_delete(SNAP))
    assert "vg1 not found" in refused(lambda: n.plugin().snapshot_create("other", "v2"))
    assert state(n) == before


# configuration ------------------------------------------------------------------------------


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


ONE_CLASS = '[classes.solo]\nvolume_group = "vg0"\nthin_pool = "pool0"\n'


@pytest.mark.parametrize("data,says", [
    pytest.param({"classes_file": "@file", "volume_group": "vg0", "thin_pool": "pool0"},
                 "give classes_file or volume_group and thin_pool, not both", id="both"),
    pytest.param({"classes_file": "@file", "volume_group": "vg0"}, "not both",
                 id="file-and-a-volume-group"),
    pytest.param({"classes_file": "@file", "thin_pool": "pool0"}, "not both",
                 id="file-and-a-thin-pool"),
    pytest.param({}, "missing volume_group, thin_pool (or give classes_file", id="neither"),
    pytest.param({"lock_dir": "/run/x"}, "missing volume_group, thin_pool", id="neither-2"),
    pytest.param({"classes_file": "classes.toml"},
                 "classes_file 'classes.toml' must be an absolute path", id="relative"),
    pytest.param({"classes_file": 5}, "classes_file 5 must be a path", id="not-a-string"),
    pytest.param({"classes_file": "@missing"}, "classes_file: cannot read the configuration "
                 "file @missing", id="no-such-file"),
    pytest.param({"classes_file": "@bad-toml"}, "classes_file: @bad-toml:1: ", id="not-toml"),
    pytest.param({"classes_file": "@unknown-key"},
                 "classes_file: @unknown-key:4: class 'solo': unknown key 'stripes'",
                 id="unknown-key-with-its-line"),
    pytest.param({"classes_file": "@two-no-default"},
                 "@two-no-default: several classes and no default", id="no-default"),
    pytest.param({"classes_file": "@file", "fs_type": "zfs"}, "unsupported fs_type 'zfs'",
                 id="bad-default-fs"),
    pytest.param({"classes_file": "@empty"}, "no device class defined", id="empty-file"),
])
def test_bad_config(tmp_path: Path, data: dict[str, object], says: str) -> None:
    files = {
        "@file": write(tmp_path / "ok.toml", ONE_CLASS),
        "@missing": str(tmp_path / "missing.toml"),
        "@bad-toml": write(tmp_path / "bad.toml", "[classes.solo\n"),
        "@unknown-key": write(tmp_path / "unknown.toml", ONE_CLASS + "stripes = 2\n"),
        "@two-no-default": write(tmp_path / "two.toml", ONE_CLASS + ONE_CLASS.replace(
            "solo", "duo").replace("pool0", "pool1")),
        "@empty": write(tmp_path / "empty.toml", "# nothing yet\n"),
    }
    data = {k: files.get(v, v) if isinstance(v, str) else v for k, v in data.items()}
    says = next((says.replace(k, v) for k, v in files.items() if k in says), says)
    source = "/plugins/csi-local-dhv.json"
    with pytest.raises(DhvError) as err:
        parse_config(json.dumps(data), source)
    assert str(err.value).startswith(f"{source}: "), str(err.value)
    assert says in str(err.value), str(err.value)


def test_config_with_classes(tmp_path: Path) -> None:
    path = write(tmp_path / "classes.toml", CLASSES_TOML.format(vg="vg1", pool="pool1"))
    cfg = parse_config(json.dumps({"classes_file": path, "fs_type": "btrfs",
                                   "overprovision_ratio": 1.5}))
    classes = cfg.classes
    assert classes.default == FAST and sorted(classes.names) == [BIG, FAST]
    fast, big = classes.get(FAST), classes.get(BIG)
    assert fast is not None and big is not None
    # the JSON's fs_type and ratio for the class that sets none; big's own otherwise
    assert (fast.default_fs_type, fast.overprovision_ratio) == ("btrfs", 1.5)
    assert (big.default_fs_type, big.overprovision_ratio) == ("xfs", 2.0)
    assert (big.volume_group, big.thin_pool, big.lvcreate_args) == \
        ("vg1", "pool1", ("--readahead", "256"))
    assert cfg.to_json()["classes_file"] == path
    assert "volume_group" not in cfg.to_json() and "thin_pool" not in cfg.to_json()
    assert parse_config(json.dumps(cfg.to_json())) == cfg


def test_config_without_classes_is_one_class_named_default() -> None:
    cfg = parse_config('{"volume_group": "vg0", "thin_pool": "pool0", "fs_type": "xfs", '
                       '"overprovision_ratio": 3}')
    (only,) = cfg.classes.classes
    assert cfg.classes.default == "default" == only.name
    assert (only.volume_group, only.thin_pool, only.default_fs_type,
            only.overprovision_ratio) == ("vg0", "pool0", "xfs", 3.0)
    assert "classes_file" not in cfg.to_json()


def test_load_config_reads_the_classes_file(tmp_path: Path) -> None:
    toml = write(tmp_path / "etc" / "classes.toml", CLASSES_TOML.format(vg="vg1",
                                                                       pool="pool1"))
    write(tmp_path / "plugins" / "csi-local-dhv.json", json.dumps({"classes_file": toml}))
    cfg = dhv_config.load_config(str(tmp_path / "plugins"),
                                 str(tmp_path / "plugins" / "csi-local-dhv"))
    assert cfg.classes_file == toml and sorted(cfg.classes.names) == [BIG, FAST]
    Path(toml).write_text("[classes.fast\n")  # broken later: a create says where
    with pytest.raises(DhvError, match=r"csi-local-dhv\.json: classes_file: .*classes\.toml"):
        dhv_config.load_config(str(tmp_path / "plugins"),
                               str(tmp_path / "plugins" / "csi-local-dhv"))


# install --config ---------------------------------------------------------------------------




def test_install_with_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = write(tmp_path / "etc" / "classes.toml", CLASSES_TOML.format(vg="vg1",
                                                                       pool="pool1"))
    monkeypatch.chdir(tmp_path)
    plugins = tmp_path / "plugins"
    rc, _, err = run_main(["csi-local-dhv", "install", "--plugin-dir", str(plugins),
                           "--config", "etc/classes.toml", "--fs-type", "xfs",
                           "--python", "/usr/bin/python3"], monkeypatch)
    assert rc == 0, err
    written = json.loads((plugins / "csi-local-dhv.json").read_text())
    assert written["classes_file"] == toml  # made absolute
    assert "volume_group" not in written and "thin_pool" not in written
    cfg = dhv_config.load_config(str(plugins), str(plugins / "csi-local-dhv"))
    assert cfg.classes.get(FAST) is not None and cfg.fs_type == "xfs"


@pytest.mark.parametrize("args,says", [
    pytest.param(["--config", "@toml", "--volume-group", "vg0", "--thin-pool", "p"],
                 "give --config or --volume-group and --thin-pool, not both", id="both"),
    pytest.param(["--config", "@toml", "--volume-group", "vg0"], "not both", id="config-and-vg"),
    pytest.param([], "give --volume-group and --thin-pool (one pool), or --config FILE",
                 id="neither"),
    pytest.param(["--volume-group", "vg0"], "give --volume-group and --thin-pool",
                 id="only-a-volume-group"),
    pytest.param(["--config", "@bad"], "--config: @bad:2: class 'solo': unknown key 'x'",
                 id="bad-file"),
    pytest.param(["--config", "@missing"], "cannot read the configuration file @missing",
                 id="missing-file"),
])
def test_install_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                         says: str) -> None:
    files = {"@toml": write(tmp_path / "ok.toml", ONE_CLASS),
             "@bad": write(tmp_path / "bad.toml", '[classes.solo]\nx = 1\n'),
             "@missing": str(tmp_path / "missing.toml")}
    args = [files.get(a, a) for a in args]
    says = next((says.replace(k, v) for k, v in files.items() if k in says), says)
    plugins = tmp_path / "plugins"
    rc, _, err = run_main(["csi-local-dhv", "install", "--plugin-dir", str(plugins), *args,
                           "--python", "/usr/bin/python3"], monkeypatch)
    assert rc == 2 and says in err, err
    assert not plugins.exists()  # nothing written


# the snapshot command ---------------------------------------------------------------------


def test_snapshot_command_names_the_class(n: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = n.root / "plugins"
    write(plugins / "csi-local-dhv.json", json.dumps(n.config.to_json()))
    monkeypatch.setattr(dhv_snapshot, "HostVolumes",
                        lambda config: HostVolumes(config, runner=n.host, host=n.host))
    real = dhv_snapshot.main
    monkeypatch.setattr(dhv_snapshot, "main",
                        lambda argv, argv0: real(argv, argv0, out=sys.stdout))
    volume(cls=BIG)(n)
    exe = str(plugins / "csi-local-dhv")
    rc, out, _ = run_main([exe, "snapshot", "create", SRC, SNAP, "--device-class", BIG],
                          monkeypatch)
    assert rc == 0, out
    vg = n.pools[BIG][0]
    assert json.loads(out) == {"snapshot": SNAP, "volume_id": SRC, "bytes": SIZE,
                               "lv": f"{vg}/{snapshot_lv_name(SNAP)}", "device_class": BIG}
    rc, out, _ = run_main([exe, "snapshot", "list", "--json"], monkeypatch)
    assert [e["device_class"] for e in json.loads(out)["snapshots"]] == [BIG]
    rc, out, _ = run_main([exe, "snapshot", "create", SRC, "v2", "--device-class", FAST],
                          monkeypatch)
    assert rc == 1 and "is in device class 'big', and what is made" in json.loads(out)["error"]
    rc, out, _ = run_main([exe, "snapshot", "create", SRC, "v2", "--device-class", "Big"],
                          monkeypatch)
    assert rc == 1 and "--device-class: device class name 'Big'" in json.loads(out)["error"]
