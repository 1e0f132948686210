"""The one freeze rule (csi_local.volumes.freezes) on every path that freezes
a file system itself: CreateSnapshot and a clone of a mounted encrypted
volume, the host volume plugin's `snapshot create` and clone, and a group
snapshot. Over the fake host: the journal names the file system before the
FIFREEZE and is gone after it; a plugin killed at any step leaves a journal
that the CSI plugin's start and the host volume plugin's next run thaw; a
window past the limit is thawed while lvcreate still runs and fails
UNAVAILABLE with no snapshot left. The VM proves it on real dm-crypt
(tests/integration/test_freezes.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_local import errors
from csi_local._gen import csi_pb2 as pb
from csi_local.csi import plugin as plugin_mod
from csi_local.csi.group_controller_servicer import GroupControllerServicer
from csi_local.dhv import removal as dhv_removal
from csi_local.dhv.config import PluginConfig
from csi_local.dhv.request import lv_name_for, snapshot_lv_name
from csi_local.host.volume_users import VolumeUsers
from csi_local.volumes import encryption, naming
from csi_local.volumes.freezes import Freezes
from csi_local.volumes.group_snapshots import GroupSnapshots
from csi_local.volumes.lock_keys import freeze_key
from csi_local.volumes.pool import Pools
from tests.unit.dhvnode import DhvNode
from tests.unit.fakehost import FakeHost
from tests.unit.servicers import GiB, Node, call, make_node, mount_cap
from tests.unit.test_encryption import KEY, SECRETS

SNAP = naming.snapshot_id_for("snap-1")


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    node = make_node(tmp_path, monkeypatch)
    yield node
    node.backend.state.close()


def encrypted_staged(n: Node, name: str = "pvc-1") -> tuple[str, str]:
    """A new encrypted volume staged (ext4 on its dm-crypt device): (ID, mount point)."""
    code, reply = call(n.controller.CreateVolume, pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=GiB),
        volume_capabilities=[mount_cap()], parameters={encryption.PARAMETER: "luks2"}))
    assert code == "OK", reply
    vid = str(reply.volume.volume_id)
    path = n.path(f"stage-{name}")
    code, reply = call(n.node.NodeStageVolume, pb.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=path, volume_capability=mount_cap(),
        secrets=SECRETS))
    assert code == "OK", reply
    return vid, os.path.realpath(path)


def mapper_numbers(host: FakeHost, lv_name: str) -> tuple[int, int]:
    found = host.device_numbers(f"/dev/mapper/{encryption.mapper_name(lv_name)}")
    assert found is not None
    return found


def journals(directory: str) -> dict[str, Any]:
    """The freeze journals in `directory`, by name, parsed."""
    if not os.path.isdir(directory):
        return {}
    return {name: json.loads(Path(directory, name).read_text(encoding="utf-8"))
            for name in sorted(os.listdir(directory))}


def journals_at_freeze(host: FakeHost, directory: str,
                       monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The journals in `directory` at each FIFREEZE from now on."""
    seen: list[dict[str, Any]] = []
    real = host.freeze

    def freeze(p: str) -> None:
        seen.append(journals(directory))
        real(p)

    monkeypatch.setattr(host, "freeze", freeze)
    return seen


def snapshot(n: Node, vid: str) -> tuple[str, Any]:
    return call(n.controller.CreateSnapshot, pb.CreateSnapshotRequest(
        name="snap-1", source_volume_id=vid))


def clone(n: Node, vid: str) -> tuple[str, Any]:
    req = pb.CreateVolumeRequest(
        name="clone-1", capacity_range=pb.CapacityRange(required_bytes=GiB),
        volume_capabilities=[mount_cap()])
    req.volume_content_source.volume.volume_id = vid
    return call(n.controller.CreateVolume, req)


def made_name(n: Node, path: str) -> str:
    """The LV the CSI path makes."""
    return SNAP if path == "snapshot" else naming.volume_id_for("clone-1")


def take(n: Node, path: str, vid: str) -> tuple[str, Any]:
    return snapshot(n, vid) if path == "snapshot" else clone(n, vid)


