"""The LVM version matrix: VGs written by other lvm2 releases than the
plugin's own (Debian 12's 2.03.16), as a node's host LVM may be, read by the
plugin's committed-metadata reader and answered by its RPCs.

The other releases are the real binaries of Debian 11 (bullseye, lvm2
2.03.11) and Debian 13 (trixie, 2.03.31), the oldest and newest of
SUPPORTED_LVM2 (storage/lvm_config.py), in a root that `scripts/lvm-root
SUITE` builds on the host (the VM has no network), run here with chroot.
They share this machine's /dev, /sys, /run (so the lock directory
/run/lock/lvm and /run/lvm, as the plugin's container and the host's LVM
share them on a node, docs/kubernetes.md) and /etc/lvm's backup and archive
directories; the rest of their /etc/lvm is a writable copy of the root's own
(Debian's lvm.conf of that release).

- test_walk_by_other_lvm: the other release makes the VG from the first byte
  (pvcreate, vgcreate, the thin pool) and then makes the changes by hand
  (create, remove, rename, extend, activation, tags, snapshots, vgextend and
  vgreduce, pvmove) between the plugin's own RPCs, on the walk of
  test_metadata_walk.py (its Walk and comparisons, imported): after each
  step, the plugin's ListVolumes, ControllerGetVolume, ListSnapshots,
  GetCapacity and its reads from a partial parse must equal `lvs`, and
  Debian 12's `lvs` must equal the other release's. 0 divergences, or the
  plugin falls back to `lvs` (counted and printed). Doctor's "lvm versions"
  names the release that made the VG (a warning for trixie's, newer than
  the plugin's own).
- test_rhel_like_devices_file_and_system_id: trixie's LVM set up as RHEL 9
  sets a host up (a devices file, a system ID); the plugin's LVM, set up as
  docs/kubernetes.md says (the image's lvm.conf, the host's devices file,
  lvmlocal.conf with the host's system ID), sees the VG, doctor's "lvm view"
  check finds it the same view, and the walk's comparisons hold. Without the
  system ID its LVM lists the VG but refuses to change it: the reason the
  docs ask for it. With another system ID (a node renamed), LVM will not
  show the VG, and neither may the plugin list its volumes.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.config import Config
from csi_local.csi.plugin import CsiPlugin
from csi_local.host import mounts
from csi_local.host.runner import ProcessRunner
from csi_local.ops import doctor
from csi_local.ops.doctor import lvm_config_checks
from csi_local.storage.lvm import _REPORT, LV_FIELDS, LogicalVolume, parse_lvs
from csi_local.storage.lvm_config import release, release_text
from tests.integration.conftest import SCRATCH, run, unmount_under
from tests.integration.test_metadata_walk import (
    POOL,
    Disk,
    Divergence,
    Moment,
    Walk,
    _create_request,
)

# `deep`: the full run's (CONTRIBUTING, "Deep runs"), never the budgeted
# README run: a walk is some 700 s of VM time (a quarter of the budget) and
# needs the roots of scripts/lvm-root, which the CI machine does not build.
pytestmark = [pytest.mark.integration, pytest.mark.deep]
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
# Where scripts/lvm-root puts the roots (the VM sees the host's file system).
ROOTS = Path(os.environ.get("CSI_LOCAL_LVM_ROOTS") or "/var/lib/csi-local-vm/lvm-roots")
# Each suite's lvm2, as `lvm version` prints it.
RELEASES = {"bullseye": "2.03.11", "trixie": "2.03.31"}
# Steps a walk takes: 13, each kind of step of OtherWalk.actions once in the
# order of OtherWalk.first (what a step changes exists by then); more are
# drawn by weight. A step and its comparison took 37 s (bullseye) and 47 s
# (trixie) in one emulated CPU of a host loaded with other VMs (load 12 to
# 15): udev settle and the three `lvs` (Debian 12's, the other release's,
# the plugin's) most of it.
STEPS = int(os.environ.get("CSI_LOCAL_VERSIONS_STEPS", "13"))
SYSTEM_ID = "csi-rhel-node"
# What the RHEL-like host has in its lvmlocal.conf: the devices file, and a
# system ID of its own (lvmsystemid(7)); RHEL 9 turns on the first by default.
RHEL_LVMLOCAL = f"""\
devices {{
  use_devicesfile = 1
}}
global {{
  system_id_source = "lvmlocal"
}}
local {{
  system_id = "{SYSTEM_ID}"
}}
"""
# The plugin's lvmlocal.conf for that host, as docs/kubernetes.md ("Device
# filtering") has it: the host's system ID. The devices file needs nothing
# here: the image's lvm.conf uses the host's, mounted at /etc/lvm/devices.
PLUGIN_LVMLOCAL = f"""\
devices {{
}}
global {{
  system_id_source = "lvmlocal"
}}
local {{
  system_id = "{SYSTEM_ID}"
}}
"""


def _mount(*argv: str) -> None:
    run("mount", *argv)


@dataclass
class OtherLvm:
    """Another release's LVM: its root bound at `mnt` with this machine's
    /dev, /proc, /sys and /run inside, its /etc/lvm a writable copy (`etc`).
    Every mount is under `mnt`, undone by close()."""

    suite: str
    mnt: Path
    etc: Path
    mounted: list[Path] = field(default_factory=list)

    @classmethod
    def open(cls, suite: str, work: Path) -> OtherLvm:
        root = ROOTS / suite
        built = root / ".csi-local-lvm-version"
        if not built.is_file():
            pytest.fail(f"no {suite} root with lvm2 at {root}: build it on the host (it needs "
                        f"the network) with `scripts/lvm-root {suite}` (CONTRIBUTING.md, "
                        "\"Set up\")", pytrace=False)
        other = cls(suite, work / f"root-{suite}", work / f"etc-lvm-{suite}")
        other.mnt.mkdir(parents=True)
        try:
            other._mount_all(root)
        except BaseException:
            other.close()
            raise
        return other

    def _mount_all(self, root: Path) -> None:
        # Each mount here private or a slave: nothing mounted or unmounted
        # under `mnt` travels back to this machine's /dev, /sys or /run.
        _mount("--bind", str(root), str(self.mnt))
        self.mounted.append(self.mnt)
        _mount("--make-private", str(self.mnt))
        for place in ("dev", "sys"):
            _mount("--rbind", f"/{place}", str(self.mnt / place))
            _mount("--make-rslave", str(self.mnt / place))
        _mount("-t", "proc", "proc", str(self.mnt / "proc"))
        # /run: the lock directory /run/lock/lvm and /run/lvm (hints, online
        # PVs), shared as the host's LVM and the plugin's container share them
        # on a node; and udev's database, which LVM reads.
        _mount("--bind", "/run", str(self.mnt / "run"))
        _mount("--make-slave", str(self.mnt / "run"))
        if os.path.ismount("/run/lock"):
            _mount("--bind", "/run/lock", str(self.mnt / "run/lock"))
            _mount("--make-slave", str(self.mnt / "run/lock"))
        # A writable /etc/lvm: the root's own (its lvm.conf), with this
        # machine's backup and archive directories, one metadata history as
        # on a node (the fixtures of conftest.py empty the archive).
        shutil.copytree(root / "etc/lvm", self.etc, symlinks=True)
        self.configure("")
        _mount("--bind", str(self.etc), str(self.mnt / "etc/lvm"))
        _mount("--make-private", str(self.mnt / "etc/lvm"))
        for sub in ("backup", "archive"):
            if Path("/etc/lvm", sub).is_dir():
                (self.etc / sub).mkdir(exist_ok=True)
                _mount("--bind", f"/etc/lvm/{sub}", str(self.mnt / "etc/lvm" / sub))
                _mount("--make-slave", str(self.mnt / "etc/lvm" / sub))

    def configure(self, lvmlocal: str) -> None:
        """Its lvmlocal.conf: `lvmlocal`, and monitoring off. With it on, its
        lvcreate of a thin pool starts its own dmeventd (in the chroot:
        nothing could unmount it after) beside this machine's, both on the
        one /run/dmeventd-server: on a node there is one, the host's."""
        (self.etc / "lvmlocal.conf").write_text(
            lvmlocal + "activation {\n  monitoring = 0\n}\n")

    def argv(self, *argv: str) -> list[str]:
        return ["chroot", str(self.mnt), *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(*self.argv(*argv), check=check)

    def release(self) -> str:
        """2.03.11 of "LVM version: 2.03.11(2) (2021-01-08)"."""
        numbers = release(self.run("lvm", "version").stdout.partition("LVM version:")[2])
        assert numbers is not None, f"{self.suite}: lvm version printed no release"
        return release_text(numbers)

    def close(self) -> None:
        """Every mount under `mnt` undone, after any process the chroot
        left (a daemon an lvm started) is ended: else its root keeps the
        mounts busy. Lazily where that still fails: the caller must never
        find /dev or /run under its scratch directory."""
        if not self.mounted:
            return
        for pid in _rooted_at(self.mnt):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if run("umount", "--recursive", str(self.mnt), check=False).returncode != 0:
            unmount_under(self.mnt)
            run("umount", "--lazy", str(self.mnt), check=False)
        self.mounted.clear()


def _rooted_at(mnt: Path) -> list[int]:
    """The processes whose root directory is `mnt`: started in the chroot."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "root") == str(mnt):
                    pids.append(int(entry.name))
    return pids


@dataclass
class OtherWalk(Walk):
    """The metadata walk with another release making the changes by hand,
    and a second `lvs`, the other release's, beside Debian 12's at each
    comparison: the two must agree, and the plugin with both."""

    other: OtherLvm | None = None
    moved_on: str = "a"  # the PV that holds the linear LV pvmove moves

    def lvm(self, *argv: str) -> bool:
        assert self.other is not None
        # use_lvmpolld: no lvmpolld runs beside the chroot; a pvmove polls
        # itself, as the host's does where lvmpolld is not started.
        if argv[0] == "pvmove":
            argv = (argv[0], "--config", "global/use_lvmpolld=0", *argv[1:])
        proc = self.other.run(*argv, check=False)
        if proc.returncode != 0:
            self.failed_commands += 1
            print(f"{self.other.suite} refused {' '.join(argv)}: {proc.stderr.strip()[-300:]}")
        return proc.returncode == 0

    def truth(self) -> tuple[list[LogicalVolume], int, str]:
        lvs, extent, warnings = super().truth()
        assert self.other is not None
        with self.clock.timed(f"lvs ({self.other.suite}'s)"):
            proc = self.other.run("lvs", *_REPORT, "-o", LV_FIELDS + ",vg_extent_size", self.vg)
        theirs = parse_lvs(proc.stdout)
        if sorted(theirs, key=_name) != sorted(lvs, key=_name):
            ours = {lv.name: lv for lv in lvs}
            differ = [(lv, ours.get(lv.name)) for lv in theirs if ours.get(lv.name) != lv]
            raise Divergence(f"{self.other.suite}'s lvs and Debian 12's differ: {differ!r}; "
                             f"LVs only Debian 12's shows: "
                             f"{sorted(ours.keys() - {lv.name for lv in theirs})}")
        return lvs, extent, warnings

    def hand_snapshot(self) -> None:
        """A thin snapshot by hand (as an operator's backup tool takes one)."""
        thin = self._thin()
        if thin:
            self.lvm("lvcreate", "--snapshot", "--name", self.name("handsnap-"),
                     f"{self.vg}/{self.rng.choice(thin).name}")

    def hand_pvmove(self) -> None:
        """The linear LV `moved` to the other PV (PV b added first when it is
        out of the VG): pvmove's temporary mirror LV and the locked segments
        are in the metadata the plugin reads while it runs."""
        disk = self.disks["b"]
        if not disk.in_vg:
            if not self.lvm("vgextend", self.vg, disk.loop):
                return
            disk.in_vg = True
        there = "b" if self.moved_on == "a" else "a"
        if self.lvm("pvmove", "--name", "moved", self.disks[self.moved_on].loop,
                    self.disks[there].loop):
            self.moved_on = there

    def first(self) -> list[Callable[[], None]]:
        """Each kind of step once, in an order where each finds what it
        changes (a volume to snapshot, a snapshot to delete), the removals
        last: a short walk takes every kind for real, none on nothing."""
        return [self.plugin_create, self.hand_create, self.hand_snapshot,
                self.plugin_snapshot, self.hand_tags, self.hand_extend, self.hand_rename,
                self.hand_activation, self.vg_extend_or_reduce, self.hand_pvmove,
                self.plugin_delete_snapshot, self.hand_remove, self.plugin_delete]

    def actions(self) -> list[tuple[float, Callable[[], None]]]:
        # The walk's own steps but the PV detached (its phases run Debian
        # 12's LVM: not a matter of versions), the metadata ignored and the
        # shell killed (the plugin's own), with the two of this matrix.
        return [
            (4, self.plugin_create), (2, self.plugin_delete), (2, self.plugin_snapshot),
            (1, self.plugin_delete_snapshot), (3, self.hand_create), (2, self.hand_remove),
            (2, self.hand_rename), (2, self.hand_extend), (1, self.hand_activation),
            (3, self.hand_tags), (1, self.hand_snapshot), (1, self.vg_extend_or_reduce),
            (1, self.hand_pvmove),
        ]


def _name(lv: LogicalVolume) -> str:
    return lv.name


@pytest.fixture
def work() -> Iterator[Path]:
    """The test's scratch directory in tmpfs (not the 9p share)."""
    path = SCRATCH / f"versions-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    yield path
    unmount_under(path)
    # Never removed through a mount: the chroot's binds hold /dev and /run.
    left = [m.mount_point for m in mounts.read_mounts()
            if m.mount_point.startswith(f"{path}/")]
    assert not left, f"still mounted, {path} kept: {left}"
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class MadeVg:
    name: str
    disks: dict[str, Disk]


def _make_vg_by(other: OtherLvm, work: Path, *, devices_file: bool = False) -> MadeVg:
    """The walk's VG, made by `other` from the first byte: PVs a (the thin
    pool, two metadata copies) and b (out of the VG, for vgextend), both with
    small metadata areas; a linear LV `moved` on a for pvmove. With
    `devices_file`, each PV is added to the devices file first."""
    vg = f"csiver{uuid.uuid4().hex[:8]}"
    specs = {"a": ("--metadatasize", "512k", "--metadatacopies", "2"),
             "b": ("--metadatasize", "512k")}
    disks: dict[str, Disk] = {}
    for key, args in specs.items():
        image = work / f"{vg}-{key}.img"
        with open(image, "wb") as f:
            f.truncate(384 * MiB)
        loop = run("losetup", "--find", "--show", str(image)).stdout.strip()
        disks[key] = Disk(image, loop, args)
        if devices_file:
            other.run("lvm", "lvmdevices", "--yes", "--adddev", loop)
        other.run("pvcreate", "--yes", *args, loop)
    other.run("vgcreate", "--yes", vg, disks["a"].loop)
    disks["a"].in_vg = True
    other.run("lvcreate", "--yes", "--type", "thin-pool", "--size", "256M", "--name", POOL,
              vg, disks["a"].loop)
    other.run("lvcreate", "--yes", "--size", "4M", "--name", "moved", vg, disks["a"].loop)
    return MadeVg(vg, disks)


def _remove_vg(made: MadeVg, other: OtherLvm) -> None:
    other.run("vgremove", "--yes", "--force", made.name, check=False)
    for disk in made.disks.values():
        run("losetup", "--detach", disk.loop, check=False)
        disk.image.unlink(missing_ok=True)


def _walk(made: MadeVg, other: OtherLvm, plugin: CsiPlugin, seed: int, steps: int, *,
          lvm_dir: Path | None = None) -> OtherWalk:
    """The walk: the comparison after the other release made the VG, then
    `steps` steps, each kind once first (OtherWalk.first). `lvm_dir`: the
    plugin's LVM configuration, for Debian 12's `lvs` too."""
    env = {"LVM_SYSTEM_DIR": str(lvm_dir)} if lvm_dir is not None else None
    walk = OtherWalk(random.Random(seed), made.name, made.disks, plugin,
                     moment=Moment(ProcessRunner(extra_env=env)),
                     picks=random.Random(f"picks {seed}"), other=other)
    plugin.runner.observe = walk.clock.observe
    plugin.runner.start_shell()
    started = time.monotonic()
    try:
        walk.compare(0, f"vgcreate by {other.suite}")
        for step in range(1, steps + 1):
            first = walk.first()
            if step <= len(first):
                action = first[step - 1]
            else:
                actions = walk.actions()
                (action,) = walk.rng.choices([a for _, a in actions], [w for w, _ in actions])
            with walk.clock.timed(f"step {action.__name__}"):
                action()
            with walk.clock.timed("udev settle"):
                run("udevadm", "settle", "--timeout=60", check=False)
            walk.steps[action.__name__] = walk.steps.get(action.__name__, 0) + 1
            walk.compare(step, action.__name__, last=lvm_dir is None and step == steps)
    finally:
        took = time.monotonic() - started
        print(f"{other.suite} walk, seed {seed}: {sum(walk.steps.values())} of {steps} steps "
              f"in {took:.0f} s; steps taken: {dict(sorted(walk.steps.items()))}; commands "
              f"LVM refused: {walk.failed_commands}; comparisons while the plugin took LVM's "
              f"answer: {walk.fallbacks}; where thin_pools asked LVM: "
              f"{walk.partial_fallbacks}; time: {walk.clock.summary()}")
    return walk


def _plugin(vg: str, work: Path) -> CsiPlugin:
    config = Config(endpoint=f"unix://{work}/csi.sock", node_id="node-1", volume_group=vg,
                    thin_pool=POOL, state_dir=str(work / "state"), lock_dir=str(work / "locks"))
    return CsiPlugin(config)


@pytest.mark.parametrize("suite", sorted(RELEASES))
def test_walk_by_other_lvm(suite: str, work: Path) -> None:
    seed = int(os.environ.get("CSI_LOCAL_WALK_SEED") or random.randrange(1 << 32))
    print(f"{suite}: seed {seed} (CSI_LOCAL_WALK_SEED={seed} to walk it again)")
    run("modprobe", "dm-mirror", check=False)  # pvmove's temporary mirror
    other = OtherLvm.open(suite, work)
    try:
        assert other.release() == RELEASES[suite]
        made = _make_vg_by(other, work)
        try:
            # doctor names the release that wrote the VG, read off its PVs;
            # one newer than the plugin's own 2.03.16 is a warning.
            versions = doctor.check_lvm_versions(doctor.System(ProcessRunner()), [made.name])
            print(versions)
            assert f"VG {made.name} last written by LVM {RELEASES[suite]}" in versions.message
            assert versions.status == (doctor.WARN if suite == "trixie" else doctor.OK), versions
            plugin = _plugin(made.name, work)
            try:
                walk = _walk(made, other, plugin, seed, STEPS)
            finally:
                plugin.close()
            assert walk.steps.get("hand_pvmove"), walk.steps
        finally:
            _remove_vg(made, other)
    finally:
        other.close()


def test_rhel_like_devices_file_and_system_id(work: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    seed = int(os.environ.get("CSI_LOCAL_WALK_SEED") or random.randrange(1 << 32))
    print(f"seed {seed}")
    run("modprobe", "dm-mirror", check=False)
    other = OtherLvm.open("trixie", work)
    try:
        other.configure(RHEL_LVMLOCAL)
        assert other.run("lvm", "systemid").stdout.split() == ["system", "ID:", SYSTEM_ID]
        made = _make_vg_by(other, work, devices_file=True)
        try:
            _rhel_like(made, other, work, seed, monkeypatch)
        finally:
            _remove_vg(made, other)
    finally:
        other.close()


def _plugin_lvm_dir(work: Path, other: OtherLvm, lvmlocal: str) -> Path:
    """The plugin container's /etc/lvm on that host: the image's lvm.conf,
    the deployment's lvmlocal.conf, and the host's devices directory
    (node.yaml mounts it)."""
    lvm_dir = work / f"plugin-etc-lvm-{uuid.uuid4().hex[:4]}"
    (lvm_dir / "devices").mkdir(parents=True)
    shutil.copy(REPO / "deploy/container/lvm.conf", lvm_dir / "lvm.conf")
    (lvm_dir / "lvmlocal.conf").write_text(lvmlocal)
    _mount("--bind", str(other.etc / "devices"), str(lvm_dir / "devices"))
    return lvm_dir


def _rhel_like(made: MadeVg, other: OtherLvm, work: Path, seed: int,
               monkeypatch: pytest.MonkeyPatch) -> None:
    # The VG carries the host's system ID, and the devices file lists its PVs.
    out = other.run("vgs", "--noheadings", "-o", "vg_systemid", made.name).stdout.strip()
    assert out == SYSTEM_ID
    listed = other.run("lvm", "lvmdevices").stdout
    assert all(d.loop in listed for d in made.disks.values()), listed
    # Without the system ID the plugin's LVM (no system ID of its own) reads
    # the VG but takes it for another host's: it refuses to change it, so
    # every CreateVolume would fail. Why the docs ask for the host's system
    # ID in lvmlocal.conf.
    bare = _plugin_lvm_dir(work, other, "devices {\n}\n")
    try:
        env = {**os.environ, "LVM_SYSTEM_DIR": str(bare), "LVM_SUPPRESS_FD_WARNINGS": "1"}
        proc = subprocess.run(["lvcreate", "--yes", "--thin", "-V", "4M", "-n", "probe",
                               f"{made.name}/{POOL}"],
                              capture_output=True, text=True, env=env, check=False)
        print(f"without the system ID: lvcreate exited {proc.returncode}: "
              f"{proc.stderr.strip()}")
        assert proc.returncode != 0 and SYSTEM_ID in proc.stderr, proc.stderr
    finally:
        run("umount", str(bare / "devices"), check=False)
    lvm_dir = _plugin_lvm_dir(work, other, PLUGIN_LVMLOCAL)
    try:
        # doctor's "lvm view": the plugin's LVM and the host's (the chroot's
        # /etc/lvm, read by Debian 12's LVM as doctor reads the host's) alike.
        monkeypatch.setattr(lvm_config_checks, "LVM_DIR", str(lvm_dir))
        system = doctor.System(ProcessRunner(timeout=120.0,
                                             extra_env={"LVM_SYSTEM_DIR": str(lvm_dir)}))
        view = doctor.check_lvm_view(system, str(other.etc))
        print(view)
        assert view.status == doctor.OK, view
        assert made.name in view.message and "devices/system.devices" in view.message
        # The plugin, its LVM so set up, answers as `lvs` does while trixie
        # changes the VG.
        plugin_dir = [lvm_dir]

        def runner(**kwargs: Any) -> ProcessRunner:
            extra = {**(kwargs.pop("extra_env", None) or {}),
                     "LVM_SYSTEM_DIR": str(plugin_dir[0])}
            return ProcessRunner(extra_env=extra, **kwargs)

        monkeypatch.setattr("csi_local.csi.plugin.ProcessRunner", runner)
        plugin = _plugin(made.name, work)
        try:
            # The walk's `lvs` and `status` in-process read with the plugin's
            # configuration (the command `csi-local status` is left out: a
            # process of its own, its LVM would read this machine's).
            _walk(made, other, plugin, seed, STEPS, lvm_dir=lvm_dir)
            # At least one volume, whatever the walk left: the probe below
            # must have something to hide.
            code, resp = OtherWalk(random.Random(seed), made.name, made.disks, plugin).call(
                "CreateVolume", _create_request("foreign-probe", 4 << 20))
            assert code == "OK", resp
            probe_id = resp.volume.volume_id
        finally:
            plugin.close()
        # A node whose system ID changed (system_id_source "uname" and a new
        # host name): its LVM takes the VG for another host's and will not
        # show it. The plugin must not answer from the disks what `lvs`
        # refuses to show.
        plugin_dir[0] = _plugin_lvm_dir(
            work, other, PLUGIN_LVMLOCAL.replace(SYSTEM_ID, "another-node"))
        env = {**os.environ, "LVM_SYSTEM_DIR": str(plugin_dir[0]),
               "LVM_SUPPRESS_FD_WARNINGS": "1"}
        proc = subprocess.run(["lvs", "--noheadings", "-o", "lv_name", made.name],
                              capture_output=True, text=True, env=env, check=False)
        print(f"another system ID: lvs exited {proc.returncode}: {proc.stdout.strip()!r} "
              f"{proc.stderr.strip()!r}")
        plugin = _plugin(made.name, work)
        try:
            walk = OtherWalk(random.Random(seed), made.name, made.disks, plugin)
            code, resp = walk.call("ListVolumes", pb.ListVolumesRequest())
            got = sorted(e.volume.volume_id for e in resp.entries) if code == "OK" else []
            print(f"another system ID: ListVolumes {code} {got or resp}")
            # Whatever LVM does with a foreign VG (an error, or an empty
            # answer), the plugin lists no volume that LVM does not show.
            shown = set(proc.stdout.split()) if proc.returncode == 0 else set()
            assert probe_id not in shown, "LVM shows another host's VG: nothing is hidden here"
            assert set(got) <= shown, f"the plugin lists what LVM refuses to show: {got}"
        finally:
            plugin.close()
            run("umount", str(plugin_dir[0] / "devices"), check=False)
    finally:
        run("umount", str(lvm_dir / "devices"), check=False)
