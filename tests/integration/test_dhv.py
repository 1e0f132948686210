"""The Nomad dynamic host volume plugin, run exactly as Nomad's client runs it:
the executable in the plugin directory, `$1` the operation, and an environment
holding nothing but the DHV_* variables (no PATH, no HOME)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.dhv.request import lv_name_for
from csi_local.host import mounts
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume
from csi_local.version import __version__
from csi_local.volumes import naming
from csi_local.volumes.lock_keys import pool_key
from tests.integration.conftest import PluginProcess, mount_cap, run
from tests.integration.dhvkit import (
    MIB,
    Dhv,
    all_lvs,
    dhv_fixture,  # noqa: F401 - the `dhv` fixture
    failed,
    mounted_device,
    new_id,
    ok,
    reply,
)

pytestmark = pytest.mark.integration


def _best_of(argv: list[str], env: dict[str, str], n: int = 5) -> tuple[float, float, str]:
    """(first, best) wall time of running argv n times, and its stdout."""
    times, out = [], ""
    for _ in range(n):
        started = time.monotonic()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False,
                              timeout=120)
        times.append(time.monotonic() - started)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
    return times[0], min(times), out


@pytest.mark.report
def test_fingerprint_is_fast_and_light(dhv: Dhv) -> None:
    first, best, out = _best_of([dhv.exe, "fingerprint"], {"DHV_OPERATION": "fingerprint"})
    assert json.loads(out) == {"version": __version__}
    _, bare, _ = _best_of([sys.executable, "-I", "-c", "pass"], {})
    print(f"fingerprint wall time: first {first:.3f}s, best {best:.3f}s; "
          f"bare interpreter start {bare:.3f}s (Nomad allows fingerprint 1s)")
    # Answering costs little beyond starting the interpreter itself...
    assert best < 2 * bare + 0.2
    if os.environ.get("CSI_LOCAL_IN_VM") != "1":  # ...and is inside Nomad's 1 s on a real host
        assert best < 1.0
    # ...because nothing heavy is imported to answer.
    proc = subprocess.run([sys.executable, "-I", "-X", "importtime", dhv.exe, "fingerprint"],
                          env={}, capture_output=True, text=True, check=True, timeout=120)
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "csi_local.dhv" in imported
    heavy = {m for m in imported if m.split(".")[0] in {"grpc", "google", "pyudev"}}
    heavy |= {"csi_local.dhv.host_volumes", "csi_local.dhv.request", "csi_local.storage.lvm",
              "csi_local.errors"} & imported
    assert not heavy, heavy


def test_create_is_idempotent_and_remounts(dhv: Dhv) -> None:
    vid = new_id()
    first = ok(dhv.call("create", vid, cap_min=100 * MIB, cap_max=400 * MIB))
    path = dhv.path(vid)
    assert first["path"] == path
    lv = dhv.lv(vid)
    assert lv is not None and first["bytes"] == lv.size >= 100 * MIB
    assert f"csi-local-dhv.id={vid}" in lv.tags and "csi-local-dhv.kind=volume" in lv.tags
    top = mounted_device(path)
    assert top is not None and top.fs_type == "ext4"
    assert mounts.mount_is_device(top, lv.kernel_major, lv.kernel_minor)
    Path(path, "data").write_text("kept")

    again = dhv.call("create", vid, cap_min=100 * MIB, cap_max=400 * MIB)
    assert ok(again) == first
    assert [x.name for x in dhv.lvs()] == [lv.name]
    assert len(mounts.mounts_at(path)) == 1  # not mounted twice

    # after a reboot (or a lost mount) Nomad re-runs create: mount again, never reformat
    run("umount", path)
    assert not mounts.is_mount_point(path)
    assert ok(dhv.call("create", vid, cap_min=100 * MIB, cap_max=400 * MIB)) == first
    assert mounts.is_mount_point(path)
    assert Path(path, "data").read_text() == "kept"
    print(f"create {first['bytes']} bytes, re-create took {again.seconds:.2f}s")


def test_grow_online_and_refuse_shrink(dhv: Dhv) -> None:
    vid = new_id()
    small = ok(dhv.call("create", vid, cap_min=100 * MIB))
    path = small["path"]
    fs_before = os.statvfs(path).f_blocks * os.statvfs(path).f_frsize
    Path(path, "data").write_text("kept")

    grown = ok(dhv.call("create", vid, cap_min=300 * MIB, cap_max=1024 * MIB))
    assert grown["path"] == path and grown["bytes"] >= 300 * MIB > small["bytes"]
    lv = dhv.lv(vid)
    assert lv is not None and lv.size == grown["bytes"]
    fs_after = os.statvfs(path).f_blocks * os.statvfs(path).f_frsize
    assert fs_after > fs_before + 150 * MIB, (fs_before, fs_after)
    assert Path(path, "data").read_text() == "kept"
    assert "csi-local-dhv.grow-fs" not in lv.tags

    res = dhv.call("create", vid, cap_min=100 * MIB, cap_max=200 * MIB)
    failed(res, "shrinking a volume is not supported", str(grown["bytes"]))
    lv = dhv.lv(vid)
    assert lv is not None and lv.size == grown["bytes"]
    assert mounts.is_mount_point(path)
    assert os.statvfs(path).f_blocks * os.statvfs(path).f_frsize == fs_after


def test_delete_and_delete_again(dhv: Dhv) -> None:
    vid = new_id()
    path = ok(dhv.call("create", vid, cap_min=64 * MIB))["path"]
    assert dhv.lv(vid) is not None
    ok(dhv.call("delete", vid))
    assert dhv.lv(vid) is None
    assert not mounts.is_mount_point(path) and not os.path.exists(path)
    ok(dhv.call("delete", vid))  # already gone: success


def _kill_create_after_lv_appears(dhv: Dhv, vid: str) -> None:
    device = f"/dev/{dhv.vg.name}/{lv_name_for(vid)}"
    proc = dhv.popen("create", vid, cap_min=64 * MIB)
    deadline = time.monotonic() + 60
    while not os.path.exists(device):
        assert proc.poll() is None, f"create ended before the LV appeared: {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL  # killed part-way, not finished
    assert dhv.lv(vid) is not None


def test_delete_after_a_killed_create(dhv: Dhv) -> None:
    vid = new_id()
    _kill_create_after_lv_appears(dhv, vid)
    ok(dhv.call("delete", vid))
    assert dhv.lv(vid) is None
    assert not mounts.is_mount_point(dhv.path(vid))
    assert not os.path.exists(dhv.path(vid))


def test_create_after_a_killed_create_converges(dhv: Dhv) -> None:
    vid = new_id()
    _kill_create_after_lv_appears(dhv, vid)
    out = ok(dhv.call("create", vid, cap_min=64 * MIB))
    lv = dhv.lv(vid)
    assert lv is not None and out["bytes"] == lv.size
    assert "csi-local-dhv.fresh" not in lv.tags
    top = mounted_device(out["path"])
    assert top is not None and top.fs_type == "ext4"


def test_concurrent_creates_of_one_volume(dhv: Dhv) -> None:
    vid = new_id()
    procs = [dhv.popen("create", vid, cap_min=64 * MIB) for _ in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        results.append(reply(proc.returncode, stdout, stderr, 0.0))
    assert ok(results[0]) == ok(results[1])
    assert [lv.name for lv in dhv.lvs()] == [lv_name_for(vid)]
    assert len(mounts.mounts_at(dhv.path(vid))) == 1


@pytest.mark.parametrize("params,fragment", [
    ({"colour": "red"}, "unknown parameter"),
    ({"fs_type": "ntfs"}, "unsupported fs_type 'ntfs'"),
    ({"mount_options": "remount"}, "not allowed"),
])
def test_bad_parameters_leave_nothing(dhv: Dhv, params: dict[str, str], fragment: str) -> None:
    vid = new_id()
    failed(dhv.call("create", vid, cap_min=64 * MIB, params=params), fragment)
    assert dhv.lvs() == []
    assert not os.path.exists(dhv.path(vid))


def test_failed_first_create_is_rolled_back(dhv: Dhv) -> None:
    vid = new_id()  # an option mount(8) itself refuses, after lvcreate and mkfs
    res = dhv.call("create", vid, cap_min=64 * MIB, params={"mount_options": "data=bogus"})
    failed(res, "mount")
    assert dhv.lvs() == []
    assert not mounts.is_mount_point(dhv.path(vid))
    assert not os.path.exists(dhv.path(vid))


def test_xfs_and_mount_options(dhv: Dhv) -> None:
    vid = new_id()
    res = dhv.call("create", vid, cap_min=10 * MIB,
                   params={"fs_type": "xfs", "mount_options": "noatime"})
    out = ok(res)
    assert out["bytes"] >= 300 * MIB  # mkfs.xfs's minimum wins over capacity_min
    top = mounted_device(out["path"])
    assert top is not None and top.fs_type == "xfs" and "noatime" in top.options
    failed(dhv.call("create", vid, cap_min=10 * MIB, params={"fs_type": "ext4"}),
           "reformat")
    assert mounted_device(out["path"]) is not None


def test_shares_the_pool_lock_with_the_csi_plugin(dhv: Dhv) -> None:
    vid = new_id()
    # the key of this VG's pool (each device class's pool has its own)
    with Locks(str(dhv.lock_dir)).hold(pool_key(dhv.vg.name, dhv.vg.pool)):
        proc = dhv.popen("create", vid, cap_min=64 * MIB)
        time.sleep(4)
        assert proc.poll() is None and dhv.lv(vid) is None  # waiting for the pool's lock
    stdout, stderr = proc.communicate(timeout=120)
    ok(reply(proc.returncode, stdout, stderr, 0.0))
    assert dhv.lv(vid) is not None


def test_coexists_with_csi_volumes(dhv: Dhv, plugin: PluginProcess) -> None:
    # both plugins on one pool, sharing one lock directory
    dhv.install(lock_dir=plugin.workdir / "locks")
    csi = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="csi-one", volume_capabilities=[mount_cap()],
        capacity_range=pb.CapacityRange(required_bytes=64 * MIB)))
    csi_id = csi.volume.volume_id
    vid = new_id()
    ok(dhv.call("create", vid, cap_min=64 * MIB))

    listed = plugin.controller.ListVolumes(pb.ListVolumesRequest())
    assert [e.volume.volume_id for e in listed.entries] == [csi_id]
    by_name = {lv.name: lv for lv in dhv.lvs()}
    assert naming.is_csi_volume(by_name[csi_id])
    assert not naming.is_csi_volume(by_name[lv_name_for(vid)])
    assert not any(t.startswith("csi-local.") for t in by_name[lv_name_for(vid)].tags)
    # the pool's capacity counts both kinds
    cap = plugin.controller.GetCapacity(pb.GetCapacityRequest())
    pool = next(lv for lv in all_lvs(dhv.vg) if lv.name == dhv.vg.pool)
    assert cap.available_capacity <= pool.size - 2 * 64 * MIB

    ok(dhv.call("delete", vid))
    assert dhv.lv(vid) is None
    assert [lv.name for lv in dhv.lvs()] == [csi_id]  # the CSI volume survives
    # and the CSI plugin's delete leaves DHV volumes alone
    other = new_id()
    ok(dhv.call("create", other, cap_min=64 * MIB))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=lv_name_for(other)))
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=csi_id))
    assert [lv.name for lv in dhv.lvs()] == [lv_name_for(other)]


def test_never_touches_an_lv_it_did_not_make(dhv: Dhv) -> None:
    vid = new_id()
    # an LV under the name this volume maps to, tagged as a CSI volume
    run("lvcreate", "--yes", "--thin", f"{dhv.vg.name}/{dhv.vg.pool}", "--virtualsize", "64m",
        "--name", lv_name_for(vid), "--addtag", f"{naming.TAG_KIND}={naming.KIND_VOLUME}")
    failed(dhv.call("delete", vid), "not host volume")
    failed(dhv.call("create", vid, cap_min=64 * MIB), "not host volume")
    lv = dhv.lv(vid)
    assert lv is not None and lv.size == 64 * MIB
    assert not os.path.exists(dhv.path(vid))


# --- delete of a volume that something holds -------------------------------------


def holds(message: str, pid: int, what: str) -> None:
    """`message` names process `pid` (sleep) as holding the volume by `what`."""
    pattern = rf"process {pid} \(sleep\)( in cgroup \S+)? holds it: {re.escape(what)}(;|\.)"
    assert re.search(pattern, message), (pattern, message)


def in_namespace(message: str, points: list[str], pid: int) -> None:
    """`message` names the volume's mounts at `points` in the namespace of `pid`."""
    pattern = (rf"it is mounted at {re.escape(', '.join(points))} in the mount namespace of "
               rf"process {pid} \(sleep\)( in cgroup \S+)?(;|\.)")
    assert re.search(pattern, message), (pattern, message)