# the journal, written before the freeze and gone after ------------------------------------


@pytest.mark.parametrize("path", ["snapshot", "clone"])
def test_the_journal_names_the_file_system_before_its_freeze_and_goes_after(
        n: Node, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    vid, mount = encrypted_staged(n)
    directory = n.backend.freezes.directory
    seen = journals_at_freeze(n.host, directory, monkeypatch)
    code, reply = take(n, path, vid)
    assert code == "OK", reply
    (before,) = seen
    (entry,) = before.values()
    assert entry["frozen"] == [[mount, *mapper_numbers(n.host, vid)]]
    assert journals(directory) == {} and not n.host.frozen


def dhv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: FakeHost | None = None
        ) -> DhvNode:
    """The host volume plugin on `host` (a new one), its lock directory the
    CSI node's of make_node (both plugins share it)."""
    monkeypatch.setattr(dhv_removal, "volume_users", lambda *a, **k: VolumeUsers((), ()))
    monkeypatch.setattr(dhv_removal, "_SETTLE", ())
    tmp_path.mkdir(exist_ok=True)
    key = tmp_path / "class.key"
    key.write_text(KEY)
    key.chmod(0o600)
    config = PluginConfig(volume_group="vg0", thin_pool="pool0",
                          lock_dir=str(tmp_path / "locks"),
                          encryption_key_files={"class:default": str(key)})
    return DhvNode(host or FakeHost("vg0", "pool0", pool_size=10 * GiB), config, tmp_path)


def dhv_take(d: DhvNode, path: str) -> str:
    """The host volume plugin's snapshot create, or clone, of volume "src"; the LV."""
    if path == "snapshot":
        return d.plugin().snapshot_create("src", "snap-1").name
    d.create("copy", params={"source_volume": "src"})
    return lv_name_for("copy")


@pytest.mark.parametrize("path", ["snapshot", "clone"])
def test_the_host_volume_plugin_journals_its_freeze_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    d = dhv(tmp_path, monkeypatch)
    d.create("src", params={"encryption": "luks2"})
    directory = os.path.join(d.config.lock_dir, "freezes")
    seen = journals_at_freeze(d.host, directory, monkeypatch)
    made = dhv_take(d, path)
    assert made in d.host.lvs
    (before,) = seen
    (entry,) = before.values()
    assert entry["frozen"] == [[d.path("src"), *mapper_numbers(d.host, lv_name_for("src"))]]
    assert journals(directory) == {} and not d.host.frozen


