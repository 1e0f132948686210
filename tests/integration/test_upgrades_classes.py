"""Upgrade and rollback of what tests/integration/test_upgrades.py leaves out:
device classes and the Nomad host volume plugin. The same method: an earlier
version, installed from its commit into a venv of its own
(scripts/earlier-versions), and this version in turn over the same VGs, state
directory and lock directory.

- Device classes. A plugin configured with two classes on two VGs (`fast`,
  the default, and `big`, over-provisioned 2x so the classes' capacities
  differ). The earlier version makes a volume in each class, stages and
  publishes both with data, snapshots the `big` one and restores the snapshot,
  and is killed (SIGKILL of its process tree). This version must list every
  volume in its own class (ControllerGetVolume answers what the earlier
  CreateVolume did: capacity, topology, content source), answer GetCapacity
  per class as the earlier one did, keep the data, and unpublish, unstage,
  stage again, grow (controller and node), snapshot and delete. Then the
  rollback: the earlier version answers for a volume this one made in each
  class (published, in a state file this version wrote) and for its snapshot,
  and drains the node; nothing is left in either VG or mounted. A volume's
  class is nowhere recorded but in its LV's VG and pool (README, Device
  classes), so a version that looked elsewhere would lose it here.
- `csi-local-dhv`. The earlier version's plugin makes a host volume (in the
  `big` class), mounted, with data. This version's, installed again as an
  upgrade does, finds it: Nomad's repeated create converges on the same path
  with the data, a larger one grows it, and it deletes it. The earlier
  version, installed again (the rollback), converges on and deletes one this
  version made. The earlier version's requests run its `main` with its
  venv's python (`-I`: PYTHONPATH ignored), Nomad's environment and the
  executable's path as argv[0] (the plugin finds its configuration by that
  name), and each such run first checks that the package it imported is the
  venv's.

The versions are tests/integration/earlier.py's (those that know device
classes).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lab import SCRATCH, unmount_under
from csi_local._gen import csi_pb2 as pb
from csi_local.dhv.request import lv_name_for
from csi_local.host import mounts
from tests.dhvharness import reply
from tests.integration.conftest import LoopVG, PluginProcess, make_vg, mount_cap, run
from tests.integration.dhvkit import Dhv, Result, failed, mounted_device, new_id, ok
from tests.integration.earlier import EARLIER, LAST_RELEASE, WITH_CLASSES, installed, venv_of
from tests.integration.test_encryption import kill_tree
from tests.integration.test_node import publish, stage, unpublish, unstage
from tests.integration.test_upgrades import (  # noqa: F401 - `pythons` is a fixture
    both_versions,
    listed,
    pythons,
    runs_from,
    snapshots,
)

# The device-class tests are `deep` (some 500 to 1,500 s each; CONTRIBUTING,
# "Deep runs"); the test command's upgrade test (test_upgrades.py) serves two
# classes itself. The host volume's from the last release is in the test
# command (`core`) when the earlier versions' venvs are built, as
# test_upgrades.py's are.
pytestmark = [pytest.mark.integration]
HOST_VOLUME_VERSIONS = [
    pytest.param(c, marks=pytest.mark.core if c == LAST_RELEASE and all(map(installed, EARLIER))
                 else pytest.mark.deep)
    for c in WITH_CLASSES]
MiB = 1 << 20

CLASSES = """\
default = "fast"

[classes.fast]
volume_group = "{fast}"
thin_pool = "pool"