def assert_kept(dhv: Dhv, vid: str, lv: LogicalVolume) -> None:
    """Delete changed nothing: mounted where Nomad expects it, data and LV intact."""
    path = dhv.path(vid)
    top = mounts.top_mount(path)
    assert top is not None and mounts.mount_is_device(top, lv.kernel_major, lv.kernel_minor)
    assert Path(path, "data").read_text() == "kept"
    kept = dhv.lv(vid)
    assert kept is not None and (kept.name, kept.size, kept.tags) == (lv.name, lv.size, lv.tags)


def assert_gone(dhv: Dhv, vid: str, lv: LogicalVolume) -> None:
    assert dhv.lv(vid) is None
    assert not mounts.is_mount_point(dhv.path(vid)) and not os.path.exists(dhv.path(vid))
    assert not any(mounts.mount_is_device(m, lv.kernel_major, lv.kernel_minor)
                   for m in mounts.read_mounts())


def create_with_data(dhv: Dhv) -> tuple[str, LogicalVolume]:
    vid = new_id()
    ok(dhv.call("create", vid, cap_min=64 * MIB))
    Path(dhv.path(vid), "data").write_text("kept")
    lv = dhv.lv(vid)
    assert lv is not None
    return vid, lv


def sleeper(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    """A process that runs `argv` ending in sleep; returns once sleep runs."""
    proc = subprocess.Popen([*argv, "sleep", "1000"], **kw)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep":
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_delete_refuses_a_volume_that_processes_hold(dhv: Dhv) -> None:
    vid, lv = create_with_data(dhv)
    path = dhv.path(vid)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(sleeper([], cwd=path))
        with open(Path(path, "data"), "rb") as data, open(lv.path, "rb") as device:
            procs.append(sleeper([], stdin=data))
            procs.append(sleeper([], stdin=device))
        message = failed(dhv.call("delete", vid),
                         f"volume {vid} (LV {lv.vg}/{lv.name}) is in use, so nothing was "
                         "unmounted or removed: ", "Stop what holds it, then delete again")
        holds(message, procs[0].pid, f"working directory {path}")
        holds(message, procs[1].pid, f"open file {path}/data")
        holds(message, procs[2].pid, f"open file {os.path.realpath(lv.path)}")
        print(f"delete refused: {message}")
        assert_kept(dhv, vid, lv)
    finally:
        stop(procs)
    ok(dhv.call("delete", vid))
    assert_gone(dhv, vid, lv)


def test_delete_refuses_a_volume_mounted_elsewhere(dhv: Dhv) -> None:
    # On a systemd host "/" is a shared mount and sandboxed services live in
    # slave mount namespaces; the VM's may be private, so the volumes
    # directory is made a shared mount of its own.
    vdir = str(dhv.volumes_dir)
    dhv.volumes_dir.mkdir()
    run("mount", "--bind", vdir, vdir)
    run("mount", "--make-private", vdir)
    run("mount", "--make-shared", vdir)
    vid, lv = create_with_data(dhv)
    path = dhv.path(vid)
    bind, task_data = dhv.workdir / "bind", dhv.workdir / "task-data"
    bind.mkdir()
    task_data.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # a task's container: a private mount namespace that got the volume
        # by a bind mount (and holds a private copy of its mount at `path`)
        task = sleeper(["unshare", "--mount", "--propagation", "private"])
        procs.append(task)
        run("nsenter", "--target", str(task.pid), "--mount",
            "mount", "--bind", path, str(task_data))
        run("mount", "--bind", path, str(bind))  # and a bind mount in this namespace
        message = failed(dhv.call("delete", vid), "is in use, so nothing was unmounted",
                         f"it is also mounted at {bind}")
        in_namespace(message, [path, str(task_data)], task.pid)
        print(f"delete refused: {message}")
        assert_kept(dhv, vid, lv)
        assert (bind / "data").read_text() == "kept"

        run("umount", str(bind))
        stop(procs)
        procs.clear()
        # a sandboxed service: its copy of the mount goes with ours, so it holds nothing
        service = sleeper(["unshare", "--mount", "--propagation", "slave"])
        procs.append(service)
        assert path in ns_mount_points(service.pid)
        ok(dhv.call("delete", vid))
        assert_gone(dhv, vid, lv)
        assert path not in ns_mount_points(service.pid)
    finally:
        stop(procs)


def ns_mount_points(pid: int) -> list[str]:
    return [m.mount_point for m in mounts.read_mounts(f"/proc/{pid}/mountinfo")]


def test_delete_mounts_the_volume_again_when_lvremove_fails(dhv: Dhv) -> None:
    vid, lv = create_with_data(dhv)
    path = dhv.path(vid)
    # A mount namespace that no process is in, pinned by a file, with a
    # private copy of the volume's mount: nothing delete can see holds it,
    # yet lvremove finds the LV in use after the umount.
    pins = dhv.workdir / "pins"
    pins.mkdir()
    run("mount", "--bind", str(pins), str(pins))
    run("mount", "--make-private", str(pins))  # unshare pins namespaces on private mounts only
    pin = pins / "ns"
    pin.touch()
    try:
        run("unshare", f"--mount={pin}", "--propagation", "private", "true")
        message = failed(dhv.call("delete", vid), f"LV {lv.vg}/{lv.name} could not be removed (",
                         "in use", f"it is mounted again at {path}, as before the delete",
                         f"pinned at {pin}, may hold it")
        print(f"delete failed: {message}")
        assert_kept(dhv, vid, lv)
    finally:
        run("umount", str(pin), check=False)
    ok(dhv.call("delete", vid))
    assert_gone(dhv, vid, lv)
