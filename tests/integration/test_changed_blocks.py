"""Changed-block tracking (CSI SnapshotMetadata) against a real thin pool: the
ranges are exactly the chunks a known pattern of writes and discards
touched, paging and resuming give the same ranges, a backup made by copying
only the delta onto a restore of the base equals the target byte for byte,
a metadata snapshot the plugin left held when killed is released at start-up,
and one another program holds is left alone."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks.lab import copy_ranges
from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.storage.thin_mappings import MARK_PREFIX
from tests.integration.conftest import (
    SCRATCH,
    LoopVG,
    PluginProcess,
    block_cap,
    expect_code,
    make_vg,
    run,
    unmount_under,
)
from tests.integration.test_node import publish, stage, unpublish, unstage

pytestmark = pytest.mark.integration
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLKDISCARD = 0x1277
SIZE = 2 * GiB  # sparse: most of it is never written
Code = grpc.StatusCode

# (offset, length): odd offsets, chunk-crossing writes, and writes past the first GiB.
PATTERN_1 = [(0, 4 * KiB), (MiB + 4097, 100 * KiB), (3 * MiB, 256 * KiB),
             (GiB + 12345, 5000), (SIZE - 1000, 1000)]
PATTERN_2 = [(8 * KiB, 4 * KiB), (512 * MiB + 1, 1), (5 * MiB - 1, 2),
             (GiB + 256 * MiB, 64 * KiB)]
DISCARD = (3 * MiB, 128 * KiB)  # whole chunks of pattern 1 (64 KiB chunks): unmapped


def chunk_size(vg: LoopVG) -> int:
    out = run("lvs", "--noheadings", "--units", "b", "--nosuffix", "-o", "chunk_size",
              f"{vg.name}/{vg.pool}").stdout
    return int(out.strip())


def chunks(ranges: list[tuple[int, int]], size: int) -> set[int]:
    """The chunks `ranges` touch."""
    return {c for off, n in ranges for c in range(off // size, (off + n - 1) // size + 1)}


def covered(extents: list[tuple[int, int]], size: int) -> set[int]:
    """The chunks a list of extents covers, each extent whole chunks."""
    out = set()
    for off, n in extents:
        assert off % size == 0 and (n % size == 0 or off + n == SIZE), (off, n)
        out |= set(range(off // size, -(-(off + n) // size)))
    return out


def whole_chunks(off: int, n: int, size: int) -> set[int]:
    return set(range(-(-off // size), (off + n) // size))


def sm(p: PluginProcess) -> csi_pb2_grpc.SnapshotMetadataStub:
    assert p.channel is not None
    return csi_pb2_grpc.SnapshotMetadataStub(p.channel)


def allocated(p: PluginProcess, snap: str, offset: int = 0, max_results: int = 0) -> list[Any]:
    return list(sm(p).GetMetadataAllocated(pb.GetMetadataAllocatedRequest(
        snapshot_id=snap, starting_offset=offset, max_results=max_results), timeout=300))


def delta(p: PluginProcess, base: str, target: str, offset: int = 0,
          max_results: int = 0) -> list[Any]:
    return list(sm(p).GetMetadataDelta(pb.GetMetadataDeltaRequest(
        base_snapshot_id=base, target_snapshot_id=target, starting_offset=offset,
        max_results=max_results), timeout=300))


def extents(replies: list[Any]) -> list[tuple[int, int]]:
    return [(b.byte_offset, b.size_bytes) for r in replies for b in r.block_metadata]


def write(dev: str, offset: int, length: int, seed: int) -> None:
    fd = os.open(dev, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes((seed + i) % 251 + 1 for i in range(length)), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(dev: str, offset: int, length: int) -> None:
    fd = os.open(dev, os.O_WRONLY)
    try:
        fcntl.ioctl(fd, BLKDISCARD, struct.pack("QQ", offset, length))
    finally:
        os.close(fd)


def block_volume(p: PluginProcess, name: str, *, source: str = "") -> tuple[str, str, str]:
    """(volume ID, staging path, the published device), a block volume."""
    src = pb.VolumeContentSource()
    if source:
        src.snapshot.snapshot_id = source
    vid = p.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=SIZE),
        volume_capabilities=[block_cap()],
        volume_content_source=src if source else None)).volume.volume_id
    staging, target = p.path(f"s-{name}"), p.path(f"t-{name}")
    stage(p, vid, staging, block_cap())
    publish(p, vid, staging, target, block_cap())
    return vid, staging, target


def snapshot(p: PluginProcess, name: str, vid: str) -> str:
    time.sleep(1.1)  # LVM's creation times are in seconds: base strictly older
    return str(p.controller.CreateSnapshot(pb.CreateSnapshotRequest(
        name=name, source_volume_id=vid)).snapshot.snapshot_id)


def held(vg: LoopVG) -> bool:
    for name in (f"{vg.name}-{vg.pool}-tpool", f"{vg.name}-{vg.pool}"):
        proc = run("dmsetup", "status", name, check=False)
        fields = proc.stdout.split()
        if proc.returncode == 0 and len(fields) > 6 and fields[2] == "thin-pool":
            return fields[6] != "-"
    raise AssertionError("no thin-pool target found")


@pytest.fixture
def own_vg() -> Iterator[LoopVG]:
    """A VG of these tests' own, destroyed after each: its loop file lives in the
    VM's memory, and a thin pool gives freed chunks back to it only when
    discarded, so data written here must not stay in the session VG's file."""
    vg = make_vg(size=2 * GiB)
    try:
        yield vg
    finally:
        unmount_under(SCRATCH)
        vg.destroy()