[classes.big]
volume_group = "{big}"
thin_pool = "pool"
overprovision_ratio = 2.0
"""


@dataclass
class Pools:
    fast: LoopVG  # class "fast", the default
    big: LoopVG  # class "big", over-provisioned 2x

    def vg_of(self, lv: str) -> str | None:
        """The VG that holds `lv` (None: neither); never both."""
        found = [vg.name for vg in (self.fast, self.big) if lv in vg.lv_names()]
        assert len(found) <= 1, (lv, found)
        return found[0] if found else None

    def size(self, lv: str) -> int:
        vg = self.vg_of(lv)
        assert vg is not None, lv
        return int(run("lvs", "--noheadings", "--units", "b", "--nosuffix", "-o", "lv_size",
                       f"{vg}/{lv}").stdout.strip())

    def config(self, workdir: Path) -> Path:
        """The classes file both plugins read (the CSI plugin's --config, the
        host volume plugin's classes_file)."""
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "classes.toml"
        path.write_text(CLASSES.format(fast=self.fast.name, big=self.big.name))
        return path

    def empty(self) -> None:
        """What a test left: removed behind the plugins' backs."""
        for vg in (self.fast, self.big):
            vg.clean()


@pytest.fixture(scope="module")
def pools() -> Iterator[Pools]:
    both = Pools(fast=make_vg(1 << 30), big=make_vg(1 << 30))
    yield both
    both.fast.destroy()
    both.big.destroy()


def write_data(directory: str) -> str:
    """Random data in `directory`, on the device (synced); its checksum."""
    data = os.urandom(2 * MiB)
    Path(directory, "data").write_bytes(data)
    os.sync()
    return hashlib.sha256(data).hexdigest()


def checksum(directory: str) -> str:
    return hashlib.sha256(Path(directory, "data").read_bytes()).hexdigest()


def fs_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_blocks * st.f_frsize


def create(p: PluginProcess, name: str, device_class: str, size: int = 64 * MiB,
           source: pb.VolumeContentSource | None = None) -> pb.Volume:
    return p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        parameters={"deviceClass": device_class}, volume_capabilities=[mount_cap()],
        volume_content_source=source), timeout=600).volume


def capacities(p: PluginProcess) -> dict[str, int]:
    """GetCapacity of each class, and of a request naming none (the default)."""
    return {c: p.controller.GetCapacity(pb.GetCapacityRequest(
        parameters={"deviceClass": c} if c else {})).available_capacity
        for c in ("", "fast", "big")}


def got(p: PluginProcess, vid: str) -> pb.ControllerGetVolumeResponse:
    return p.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid))


def mounted_under(workdir: Path) -> list[str]:
    prefix = str(workdir) + "/"
    return [m.mount_point for m in mounts.read_mounts() if m.mount_point.startswith(prefix)]


@pytest.mark.deep
@pytest.mark.parametrize("earlier", WITH_CLASSES)
def test_device_classes_survive_upgrade_and_rollback(
        pools: Pools, pythons: dict[str, str],  # noqa: F811 - the fixture imported above
        earlier: str) -> None:
    python = pythons[earlier]
    assert runs_from(python).startswith(str(venv_of(earlier))), \
        "the earlier version's code is not what runs"
    workdir = SCRATCH / f"upc-{uuid.uuid4().hex[:8]}"
    config = pools.config(workdir)
    old = PluginProcess(vg=pools.fast, workdir=workdir, config_file=config,
                        python=python, python_args=["-I"])
    new = PluginProcess(vg=pools.fast, workdir=workdir, config_file=config)
    with both_versions(old, new, workdir, cleanup=pools.empty):
        classes_upgrade_and_roll_back(pools, old, new)