def test_every_path_freezes_through_the_one_rule(
        n: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Single snapshot, clone, group and the host volume plugin's snapshot and
    clone all open a Freezes window, and only a window calls FIFREEZE."""
    opened: list[str] = []
    real_window = Freezes.window

    def window(self: Freezes, name: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(name.split(".")[0])
        return real_window(self, name, *args, **kwargs)

    monkeypatch.setattr(Freezes, "window", window)
    a, _ = encrypted_staged(n, "a")
    b, _ = encrypted_staged(n, "b")
    assert snapshot(n, a)[0] == "OK"
    assert clone(n, a)[0] == "OK"
    groups = GroupSnapshots(n.backend.pools, n.backend.fs, n.host, n.backend.freezes)
    code, reply = call(GroupControllerServicer(n.backend, groups).CreateVolumeGroupSnapshot,
                       pb.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=[a, b]))
    assert code == "OK", reply
    d = dhv(tmp_path / "dhv", monkeypatch)
    d.create("src", params={"encryption": "luks2"})
    dhv_take(d, "snapshot")
    dhv_take(d, "clone")
    assert opened == ["copy", "copy", "group-take", "copy", "copy"]
    src = Path(__file__).parents[2] / "src" / "csi_local"
    freezers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                      if re.search(r"\.freeze\(", p.read_text(encoding="utf-8")))
    assert freezers == ["volumes/freezes.py"], "a second freeze rule"


# killed at each step: the next start, or the next host volume plugin run, thaws ---------


@contextlib.contextmanager
def killed_at(host: FakeHost, directory: str, step: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the body, then leave the host as a kill -9 at `step` would have:
    the journals and frozen file systems of that moment (a process's death
    thaws nothing, and no finally runs). `step`: "before-freeze" (the journal
    written, FIFREEZE not yet), "frozen" (lvcreate running), "made" (lvcreate
    done, the thaw not yet)."""
    at: list[tuple[dict[str, Any], set[tuple[int, int]]]] = []
    real_run, real_freeze = host.run, host.freeze

    def keep() -> None:
        if not at:
            at.append((journals(directory), set(host.frozen)))

    def freeze(path: str) -> None:
        if step == "before-freeze":
            keep()
        real_freeze(path)

    def run(argv: Any, **kwargs: Any) -> Any:
        snap = argv[0] == "lvcreate" and "--snapshot" in argv
        if snap and step == "frozen":
            keep()
        out = real_run(argv, **kwargs)
        if snap and step == "made":
            keep()
        return out

    monkeypatch.setattr(host, "freeze", freeze)
    monkeypatch.setattr(host, "run", run)
    yield
    monkeypatch.setattr(host, "freeze", real_freeze)
    monkeypatch.setattr(host, "run", real_run)
    (left, frozen), = at
    assert left, "no journal at the step"
    os.makedirs(directory, exist_ok=True)
    for name, entry in left.items():
        Path(directory, name).write_text(json.dumps(entry), encoding="utf-8")
    host.frozen = frozen


def csi_start(n: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new CSI plugin process built by plugin.py on this node (its host the
    fake, no LVM reads of the state's rebuild)."""
    n.backend.state.close()
    monkeypatch.setattr(plugin_mod, "Kernel", lambda: n.host)
    monkeypatch.setattr(plugin_mod, "ProcessRunner", lambda **kw: n.host)
    monkeypatch.setattr(plugin_mod, "rebuild_state", lambda pools, host: {})
    monkeypatch.setattr(plugin_mod, "reconcile_state", lambda pools, host, records: records)
    monkeypatch.setattr(Pools, "note_volume_groups", lambda pools: None)
    plugin = plugin_mod.CsiPlugin(n.backend.config.__class__(**{
        **n.backend.config.__dict__, "lvm_shell": False}))
    plugin.backend.state.close()


STEPS = ["before-freeze", "frozen", "made"]


@pytest.mark.parametrize("path", ["snapshot", "clone"])
@pytest.mark.parametrize("step", STEPS)
def test_a_csi_plugin_killed_at_any_step_is_thawed_by_its_next_start(
        n: Node, monkeypatch: pytest.MonkeyPatch, step: str, path: str) -> None:
    vid, _ = encrypted_staged(n)
    directory = n.backend.freezes.directory
    with killed_at(n.host, directory, step, monkeypatch):
        assert take(n, path, vid)[0] == "OK"
    assert len(journals(directory)) == 1
    assert n.host.frozen == (set() if step == "before-freeze"
                             else {mapper_numbers(n.host, vid)})
    csi_start(n, monkeypatch)
    assert not n.host.frozen and journals(directory) == {}


@pytest.mark.parametrize("path", ["snapshot", "clone"])
@pytest.mark.parametrize("step", STEPS)
def test_a_host_volume_plugin_killed_at_any_step_is_thawed_by_its_next_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, path: str) -> None:
    d = dhv(tmp_path, monkeypatch)
    d.create("src", params={"encryption": "luks2"})
    directory = os.path.join(d.config.lock_dir, "freezes")
    with killed_at(d.host, directory, step, monkeypatch):
        dhv_take(d, path)
    assert len(journals(directory)) == 1
    d.delete("never-made")  # any run: create, delete, snapshot
    assert not d.host.frozen and journals(directory) == {}


def test_a_csi_plugins_leftover_is_thawed_by_the_host_volume_plugin(
        n: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vid, _ = encrypted_staged(n)
    directory = n.backend.freezes.directory
    with killed_at(n.host, directory, "frozen", monkeypatch):
        assert snapshot(n, vid)[0] == "OK"
    assert n.host.frozen
    d = dhv(tmp_path, monkeypatch, n.host)
    d.delete("never-made")
    assert not n.host.frozen and journals(directory) == {}


def test_an_open_window_is_never_thawed_by_another_process(
        n: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window's lock is held while it is open: a start or a host volume
    plugin run meanwhile leaves it alone."""
    vid, _ = encrypted_staged(n)
    freezes = n.backend.freezes
    recovered: list[bool] = []
    real = n.host.run

    def run(argv: Any, **kwargs: Any) -> Any:
        if argv[0] == "lvcreate" and "--snapshot" in argv:
            # Another process: its own Locks object, the same directory.
            other = Freezes(n.host, type(freezes.locks)(freezes.locks.directory))
            other.recover()
            recovered.append(bool(n.host.frozen) and len(journals(freezes.directory)) == 1)
        return real(argv, **kwargs)

    monkeypatch.setattr(n.host, "run", run)
    assert snapshot(n, vid)[0] == "OK"
    assert recovered == [True]
    with freezes.locks.hold(freeze_key("x"), timeout=0):  # the key is free again
        pass


# the limit --------------------------------------------------------------------------------


def until_thawed(host: FakeHost, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while host.frozen and time.monotonic() < deadline:
        time.sleep(0.005)


def slow_lvcreate(host: FakeHost, monkeypatch: pytest.MonkeyPatch,
                  seen: list[set[tuple[int, int]]]) -> None:
    """lvcreate --snapshot waits (LVM waiting for its VG lock) until nothing is
    frozen, at most 2 s; `seen` gets what is frozen when it returns."""
    real = host.run

    def run(argv: Any, **kwargs: Any) -> Any:
        if argv[0] == "lvcreate" and "--snapshot" in argv:
            until_thawed(host, 2.0)
            out = real(argv, **kwargs)
            seen.append(set(host.frozen))
            return out
        return real(argv, **kwargs)

    monkeypatch.setattr(host, "run", run)


@pytest.mark.parametrize("path", ["snapshot", "clone"])
def test_a_freeze_past_the_limit_thaws_and_fails_unavailable_leaving_nothing(
        n: Node, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    vid, _ = encrypted_staged(n)
    n.backend.freezes.limit = 0.3
    seen: list[set[tuple[int, int]]] = []
    slow_lvcreate(n.host, monkeypatch, seen)
    started = time.monotonic()
    code, msg = take(n, path, vid)
    assert code == "UNAVAILABLE", msg
    assert "frozen for its limit of 0.3 s (--group-freeze-timeout)" in msg and "retry" in msg
    assert seen == [set()], "thawed at the limit while lvcreate still ran"
    assert time.monotonic() - started < 1.5
    assert made_name(n, path) not in n.host.lvs, "a snapshot cut after the thaw is removed"
    assert not n.host.frozen and journals(n.backend.freezes.directory) == {}
    monkeypatch.undo()
    n.backend.freezes.limit = 60.0
    assert take(n, path, vid)[0] == "OK"  # a retry succeeds


@pytest.mark.parametrize("path", ["snapshot", "clone"])
def test_the_host_volume_plugins_freeze_past_the_limit_fails_and_says_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    d = dhv(tmp_path, monkeypatch)
    d.create("src", params={"encryption": "luks2"})
    before = set(d.host.lvs)
    seen: list[set[tuple[int, int]]] = []
    slow_lvcreate(d.host, monkeypatch, seen)
    monkeypatch.setattr("csi_local.dhv.host_volumes.DEFAULT_FREEZE_LIMIT", 0.3)
    with pytest.raises(errors.FreezeTimeout, match=r"freeze limit.*retry"):
        dhv_take(d, path)
    assert seen == [set()]
    assert set(d.host.lvs) == before and snapshot_lv_name("snap-1") not in d.host.lvs
    assert not d.host.frozen
    assert journals(os.path.join(d.config.lock_dir, "freezes")) == {}