@pytest.fixture
def sparse_plugin(own_vg: LoopVG, plugin_factory: Any) -> PluginProcess:
    """A plugin on its own VG that may over-provision: volumes of 2 GiB, barely
    written, on a pool of 1.6 GiB. (own_vg first: set up before the factory,
    so torn down after its plugins stopped.)"""
    p: PluginProcess = plugin_factory("--overprovision-ratio", "20", target_vg=own_vg)
    return p


def test_ranges_are_exactly_what_was_written_and_a_delta_backup_equals_the_target(
        sparse_plugin: PluginProcess, own_vg: LoopVG) -> None:
    plugin, vg = sparse_plugin, own_vg
    size = chunk_size(vg)
    vid, staging, dev = block_volume(plugin, "cbt")
    for i, (off, n) in enumerate(PATTERN_1):
        write(dev, off, n, i)
    s1 = snapshot(plugin, "cbt-1", vid)
    for i, (off, n) in enumerate(PATTERN_2):
        write(dev, off, n, 100 + i)
    discard(dev, *DISCARD)
    s2 = snapshot(plugin, "cbt-2", vid)

    replies = allocated(plugin, s1)
    assert {r.volume_capacity_bytes for r in replies} == {SIZE}
    assert {r.block_metadata_type for r in replies} == {pb.VARIABLE_LENGTH}
    assert covered(extents(replies), size) == chunks(PATTERN_1, size)
    expected_s2 = (chunks(PATTERN_1, size) - whole_chunks(*DISCARD, size)) | chunks(
        PATTERN_2, size)
    assert covered(extents(allocated(plugin, s2)), size) == expected_s2

    whole = extents(delta(plugin, s1, s2))
    # Overwritten, new, and discarded (mapped in the base, unmapped since).
    assert covered(whole, size) == chunks(PATTERN_2, size) | (
        whole_chunks(*DISCARD, size) & chunks(PATTERN_1, size))
    assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(whole)), whole

    # Paging and resuming give the same ranges as one call.
    paged = delta(plugin, s1, s2, max_results=1)
    assert all(len(r.block_metadata) <= 1 for r in paged) and extents(paged) == whole
    for off, n in whole:
        tail = extents(delta(plugin, s1, s2, offset=off + n))
        assert tail == [e for e in whole if e[0] >= off + n]
    mid = whole[1][0] + 7
    assert extents(delta(plugin, s1, s2, offset=mid))[0] == (mid, whole[1][1] - 7)
    assert extents(delta(plugin, s1, s2, offset=SIZE)) == []
    expect_code(Code.OUT_OF_RANGE, delta, plugin, s1, s2, offset=SIZE + 1)
    expect_code(Code.INVALID_ARGUMENT, delta, plugin, s2, s1)  # target older than base
    expect_code(Code.NOT_FOUND, allocated, plugin, "csi-s-" + "0" * 32)

    # A backup: a restore of the base, plus only the delta's ranges of the target.
    base_vid, base_staging, base_dev = block_volume(plugin, "cbt-base", source=s1)
    tgt_vid, tgt_staging, tgt_dev = block_volume(plugin, "cbt-target", source=s2)
    assert run("cmp", base_dev, tgt_dev, check=False).returncode == 1  # the check can fail
    copy_ranges(tgt_dev, base_dev, whole)
    assert run("cmp", base_dev, tgt_dev, check=False).returncode == 0, "backup != target"
    assert not held(vg)
    for v, st, t in ((vid, staging, dev), (base_vid, base_staging, base_dev),
                     (tgt_vid, tgt_staging, tgt_dev)):
        unpublish(plugin, v, t)
        unstage(plugin, v, st)