def classes_upgrade_and_roll_back(pools: Pools, old: PluginProcess,
                                  new: PluginProcess) -> None:
    path = old.path
    fast_vg, big_vg = pools.fast.name, pools.big.name
    # The earlier version: a volume in each class, staged and published with
    # data; a snapshot of the `big` one and a restore of it.
    old.start()
    empty = capacities(old)
    a = create(old, "upc-fast", "fast")
    b = create(old, "upc-big", "big")
    s_a, t_a, s_b, t_b = path("s-a"), path("t-a"), path("s-b"), path("t-b")
    stage(old, a.volume_id, s_a)
    publish(old, a.volume_id, s_a, t_a)
    stage(old, b.volume_id, s_b)
    publish(old, b.volume_id, s_b, t_b)
    sum_a, sum_b = write_data(t_a), write_data(t_b)
    snap = old.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="upc-snap", source_volume_id=b.volume_id), timeout=600).snapshot.snapshot_id
    restored = create(old, "upc-restored", "big", source=pb.VolumeContentSource(
        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap)))
    made = {a.volume_id: (a, fast_vg), b.volume_id: (b, big_vg),
            restored.volume_id: (restored, big_vg)}
    for vid, (_vol, vg) in made.items():
        assert pools.vg_of(vid) == vg, vid
    assert pools.vg_of(snap) == big_vg
    before_kill = capacities(old)
    assert before_kill["big"] != before_kill["fast"]  # the ratio: the classes are told apart
    kill_tree(old)

    # The upgrade: this version finds each volume in its class, as reported.
    new.start()
    assert capacities(new) == before_kill
    assert set(made) <= listed(new)
    assert snap in snapshots(new)
    for vid, (vol, vg) in made.items():
        answer = got(new, vid)
        assert answer.volume == vol, (vid, answer.volume, vol)
        assert not answer.status.volume_condition.abnormal, answer.status.volume_condition
        assert pools.vg_of(vid) == vg, vid
    assert new.controller.GetSnapshot(pb.GetSnapshotRequest(
        snapshot_id=snap)).snapshot.source_volume_id == b.volume_id
    # The data, through the mounts the earlier version made; the kubelet's
    # repeat publish is idempotent.
    publish(new, a.volume_id, s_a, t_a)
    assert checksum(t_a) == sum_a
    stats = new.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=a.volume_id, volume_path=t_a))
    assert any(u.total > 0 for u in stats.usage)
    assert not stats.volume_condition.abnormal, stats.volume_condition
    # Unpublished, unstaged and staged again: read off the device anew.
    unpublish(new, b.volume_id, t_b)
    unstage(new, b.volume_id, s_b)
    assert set(mounted_under(new.workdir)) == {s_a, t_a}
    stage(new, b.volume_id, s_b)
    publish(new, b.volume_id, s_b, t_b)
    assert checksum(t_b) == sum_b
    # Grown online in its class's pool.
    fs_before = fs_bytes(t_b)
    grown = new.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=b.volume_id, capacity_range=pb.CapacityRange(required_bytes=128 * MiB),
        volume_capability=mount_cap()))
    assert grown.capacity_bytes == 128 * MiB and grown.node_expansion_required
    new.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=b.volume_id, volume_path=t_b, staging_target_path=s_b,
        capacity_range=pb.CapacityRange(required_bytes=128 * MiB),
        volume_capability=mount_cap()))
    assert pools.size(b.volume_id) == 128 * MiB and pools.vg_of(b.volume_id) == big_vg
    assert fs_bytes(t_b) > fs_before + 32 * MiB, (fs_before, fs_bytes(t_b))
    assert checksum(t_b) == sum_b
    # The restore holds the snapshot's data; then it and the snapshot are deleted.
    s_r = path("s-r")
    stage(new, restored.volume_id, s_r)
    assert checksum(s_r) == sum_b
    unstage(new, restored.volume_id, s_r)
    new.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=restored.volume_id))
    new.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap))
    assert pools.vg_of(restored.volume_id) is None and pools.vg_of(snap) is None
    # Its own: a volume in each class (the `big` one published with data) and
    # a snapshot, for the earlier version to answer for.
    own_fast = create(new, "upc-own-fast", "fast")
    own_big = create(new, "upc-own-big", "big")
    s_o, t_o = path("s-o"), path("t-o")
    stage(new, own_big.volume_id, s_o)
    publish(new, own_big.volume_id, s_o, t_o)
    sum_o = write_data(t_o)
    own_snap = new.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name="upc-own-snap", source_volume_id=a.volume_id), timeout=600).snapshot
    assert pools.vg_of(own_fast.volume_id) == fast_vg
    assert pools.vg_of(own_big.volume_id) == big_vg
    assert pools.vg_of(own_snap.snapshot_id) == fast_vg
    grown_b = got(new, b.volume_id).volume
    before_stop = capacities(new)
    new.stop()

    # The rollback: the earlier version answers for all of it and drains the node.
    old.start()
    assert capacities(old) == before_stop
    every = {a.volume_id, b.volume_id, own_fast.volume_id, own_big.volume_id}
    assert every <= listed(old)
    assert own_snap.snapshot_id in snapshots(old)
    for vol in (own_fast, own_big, grown_b):
        answer = got(old, vol.volume_id)
        assert answer.volume == vol, (answer.volume, vol)
        assert not answer.status.volume_condition.abnormal, answer.status.volume_condition
    assert checksum(t_o) == sum_o and checksum(t_b) == sum_b and checksum(t_a) == sum_a
    for vid, staging, target in ((a.volume_id, s_a, t_a), (b.volume_id, s_b, t_b),
                                 (own_big.volume_id, s_o, t_o)):
        unpublish(old, vid, target)
        unstage(old, vid, staging)
    old.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=own_snap.snapshot_id))
    for vid in sorted(every):
        old.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert pools.fast.lv_names() == [] and pools.big.lv_names() == []
    assert mounted_under(old.workdir) == []
    assert capacities(old) == empty


