"""Golden-volume clones, snapshots of host volumes and the block-device
refusal of the Nomad dynamic host volume plugin (issue 18), against real LVM:
the plugin run as Nomad's client runs it (an empty environment plus DHV_*),
and its `snapshot` command as an operator runs it (an empty environment)."""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from csi_local.dhv.request import lv_name_for, snapshot_lv_name
from csi_local.host import mounts
from csi_local.storage.lvm import LogicalVolume
from tests.integration.conftest import run
from tests.integration.dhvkit import (
    MIB,
    Dhv,
    dhv_fixture,  # noqa: F401 - the `dhv` fixture
    failed,
    mounted_device,
    new_id,
    ok,
)

pytestmark = pytest.mark.integration

TAG_SOURCE = "csi-local-dhv.source"
TAG_FRESH = "csi-local-dhv.fresh"


# --- helpers ---------------------------------------------------------------------


def lv_of(dhv: Dhv, volume_id: str) -> LogicalVolume:
    lv = dhv.lv(volume_id)
    assert lv is not None, f"no LV for volume {volume_id}"
    return lv


def snapshot_lv(dhv: Dhv, name: str) -> LogicalVolume | None:
    return next((lv for lv in dhv.lvs() if lv.name == snapshot_lv_name(name)), None)


def same_lv(a: LogicalVolume, b: LogicalVolume) -> bool:
    return (a.name, a.size, a.tags, a.origin) == (b.name, b.size, b.tags, b.origin)


def fs_uuid(device: str) -> str:
    """The file system's UUID, read from the device itself (no blkid cache)."""
    return run("blkid", "-p", "-o", "value", "-s", "UUID", device).stdout.strip()


def fs_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def drop_caches() -> None:
    """Reads after this come from the devices, not from the page cache. (The
    sync is of what is already written; no test syncs before a snapshot.)"""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def assert_mounted(dhv: Dhv, volume_id: str, fs_type: str) -> LogicalVolume:
    """The volume's LV is what is mounted at its path, with `fs_type`."""
    lv = lv_of(dhv, volume_id)
    top = mounted_device(dhv.path(volume_id))
    assert top is not None, f"nothing mounted at {dhv.path(volume_id)}"
    assert top.fs_type == fs_type, top
    assert mounts.mount_is_device(top, lv.kernel_major, lv.kernel_minor), (top, lv)
    return lv