def test_delta_of_two_volumes_is_refused_and_a_held_metadata_snapshot_is_handled(
        sparse_plugin: PluginProcess, own_vg: LoopVG) -> None:
    plugin, vg = sparse_plugin, own_vg
    vid, staging, dev = block_volume(plugin, "a")
    write(dev, 0, 1, 1)
    a1 = snapshot(plugin, "a1", vid)
    other, ostaging, odev = block_volume(plugin, "b")
    b1 = snapshot(plugin, "b1", other)
    expect_code(Code.INVALID_ARGUMENT, delta, plugin, a1, b1)

    # Another program holds the pool's metadata snapshot: UNAVAILABLE, left held,
    # also by the plugin's next start (their thin_dump would read garbage).
    tpool = f"{vg.name}-{vg.pool}-tpool"
    run("dmsetup", "message", tpool, "0", "reserve_metadata_snap")
    try:
        err = expect_code(Code.UNAVAILABLE, allocated, plugin, a1)
        assert "held by another program" in (err.details() or "")
        plugin.restart()
        assert held(vg), "another program's metadata snapshot was released"
        assert f"thin pool {vg.name}/{vg.pool}: a metadata snapshot is held by another " \
            "program" in plugin.log()
        assert not list(plugin.state_dir.glob(f"{MARK_PREFIX}*"))
        doctor = run(sys.executable, "-m", "csi_local", "doctor", "--volume-group", vg.name,
                     "--thin-pool", vg.pool, "--state-dir", str(plugin.state_dir),
                     check=False).stdout
        line = next(x for x in doctor.splitlines() if "thin pool metadata snapshot" in x)
        assert line.startswith("warn") and "held by another program" in line, doctor
    finally:
        run("dmsetup", "message", tpool, "0", "release_metadata_snap")
    assert extents(allocated(plugin, a1)) == [(0, chunk_size(vg))]
    for v, st, t in ((vid, staging, dev), (other, ostaging, odev)):
        unpublish(plugin, v, t)
        unstage(plugin, v, st)