# The earlier version's `csi-local-dhv` as Nomad would run its executable:
# argv = [the executable's path, operation, ...] (the plugin finds its
# configuration by the executable's directory and name), the environment
# given, its venv's python with `-I` as the executable's `#!` line has it.
# The import is checked before anything runs.
OLD_DHV = """\
import sys
from pathlib import Path
venv = sys.argv.pop(1)
import csi_local
if not Path(csi_local.__file__).is_relative_to(venv):
    sys.exit(f"csi_local imported from {csi_local.__file__}, not the earlier venv {venv}")
from csi_local.dhv import main
sys.argv[0] = sys.argv.pop(1)
sys.exit(main())
"""


@dataclass(frozen=True)
class Earlier:
    """An earlier version: its venv and that venv's python."""
    venv: Path
    python: str


def old_dhv(src: Earlier, dhv: Dhv, op: str, *args: str,
            env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([src.python, "-I", "-c", OLD_DHV, str(src.venv), dhv.exe, op, *args],
                          env=env, capture_output=True, text=True, check=False, timeout=900)


def old_call(src: Earlier, dhv: Dhv, op: str, vid: str, **kw: Any) -> Result:
    """A create or delete by the earlier version, with Nomad's variables."""
    proc = old_dhv(src, dhv, op, env=dhv.env(op, vid, **kw))
    assert "not the earlier venv" not in proc.stderr, proc.stderr
    return reply(proc.returncode, proc.stdout, proc.stderr)


def old_install(src: Earlier, dhv: Dhv, classes_file: Path) -> None:
    """The earlier version's `csi-local-dhv install`: its own configuration,
    with the time the emulated VM needs. One that knows Nomad's deadline
    (0.2.0 on: timeout_seconds below caller_deadline_seconds, 60 by default)
    is given a longer deadline, as this version is (Dhv.install); an older one
    knows none, and its timeout_seconds goes up to an hour."""
    usage = old_dhv(src, dhv, "install", "--help", env={}).stdout
    deadline = (["--caller-deadline-seconds", "3600"]
                if "--caller-deadline-seconds" in usage else [])
    proc = old_dhv(src, dhv, "install", "--plugin-dir", str(dhv.plugin_dir),
                   "--config", str(classes_file), "--lock-dir", str(dhv.lock_dir),
                   "--timeout-seconds", "600", *deadline, env={})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plugin"] == dhv.exe


def upgraded_call(dhv: Dhv, op: str, vid: str, **kw: Any) -> Result:
    """Nomad's call of the executable the earlier install wrote, after the
    package was upgraded in place: its script, run by this version's python."""
    proc = subprocess.run([sys.executable, "-I", dhv.exe, op], env=dhv.env(op, vid, **kw),
                          capture_output=True, text=True, check=False, timeout=900)
    return reply(proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("earlier", HOST_VOLUME_VERSIONS)
def test_host_volume_survives_upgrade_and_rollback(
        pools: Pools, pythons: dict[str, str],  # noqa: F811 - the fixture imported above
        earlier: str) -> None:
    src = Earlier(venv_of(earlier), pythons[earlier])
    workdir = SCRATCH / f"upd-{uuid.uuid4().hex[:8]}"
    dhv = Dhv(vg=pools.fast, workdir=workdir)
    try:
        host_volume_upgrade_and_roll_back(pools, src, dhv, pools.config(workdir))
    finally:
        unmount_under(workdir)
        pools.empty()
        run("rm", "-rf", "--one-file-system", str(workdir), check=False)


def host_volume_upgrade_and_roll_back(pools: Pools, src: Earlier, dhv: Dhv,
                                      classes_file: Path) -> None:
    big = {"device_class": "big"}
    # The earlier version makes a host volume in the `big` class, with data.
    old_install(src, dhv, classes_file)
    vid = new_id()
    made = ok(old_call(src, dhv, "create", vid, cap_min=64 * MiB, params=big))
    path = made["path"]
    assert path == dhv.path(vid) and made["bytes"] == 64 * MiB
    assert pools.vg_of(lv_name_for(vid)) == pools.big.name
    assert mounted_device(path) is not None
    sums = {vid: write_data(path)}
    config = json.loads((dhv.plugin_dir / "csi-local-dhv.json").read_text())

    # The package upgraded, install not run again: the executable the earlier
    # install wrote imports whatever csi_local its interpreter has, this
    # version (the script run by this version's python, as a package upgraded
    # in place is). A file from before 0.2.0 (no caller_deadline_seconds) has
    # a timeout_seconds of 600, which this version refuses (CHANGELOG: 60 or
    # more is refused without caller_deadline_seconds) touching nothing; a
    # file of 0.2.0 on is served as it is.
    if "caller_deadline_seconds" not in config:
        failed(upgraded_call(dhv, "create", vid, cap_min=64 * MiB, params=big),
               "timeout_seconds")
    else:
        assert ok(upgraded_call(dhv, "create", vid, cap_min=64 * MiB, params=big)) == made
    assert pools.size(lv_name_for(vid)) == 64 * MiB and checksum(path) == sums[vid]

    # The upgrade: this version installed, and Nomad's repeated create.
    dhv.install(classes_file=classes_file)
    again = ok(dhv.call("create", vid, cap_min=64 * MiB, params=big))
    assert again == made
    assert checksum(path) == sums[vid]
    fs_before = fs_bytes(path)
    grown = ok(dhv.call("create", vid, cap_min=128 * MiB, params=big))
    assert grown["path"] == path and grown["bytes"] == 128 * MiB
    assert pools.size(lv_name_for(vid)) == 128 * MiB
    assert pools.vg_of(lv_name_for(vid)) == pools.big.name
    assert fs_bytes(path) > fs_before + 32 * MiB, (fs_before, fs_bytes(path))
    assert checksum(path) == sums[vid]
    # One of its own, in the default class, for the rollback.
    own = new_id()
    own_made = ok(dhv.call("create", own, cap_min=64 * MiB))
    assert pools.vg_of(lv_name_for(own)) == pools.fast.name
    sums[own] = write_data(own_made["path"])
    ok(dhv.call("delete", vid))
    assert pools.vg_of(lv_name_for(vid)) is None and mounted_device(path) is None

    # The rollback: the earlier version installed again converges on this
    # version's volume, then deletes it.
    old_install(src, dhv, classes_file)
    assert ok(old_call(src, dhv, "create", own, cap_min=64 * MiB)) == own_made
    assert checksum(own_made["path"]) == sums[own]
    ok(old_call(src, dhv, "delete", own))
    assert pools.fast.lv_names() == [] and pools.big.lv_names() == []
    assert mounted_under(dhv.workdir) == []