def write_golden(path: str) -> dict[str, bytes]:
    """Files a golden volume holds (a directory, a small and a bigger file),
    written without any sync: committing them is the plugin's job."""
    data = {
        "hello.txt": b"golden\n",
        "dir/nested.bin": os.urandom(3 * MIB + 123),
        "dir/deeper/empty": b"",
    }
    for rel, content in data.items():
        target = Path(path, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return data


def assert_holds(path: str, data: dict[str, bytes]) -> None:
    for rel, content in data.items():
        got = Path(path, rel).read_bytes()
        assert hashlib.sha256(got).digest() == hashlib.sha256(content).digest(), \
            f"{path}/{rel}: {len(got)} bytes, expected {len(content)}"


def make_source(dhv: Dhv, *, name: str = "golden", namespace: str = "default",
                size: int = 64 * MIB, fs_type: str | None = None) -> tuple[str, dict[str, bytes]]:
    vid = new_id()
    params = {"fs_type": fs_type} if fs_type else None
    out = ok(dhv.call("create", vid, cap_min=size, params=params, name=name,
                      namespace=namespace))
    return vid, write_golden(out["path"])


def clone(dhv: Dhv, *, volume: str | None = None, snapshot: str | None = None,
          name: str = "clone", namespace: str = "default", cap_min: int = 0, cap_max: int = 0,
          extra: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    vid = new_id()
    params = dict(extra or {})
    if volume is not None:
        params["source_volume"] = volume
    if snapshot is not None:
        params["source_snapshot"] = snapshot
    out = ok(dhv.call("create", vid, cap_min=cap_min, cap_max=cap_max, params=params,
                      name=name, namespace=namespace))
    assert out["path"] == dhv.path(vid)
    return vid, out


def assert_clone_lv(dhv: Dhv, vid: str, source: LogicalVolume, fs_type: str,
                    made_from: str) -> LogicalVolume:
    """A clone's LV: an active thin snapshot of `source` (no activation skip),
    tagged with its source, never marked fresh (never formatted)."""
    lv = lv_of(dhv, vid)
    assert lv.is_thin_volume and lv.origin == source.name, (lv.attr, lv.origin)
    assert lv.active and not lv.activation_skip, lv.attr
    assert "csi-local-dhv.kind=volume" in lv.tags, lv.tags
    assert f"csi-local-dhv.id={vid}" in lv.tags, lv.tags
    assert f"csi-local-dhv.fs={fs_type}" in lv.tags, lv.tags
    assert f"{TAG_SOURCE}={made_from}" in lv.tags, lv.tags
    assert TAG_FRESH not in lv.tags, lv.tags
    return lv


@dataclass(frozen=True)
class Scene:
    """What a refused create must leave as it was."""

    lvs: frozenset[str]
    entries: frozenset[str]
    mount_points: frozenset[str]


def scene(dhv: Dhv) -> Scene:
    vdir = dhv.volumes_dir
    return Scene(
        lvs=frozenset(lv.name for lv in dhv.lvs()),
        entries=frozenset(os.listdir(vdir)) if vdir.exists() else frozenset(),
        mount_points=frozenset(m.mount_point for m in mounts.read_mounts()),
    )


def assert_nothing_left(dhv: Dhv, before: Scene, vid: str) -> None:
    after = scene(dhv)
    assert after.lvs == before.lvs, f"LVs added {after.lvs - before.lvs}, " \
        f"removed {before.lvs - after.lvs}"
    assert lv_name_for(vid) not in after.lvs
    assert after.entries == before.entries, after.entries ^ before.entries
    assert not os.path.exists(dhv.path(vid))
    assert after.mount_points == before.mount_points, after.mount_points ^ before.mount_points


# --- clones ----------------------------------------------------------------------


def test_clone_by_id_and_by_name_holds_the_source_data_and_diverges(dhv: Dhv) -> None:
    src, data = make_source(dhv, name="golden")
    src_path = dhv.path(src)
    src_lv = lv_of(dhv, src)

    by_id, out_id = clone(dhv, volume=src, name="clone-by-id")
    by_name, out_name = clone(dhv, volume="golden", name="clone-by-name")
    for vid, out in ((by_id, out_id), (by_name, out_name)):
        lv = assert_clone_lv(dhv, vid, src_lv, "ext4", f"volume:{src}")
        assert out["bytes"] == lv.size == src_lv.size
        assert_mounted(dhv, vid, "ext4")
        # never formatted: the very file system of the source, UUID and all
        assert fs_uuid(lv.path) == fs_uuid(src_lv.path)
    # the source is still mounted, unchanged and writable
    assert same_lv(lv_of(dhv, src), src_lv)
    assert_mounted(dhv, src, "ext4")

    drop_caches()
    for vid in (by_id, by_name):
        assert_holds(dhv.path(vid), data)

    # each goes its own way from here
    Path(src_path, "hello.txt").write_text("changed in the source\n")
    Path(src_path, "source-only").write_text("source")
    for vid in (by_id, by_name):
        Path(dhv.path(vid), "dir", "nested.bin").write_bytes(vid.encode())
        Path(dhv.path(vid), f"only-{vid}").write_text(vid)
    drop_caches()
    assert Path(src_path, "hello.txt").read_text() == "changed in the source\n"
    assert Path(src_path, "dir", "nested.bin").read_bytes() == data["dir/nested.bin"]
    assert sorted(p.name for p in Path(src_path).glob("only-*")) == []
    for vid in (by_id, by_name):
        path = Path(dhv.path(vid))
        assert (path / "hello.txt").read_bytes() == data["hello.txt"]
        assert (path / "dir" / "nested.bin").read_bytes() == vid.encode()
        assert not (path / "source-only").exists()
        assert sorted(p.name for p in path.glob("only-*")) == [f"only-{vid}"]

    # Nomad repeats the same create (client restarts): the same answer, data kept
    again = ok(dhv.call("create", by_name, params={"source_volume": "golden"},
                        name="clone-by-name"))
    assert again == out_name
    assert Path(dhv.path(by_name), f"only-{by_name}").read_text() == by_name
    # ...but a volume's source cannot change
    lv_before = lv_of(dhv, by_id)
    failed(dhv.call("create", by_id, params={"source_volume": by_name}, name="clone-by-id"))
    assert same_lv(lv_of(dhv, by_id), lv_before)
    assert_mounted(dhv, by_id, "ext4")
    assert Path(dhv.path(by_id), f"only-{by_id}").read_text() == by_id


def test_clone_grown_beyond_its_source(dhv: Dhv) -> None:
    src, data = make_source(dhv, size=64 * MIB)
    src_lv = lv_of(dhv, src)
    src_fs = fs_bytes(dhv.path(src))

    vid, out = clone(dhv, volume=src, cap_min=256 * MIB, cap_max=1024 * MIB)
    lv = assert_clone_lv(dhv, vid, src_lv, "ext4", f"volume:{src}")
    assert out["bytes"] == lv.size >= 256 * MIB > src_lv.size
    assert "csi-local-dhv.grow-fs" not in lv.tags
    assert_mounted(dhv, vid, "ext4")
    grown = fs_bytes(dhv.path(vid))
    assert grown > src_fs + 150 * MIB, (src_fs, grown)
    assert fs_uuid(lv.path) == fs_uuid(src_lv.path)  # grown, not reformatted
    drop_caches()
    assert_holds(dhv.path(vid), data)
    # the source keeps its size
    assert lv_of(dhv, src).size == src_lv.size
    assert fs_bytes(dhv.path(src)) == src_fs


@pytest.mark.parametrize("fs_type,size", [pytest.param("xfs", 300 * MIB, id="xfs"),
                                          pytest.param("btrfs", 128 * MIB, id="btrfs")])
def test_clone_mounts_beside_its_mounted_source(dhv: Dhv, fs_type: str, size: int) -> None:
    src, data = make_source(dhv, size=size, fs_type=fs_type)
    src_lv = lv_of(dhv, src)
    # fs_type may be given, when it is the source's
    vid, _ = clone(dhv, volume=src, extra={"fs_type": fs_type})
    lv = assert_clone_lv(dhv, vid, src_lv, fs_type, f"volume:{src}")
    # both mounted at once
    assert_mounted(dhv, src, fs_type)
    assert_mounted(dhv, vid, fs_type)
    if fs_type == "btrfs":  # a new fsid, or the kernel takes it for the mounted source
        assert fs_uuid(lv.path) != fs_uuid(src_lv.path)
    else:  # xfs mounts with nouuid; the file system is the source's own
        assert fs_uuid(lv.path) == fs_uuid(src_lv.path)
    drop_caches()
    assert_holds(dhv.path(vid), data)
    Path(dhv.path(vid), "clone-only").write_text("clone")
    Path(dhv.path(src), "source-only").write_text("source")
    drop_caches()
    assert not Path(dhv.path(src), "clone-only").exists()
    assert not Path(dhv.path(vid), "source-only").exists()
    assert_holds(dhv.path(src), data)


# --- snapshots -------------------------------------------------------------------

# Appends numbered lines to a file, each fsync'd, until the stop file appears.
WRITER = r"""
import os, sys
path, stop = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
i = 0
while not os.path.exists(stop):
    os.write(fd, b"%08d %s\n" % (i, b"x" * 120))
    os.fsync(fd)
    i += 1
os.close(fd)
"""


def log_lines(path: Path) -> list[str]:
    text = path.read_bytes().decode(errors="replace")
    return text.split("\n")


def assert_log_intact(path: Path) -> int:
    """The writer's log holds whole, consecutive lines only (no torn or zeroed
    tail); returns how many."""
    lines = log_lines(path)
    assert lines[-1] == "", f"torn last line {lines[-1][:40]!r}"
    lines = lines[:-1]
    for i, line in enumerate(lines):
        assert line == f"{i:08d} {'x' * 120}", f"line {i}: {line[:40]!r}"
    return len(lines)


def wait_for(predicate: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_snapshot_of_a_volume_being_written_is_clean(dhv: Dhv) -> None:
    src, data = make_source(dhv, name="busy")
    src_path = Path(dhv.path(src))
    src_lv = lv_of(dhv, src)
    log = src_path / "log"
    stop = dhv.workdir / "stop-writer"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(stop)])
    try:
        wait_for(lambda: log.exists() and len(log_lines(log)) > 50, "the writer")
        lines_before = len(log_lines(log)) - 1
        res = dhv.snapshot("create", src, "busy-1")
        after_snapshot = len(log_lines(log))
        # the source was thawed: the writer goes on
        wait_for(lambda: len(log_lines(log)) > after_snapshot + 50, "writes after the snapshot")
        assert writer.poll() is None
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert writer.returncode == 0
    out = ok(res)
    name = snapshot_lv_name("busy-1")
    assert out == {"snapshot": "busy-1", "volume_id": src, "lv": f"{dhv.vg.name}/{name}",
                   "bytes": src_lv.size, "device_class": "default"}
    print(f"snapshot create of a volume being written: {res.seconds:.2f}s")

    snap = snapshot_lv(dhv, "busy-1")
    assert snap is not None and snap.origin == src_lv.name
    assert not snap.active and snap.activation_skip, snap.attr
    for tag in ("csi-local-dhv.kind=snapshot", "csi-local-dhv.snapshot=busy-1",
                f"{TAG_SOURCE}=volume:{src}", "csi-local-dhv.fs=ext4"):
        assert tag in snap.tags, snap.tags
    namespace = [t for t in src_lv.tags if t.startswith("csi-local-dhv.namespace")]
    assert namespace and set(namespace) <= snap.tags, (namespace, snap.tags)

    # The snapshot's file system is clean, not merely crash-consistent: a
    # mounted ext4 carries needs_recovery, a frozen one has its journal flushed.
    assert "needs_recovery" in features(src_lv.path)
    run("lvchange", "-ay", "-K", f"{dhv.vg.name}/{name}")
    try:
        device = f"/dev/{dhv.vg.name}/{name}"
        wait_for(lambda: os.path.exists(device), device, timeout=30)
        fsck = run("e2fsck", "-fn", device, check=False)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
        assert "needs_recovery" not in features(device)
    finally:
        run("lvchange", "-an", f"{dhv.vg.name}/{name}")

    vid, _ = clone(dhv, snapshot="busy-1")
    assert_clone_lv(dhv, vid, snap, "ext4", "snapshot:busy-1")
    assert_mounted(dhv, vid, "ext4")
    drop_caches()
    assert_holds(dhv.path(vid), data)
    in_snapshot = assert_log_intact(Path(dhv.path(vid), "log"))
    total = assert_log_intact(log)
    # at least what was fsync'd before the snapshot began; not what came after it
    assert lines_before <= in_snapshot < total, (lines_before, in_snapshot, total)
    print(f"log lines: {lines_before} before snapshot create, {in_snapshot} in the "
          f"snapshot, {total} in the end")


def features(device: str) -> str:
    out = run("dumpe2fs", "-h", device).stdout
    line = next(x for x in out.splitlines() if x.startswith("Filesystem features:"))
    return line


def test_snapshot_list_and_delete(dhv: Dhv) -> None:
    a, data_a = make_source(dhv, name="a")
    b, _ = make_source(dhv, name="b", size=96 * MIB)
    size_a, size_b = lv_of(dhv, a).size, lv_of(dhv, b).size
    t0 = time.time()
    made_a = ok(dhv.snapshot("create", a, "snap-a"))
    assert made_a == {"snapshot": "snap-a", "volume_id": a, "bytes": size_a,
                      "lv": f"{dhv.vg.name}/{snapshot_lv_name('snap-a')}",
                      "device_class": "default"}  # the one class of --volume-group
    lvs = scene(dhv).lvs
    assert ok(dhv.snapshot("create", a, "snap-a")) == made_a  # idempotent
    assert scene(dhv).lvs == lvs
    failed(dhv.snapshot("create", b, "snap-a"))  # the name is taken, by another volume
    failed(dhv.snapshot("create", new_id(), "snap-x"))  # no such volume
    assert snapshot_lv(dhv, "snap-x") is None
    assert scene(dhv).lvs == lvs
    made_b = ok(dhv.snapshot("create", b, "snap-b"))
    # a later write is not in the snapshot
    Path(dhv.path(a), "later").write_text("after snap-a")

    listed = ok(dhv.snapshot("list", "--json"))["snapshots"]
    by_name = {s["snapshot"]: s for s in listed}
    assert set(by_name) == {"snap-a", "snap-b"}, listed
    for made, size in ((made_a, size_a), (made_b, size_b)):
        entry = by_name[made["snapshot"]]
        assert {k: entry[k] for k in ("snapshot", "volume_id", "lv", "bytes",
                                      "device_class")} == made
        assert entry["bytes"] == size
        assert entry["fs_type"] == "ext4"
        assert isinstance(entry["created"], int)
        assert t0 - 120 <= entry["created"] <= time.time() + 120, entry
    only_a = ok(dhv.snapshot("list", a, "--json"))["snapshots"]
    assert [s["snapshot"] for s in only_a] == ["snap-a"]
    table = dhv.snapshot_run("list")
    assert table.returncode == 0, table.stderr
    assert "snap-a" in table.stdout and "snap-b" in table.stdout, table.stdout

    vid, _ = clone(dhv, snapshot="snap-a")
    assert ok(dhv.snapshot("delete", "snap-a")) == {}
    assert snapshot_lv(dhv, "snap-a") is None
    assert ok(dhv.snapshot("delete", "snap-a")) == {}  # gone already: success
    assert [s["snapshot"] for s in ok(dhv.snapshot("list", "--json"))["snapshots"]] \
        == ["snap-b"]
    assert ok(dhv.snapshot("list", a, "--json"))["snapshots"] == []
    # the clone outlives the snapshot it was made from
    drop_caches()
    assert_holds(dhv.path(vid), data_a)
    assert not Path(dhv.path(vid), "later").exists()
    Path(dhv.path(vid), "written").write_text("after the snapshot's delete")
    drop_caches()
    assert Path(dhv.path(vid), "written").read_text() == "after the snapshot's delete"
    assert_mounted(dhv, vid, "ext4")


def test_deleting_the_source_keeps_its_clones_and_snapshots(dhv: Dhv) -> None:
    src, data = make_source(dhv, name="doomed")
    from_volume, out_volume = clone(dhv, volume=src, name="from-volume")
    ok(dhv.snapshot("create", src, "doomed-snap"))
    from_snap, _ = clone(dhv, snapshot="doomed-snap", name="from-snap")

    ok(dhv.call("delete", src))
    assert dhv.lv(src) is None and not os.path.exists(dhv.path(src))
    drop_caches()
    for vid in (from_volume, from_snap):
        assert_mounted(dhv, vid, "ext4")
        assert_holds(dhv.path(vid), data)
        Path(dhv.path(vid), "mine").write_text(vid)
    # the snapshot lives on, and clones are still made from it
    listed = ok(dhv.snapshot("list", "--json"))["snapshots"]
    assert [(s["snapshot"], s["volume_id"]) for s in listed] == [("doomed-snap", src)]
    late, _ = clone(dhv, snapshot="doomed-snap", name="late")
    assert_holds(dhv.path(late), data)
    # Nomad repeats a volume's create at every client start, with the source
    # it was made from long gone: the clone comes back, mounted, data and all
    run("umount", dhv.path(from_volume))
    again = ok(dhv.call("create", from_volume, params={"source_volume": src},
                        name="from-volume"))
    assert again == out_volume
    assert_mounted(dhv, from_volume, "ext4")
    assert Path(dhv.path(from_volume), "mine").read_text() == from_volume
    assert_holds(dhv.path(from_volume), data)


# --- refusals --------------------------------------------------------------------


def test_unknown_or_foreign_sources_are_refused_and_leave_nothing(dhv: Dhv) -> None:
    src, data = make_source(dhv, name="golden")
    src_lv = lv_of(dhv, src)
    foreign, _ = make_source(dhv, name="elsewhere", namespace="other")
    ok(dhv.snapshot("create", foreign, "foreign-snap"))
    ok(dhv.snapshot("create", src, "golden-snap"))
    cases: list[tuple[str, dict[str, str], int, tuple[str, ...]]] = [
        ("unknown volume ID", {"source_volume": new_id()}, 0, ()),
        ("unknown volume name", {"source_volume": "no-such-volume"}, 0, ()),
        ("unknown snapshot", {"source_snapshot": "no-such-snapshot"}, 0, ()),
        ("volume ID in another namespace", {"source_volume": foreign}, 0, ("namespace",)),
        ("volume name in another namespace", {"source_volume": "elsewhere"}, 0, ()),
        ("snapshot in another namespace", {"source_snapshot": "foreign-snap"}, 0,
         ("namespace",)),
        ("both sources", {"source_volume": src, "source_snapshot": "golden-snap"}, 0,
         ("not both",)),
        ("another file system", {"source_volume": src, "fs_type": "xfs"}, 0, ()),
        ("capacity_max below the source", {"source_volume": src}, 32 * MIB, ()),
        ("block-device", {"source_volume": src, "attachment_mode": "block-device"}, 0,
         ("block-device",)),
    ]
    problems = []
    for label, params, cap_max, fragments in cases:
        vid = new_id()
        before = scene(dhv)
        try:
            res = dhv.call("create", vid, params=params, cap_max=cap_max, name="refused")
            message = failed(res, *fragments)
            assert res.rc == 1, res.rc
            assert_nothing_left(dhv, before, vid)
            print(f"{label}: {message}")
        except AssertionError as err:
            problems.append(f"{label} {params}: {err}")
    assert not problems, "\n".join(problems)
    # the sources are as they were
    assert same_lv(lv_of(dhv, src), src_lv)
    assert_mounted(dhv, src, "ext4")
    assert_holds(dhv.path(src), data)


def test_block_device_is_refused(dhv: Dhv) -> None:
    vid = new_id()
    before = scene(dhv)
    res = dhv.call("create", vid, cap_min=64 * MIB, params={"attachment_mode": "block-device"})
    message = failed(res, "block-device")
    assert res.rc == 1
    assert_nothing_left(dhv, before, vid)
    print(f"refused: {message}")
    # file-system, the default, is accepted and changes nothing
    fs_vid = new_id()
    ok(dhv.call("create", fs_vid, cap_min=64 * MIB, params={"attachment_mode": "file-system"}))
    lv = assert_mounted(dhv, fs_vid, "ext4")
    assert TAG_FRESH not in lv.tags


# --- many clones -----------------------------------------------------------------


@pytest.mark.report
def test_ten_clones_of_one_source(dhv: Dhv) -> None:
    src, data = make_source(dhv, name="golden")
    src_lv = lv_of(dhv, src)
    plugin_times: list[float] = []
    bare_times: list[float] = []
    clones: list[str] = []
    bare: list[str] = []
    for i in range(10):  # alternately, so both meet the same pool
        vid = new_id()
        res = dhv.call("create", vid, params={"source_volume": src}, name=f"clone-{i}")
        ok(res)
        plugin_times.append(res.seconds)
        clones.append(vid)
        name = f"bare{i}"
        started = time.monotonic()
        run("lvcreate", "--snapshot", "--setactivationskip", "n", "--activate", "y",
            "-n", name, f"{dhv.vg.name}/{src_lv.name}")
        bare_times.append(time.monotonic() - started)
        bare.append(name)
    run("lvremove", "--yes", *(f"{dhv.vg.name}/{name}" for name in bare))

    drop_caches()
    devices = set()
    for vid in clones:
        lv = assert_clone_lv(dhv, vid, src_lv, "ext4", f"volume:{src}")
        assert_mounted(dhv, vid, "ext4")
        assert_holds(dhv.path(vid), data)
        devices.add((lv.kernel_major, lv.kernel_minor))
    assert len(devices) == 10
    assert_mounted(dhv, src, "ext4")

    rows = [("csi-local-dhv create (process)", plugin_times),
            ("bare lvcreate --snapshot", bare_times)]
    lines = [f"10 clones of a {src_lv.size // MIB} MiB ext4 volume "
             f"(wall seconds per clone):",
             f"  {'':34} {'mean':>8} {'median':>8} {'min':>8} {'max':>8}"]
    for label, times in rows:
        lines.append(f"  {label:34} {statistics.mean(times):8.2f} "
                     f"{statistics.median(times):8.2f} {min(times):8.2f} {max(times):8.2f}")
    lines.append(f"  {'ratio plugin/bare':34} "
                 f"{statistics.mean(plugin_times) / statistics.mean(bare_times):8.1f} "
                 f"{statistics.median(plugin_times) / statistics.median(bare_times):8.1f}")
    print("\n".join(lines))