def test_a_reservation_of_a_killed_reader_is_released_at_start_up(
        sparse_plugin: PluginProcess, own_vg: LoopVG,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin killed (SIGKILL) while its thin_dump reads: the next start
    releases the metadata snapshot its mark names, and drops the mark."""
    plugin, vg = sparse_plugin, own_vg
    vid, staging, dev = block_volume(plugin, "k")
    write(dev, 0, 1, 1)
    s1 = snapshot(plugin, "k1", vid)
    # A thin_dump that says it started, then hangs: the plugin is killed meanwhile.
    tools = Path("/run/csi-local-slow-tools")
    started = tools / "started"
    started.unlink(missing_ok=True)
    thin_dump_in(tools, f"echo $$ > {started}.tmp\nmv {started}.tmp {started}\n"
                 "exec sleep 120\n", monkeypatch)
    plugin.restart()
    reply = sm(plugin).GetMetadataAllocated(
        pb.GetMetadataAllocatedRequest(snapshot_id=s1), timeout=300)
    reader = threading.Thread(target=lambda: list(_ignore_rpc_error(reply)))
    reader.start()
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline, plugin.log()
        time.sleep(0.1)
    assert held(vg)
    marks = list(plugin.state_dir.glob(f"{MARK_PREFIX}*"))
    assert [json.loads(m.read_text())["phase"] for m in marks] == ["held"]
    plugin.kill()
    reader.join(timeout=60)
    assert held(vg), "the kernel keeps the reservation of a killed reader"
    monkeypatch.undo()  # the real thin_dump again
    with contextlib.suppress(ProcessLookupError):  # the hung wrapper: not needed
        os.kill(int(started.read_text()), signal.SIGKILL)
    plugin.start()
    assert not held(vg)
    assert "released the metadata snapshot of thin pool" in plugin.log()
    assert not list(plugin.state_dir.glob(f"{MARK_PREFIX}*"))
    assert extents(allocated(plugin, s1)) == [(0, chunk_size(vg))]
    unpublish(plugin, vid, dev)
    unstage(plugin, vid, staging)


def test_a_tool_that_fails_halfway_is_an_error_with_its_stderr(
        sparse_plugin: PluginProcess, own_vg: LoopVG,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real thin_dump's output cut off, then an exit 1 with a message: the
    RPC fails with that message (not the truncated XML's), the metadata
    snapshot is released, no tool is left running, and the next read with
    the real tool gives the ranges."""
    plugin, vg = sparse_plugin, own_vg
    vid, staging, dev = block_volume(plugin, "h")
    write(dev, 0, 1, 1)
    s1 = snapshot(plugin, "h1", vid)
    real = shutil.which("thin_dump")
    assert real is not None
    wrapper = thin_dump_in(Path("/run/csi-local-broken-tools"), f'{real} "$@" | head -c 150\n'
                           "echo 'thin_dump: metadata broke off' >&2\nexit 1\n", monkeypatch)
    plugin.restart()
    err = expect_code(Code.INTERNAL, allocated, plugin, s1)
    assert "metadata broke off" in (err.details() or ""), err.details()
    assert not held(vg)
    assert run("pgrep", "-f", str(wrapper), check=False).returncode == 1  # none left
    monkeypatch.undo()
    plugin.restart()
    assert extents(allocated(plugin, s1)) == [(0, chunk_size(vg))]
    unpublish(plugin, vid, dev)
    unstage(plugin, vid, staging)


def thin_dump_in(tools: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `thin_dump` shell script in `tools`, first on the PATH a plugin
    started from now on searches."""
    tools.mkdir(exist_ok=True)
    wrapper = tools / "thin_dump"
    wrapper.write_text(f"#!/bin/sh\n{script}")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ.get('PATH', '')}")
    return wrapper


def _ignore_rpc_error(stream: Any) -> Iterator[Any]:
    try:
        yield from stream
    except grpc.RpcError:
        return


@pytest.mark.report
def test_delta_with_a_tenth_changed_against_reading_the_whole_volume(
        sparse_plugin: PluginProcess, own_vg: LoopVG) -> None:
    """Figures for the closing note: GetMetadataDelta of a fully written volume
    with 10 % changed, against reading the whole volume with dd (what a full
    backup must read); the metadata snapshot's cost. 64 MiB by default, so that
    CI only proves the figures are produced: the VM's pool lives in its memory
    and every MiB written costs time under emulation. For figures worth quoting,
    CSI_LOCAL_CBT_BENCH_MIB=512 alone, or 1024 with CSI_LOCAL_VM_MEMORY=4G."""
    plugin, vg = sparse_plugin, own_vg
    size = int(os.environ.get("CSI_LOCAL_CBT_BENCH_MIB", "64")) * MiB
    vid = plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="bench", capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[block_cap()])).volume.volume_id
    staging, dev = plugin.path("s-bench"), plugin.path("t-bench")
    stage(plugin, vid, staging, block_cap())
    publish(plugin, vid, staging, dev, block_cap())
    t0 = time.monotonic()
    run("dd", "if=/dev/zero", f"of={dev}", "bs=4M", f"count={size // (4 * MiB)}",
        "oflag=direct", "conv=notrunc")
    t_fill = time.monotonic() - t0
    s1 = snapshot(plugin, "bench-1", vid)
    changed = [(i * 10 * MiB, MiB) for i in range(size // (10 * MiB))]  # ~10 %, spread
    for i, (off, n) in enumerate(changed):
        write(dev, off, n, i)
    s2 = snapshot(plugin, "bench-2", vid)

    t0 = time.monotonic()
    ranges = extents(delta(plugin, s1, s2))
    t_delta = time.monotonic() - t0
    t0 = time.monotonic()
    extents(allocated(plugin, s2))
    t_alloc = time.monotonic() - t0
    t0 = time.monotonic()
    run("dd", f"if={dev}", "of=/dev/null", "bs=4M", "iflag=direct")
    t_dd = time.monotonic() - t0
    t0 = time.monotonic()
    src = os.open(dev, os.O_RDONLY)
    try:
        copied = sum(len(os.pread(src, n, off)) for off, n in ranges)
    finally:
        os.close(src)
    t_read = time.monotonic() - t0
    tpool = f"{vg.name}-{vg.pool}-tpool"
    meta = ["lvs", "--noheadings", "-o", "metadata_percent", f"{vg.name}/{vg.pool}"]
    t0 = time.monotonic()
    run("dmsetup", "message", tpool, "0", "reserve_metadata_snap")
    t_reserve = time.monotonic() - t0
    try:
        meta_before = run(*meta).stdout.strip()
        t0 = time.monotonic()  # a busy pool: allocating writes while it is held
        write(dev, size - 8 * MiB, 4 * MiB, 7)
        t_busy = time.monotonic() - t0
        meta_held = run(*meta).stdout.strip()
    finally:
        t0 = time.monotonic()
        run("dmsetup", "message", tpool, "0", "release_metadata_snap")
        t_release = time.monotonic() - t0
    t0 = time.monotonic()
    write(dev, size - 4 * MiB, 4 * MiB, 8)
    t_free = time.monotonic() - t0
    assert sum(n for _, n in ranges) == copied >= len(changed) * MiB
    print(f"\nchanged-block tracking, {size // MiB} MiB volume fully written in "
          f"{t_fill:.1f} s, {len(changed)} MiB changed ({100 * copied / size:.1f} % reported, "
          f"{len(ranges)} ranges):\n"
          f"  GetMetadataDelta         {t_delta * 1000:8.0f} ms\n"
          f"  GetMetadataAllocated     {t_alloc * 1000:8.0f} ms\n"
          f"  read the delta's ranges  {t_read * 1000:8.0f} ms\n"
          f"  dd the whole volume      {t_dd * 1000:8.0f} ms  (delta + reading its ranges = "
          f"{(t_delta + t_read) / t_dd:.2f}x of it)\n"
          f"  metadata snapshot: reserve {t_reserve * 1000:.0f} ms, release "
          f"{t_release * 1000:.0f} ms; metadata {meta_before}% -> {meta_held}% after 4 MiB "
          f"of new writes while held; those writes {t_busy * 1000:.0f} ms held vs "
          f"{t_free * 1000:.0f} ms released")
    unpublish(plugin, vid, dev)
    unstage(plugin, vid, staging)
