"""SnapshotMetadata service: GetMetadataAllocated and GetMetadataDelta, checked against data the
suite writes itself.

One BLOCK volume is set up for the whole module (whatever --access-type says: changed-block
tracking is about block volumes, and only raw block access tells the suite exactly which bytes
it wrote). Pattern 1 is written at known offsets, some odd, one reaching the last byte of the
volume, with large holes between them; snapshot 1 is taken. Pattern 2 overwrites part of
pattern 1 and writes new regions, one granule is discarded (BLKDISCARD), and snapshot 2 is
taken. Every write is fsync'ed before its snapshot, and nothing else writes to the volume.

Exactness is checked as sets of covered bytes, since a plugin may split and merge its ranges
as it likes: everything that must be reported is covered, and nothing is reported farther
than G (--cbt-granularity) from a byte that was written (Allocated) or changed (Delta).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from sanity import csi_pb2
from sanity.csi import (
    Capabilities,
    Config,
    Stubs,
    Tracker,
    device_size,
    expect_code,
    volume_capability,
    wait_ready,
)
from sanity.extents import (
    Extent,
    clip,
    describe,
    dilate,
    intersect,
    normalize,
    subtract,
    union,
)

BLKDISCARD = 0x1277  # _IO(0x12, 119) from linux/fs.h
# The layout below places regions up to granule 14 and at the very end of the volume, so
# that every region the plugin must not report is more than G away from every change.
MIN_GRANULES = 16
WRITE_CHUNK = 1 << 20
UNKNOWN_SNAPSHOT = "sanity-unknown-snapshot-0000"
KINDS = ["allocated", "delta"]

# Pattern 1 bytes are 0x01..0x7f and pattern 2 bytes 0x80..0xff: never zero (a plugin may
# treat zeroed blocks as unallocated), and every byte pattern 2 overwrites really changes
# (a plugin may compare contents rather than track writes).
PATTERN1 = bytes((i % 127) + 1 for i in range(256))
PATTERN2 = bytes((i % 128) + 128 for i in range(256))


def layout(capacity: int, g: int) -> tuple[list[Extent], list[Extent], Extent]:
    """Where pattern 1 and pattern 2 go and which granule is discarded, for granularity g."""
    pattern1 = [
        # Near the start, odd offset; never changes. Being within G of offset 0, it also
        # covers a plugin that labels or zeroes the first blocks of a new volume.
        (1, 3001),
        (3 * g + 511, 5 * g + 1512),   # spans granules, odd ends; its middle is overwritten
        (7 * g + 3, 7 * g + 780),      # small, odd; never changes
        (9 * g, 10 * g),               # one whole granule, discarded after snapshot 1
        (capacity - 3001, capacity),   # up to the last byte of the volume
    ]
    pattern2 = [
        (4 * g + 1025, 4 * g + 2525),  # overwrites the middle of the second region
        (13 * g - 2047, 13 * g + 3001),  # new data across a granule boundary
        (capacity - 1001, capacity - 500),  # overwrites part of the last region
    ]
    return pattern1, pattern2, (9 * g, 10 * g)


# ---------------------------------------------------------------- streams


@dataclass
class Stream:
    """Everything one GetMetadataAllocated/GetMetadataDelta stream returned."""

    messages: list[list[Extent]] = field(default_factory=list)
    types: list[csi_pb2.BlockMetadataType.ValueType] = field(default_factory=list)
    capacities: list[int] = field(default_factory=list)

    @property
    def tuples(self) -> list[Extent]:
        return [e for m in self.messages for e in m]

    @property
    def covered(self) -> list[Extent]:
        return normalize(self.tuples)


def read_stream(responses: Iterable[Any]) -> Stream:
    """Consume a stream to its end (an error anywhere in it raises grpc.RpcError)."""
    s = Stream()
    for resp in responses:
        s.types.append(resp.block_metadata_type)
        s.capacities.append(resp.volume_capacity_bytes)
        s.messages.append([(b.byte_offset, b.byte_offset + b.size_bytes)
                           for b in resp.block_metadata])
    return s


def check_stream(s: Stream, what: str, capacity: int, start: int = 0,
                 max_results: int = 0) -> Stream:
    """The rules every stream follows, whatever it reports."""
    if s.types:
        kinds = {csi_pb2.BlockMetadataType.Name(t) for t in s.types}
        assert len(kinds) == 1, f"{what}: block_metadata_type changes within the stream: {kinds}"
        assert s.types[0] in (csi_pb2.FIXED_LENGTH, csi_pb2.VARIABLE_LENGTH), (
            f"{what}: block_metadata_type is {kinds.pop()}")
        assert set(s.capacities) == {capacity}, (
            f"{what}: volume_capacity_bytes {sorted(set(s.capacities))}, the volume has "
            f"{capacity} bytes")
    if max_results:
        sizes = [len(m) for m in s.messages]
        assert max(sizes, default=0) <= max_results, (
            f"{what}: messages of {max(sizes)} tuples with max_results={max_results}")
    prev_end = -1
    for start_b, end_b in s.tuples:
        assert end_b > start_b, f"{what}: size_bytes {end_b - start_b} at {start_b} (MUST be > 0)"
        assert start_b >= 0 and end_b <= capacity, (
            f"{what}: range [{start_b}, {end_b}) is outside the volume [0, {capacity})")
        assert start_b >= prev_end, (
            f"{what}: range [{start_b}, {end_b}) overlaps or precedes the previous one, "
            f"which ended at {prev_end}")
        prev_end = end_b
    if s.types and s.types[0] == csi_pb2.FIXED_LENGTH:
        sizes_b = {e - b for b, e in s.tuples}
        assert len(sizes_b) <= 1, f"{what}: FIXED_LENGTH ranges of different sizes {sizes_b}"
    if s.tuples and start:
        first = s.tuples[0]
        assert start < first[1], (
            f"{what}: the first range [{first[0]}, {first[1]}) ends at or before "
            f"starting_offset={start} (the spec requires S < B0.byte_offset + B0.size_bytes)")
    return s


# ---------------------------------------------------------------- the module's volume


@dataclass
class Scenario:
    stubs: Stubs
    capacity: int
    granularity: int
    snap1: csi_pb2.Snapshot
    snap2: csi_pb2.Snapshot
    pattern1: list[Extent]
    pattern2: list[Extent]
    discarded: list[Extent]  # what the suite discarded (empty if the device refused)
    zeroed: list[Extent]  # the discarded range, if it reads back as zeros afterwards
    delta_refused: str | None = None  # None: not asked yet; "": served; else why not

    def allocated(self, snap: csi_pb2.Snapshot, start: int = 0,
                  max_results: int = 0) -> Stream:
        what = f"GetMetadataAllocated({snap.snapshot_id}, starting_offset={start}, " \
               f"max_results={max_results})"
        resp = self.stubs.snapshot_metadata.GetMetadataAllocated(
            csi_pb2.GetMetadataAllocatedRequest(
                snapshot_id=snap.snapshot_id, starting_offset=start, max_results=max_results))
        return check_stream(read_stream(resp), what, self.capacity, start, max_results)

    def delta(self, start: int = 0, max_results: int = 0) -> Stream:
        self.require_delta()
        what = f"GetMetadataDelta(starting_offset={start}, max_results={max_results})"
        resp = self.stubs.snapshot_metadata.GetMetadataDelta(
            csi_pb2.GetMetadataDeltaRequest(
                base_snapshot_id=self.snap1.snapshot_id,
                target_snapshot_id=self.snap2.snapshot_id,
                starting_offset=start, max_results=max_results))
        return check_stream(read_stream(resp), what, self.capacity, start, max_results)

    def require_delta(self) -> None:
        """Skip when the plugin says changed block tracking is not enabled: the spec's
        FAILED_PRECONDITION, after which a CO falls back to a full backup."""
        if self.delta_refused is None:
            self.delta_refused = ""
            try:
                list(self.stubs.snapshot_metadata.GetMetadataDelta(
                    csi_pb2.GetMetadataDeltaRequest(
                        base_snapshot_id=self.snap1.snapshot_id,
                        target_snapshot_id=self.snap2.snapshot_id, max_results=1)))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.delta_refused = err.details() or "(no details)"
        if self.delta_refused:
            pytest.skip("GetMetadataDelta gives FAILED_PRECONDITION (changed block tracking "
                        f"not enabled): {self.delta_refused}")

    def query(self, kind: str, start: int = 0, max_results: int = 0) -> Stream:
        if kind == "allocated":
            return self.allocated(self.snap1, start, max_results)
        return self.delta(start, max_results)

    def near(self, extents: Iterable[Extent]) -> list[Extent]:
        """Every byte within G of ``extents``: what a plugin may round them up to."""
        return dilate(extents, self.granularity, 0, self.capacity)


def _fill(fd: int, extent: Extent, table: bytes) -> None:
    pos, end = extent
    while pos < end:
        data = os.urandom(min(WRITE_CHUNK, end - pos)).translate(table)
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, pos)
            pos += n
            view = view[n:]


def _reads_zero(fd: int, extent: Extent) -> bool:
    pos, end = extent
    while pos < end:
        data = os.pread(fd, min(WRITE_CHUNK, end - pos), pos)
        if not data or data.count(0) != len(data):
            return False
        pos += len(data)
    return True


def _discard(fd: int, extent: Extent) -> bool:
    """BLKDISCARD the range; False if the device does not support discard at all."""
    try:
        fcntl.ioctl(fd, BLKDISCARD, struct.pack("QQ", extent[0], extent[1] - extent[0]))
    except OSError as err:
        if err.errno == errno.EOPNOTSUPP:
            return False
        raise
    return True


def create_block_volume(tracker: Tracker, required: int = 0) -> csi_pb2.Volume:
    """A BLOCK volume, or a skip naming the refusal if the plugin does not do block."""
    try:
        return tracker.create_volume(required=required or tracker.cfg.volume_size,
                                     caps=[volume_capability("block")])
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
            pytest.skip(f"plugin refuses BLOCK access volumes, which changed block tracking "
                        f"is tested on: {err.details()}")
        raise


def build_scenario(t: Tracker, stubs: Stubs, caps: Capabilities, cfg: Config) -> Scenario:
    g = cfg.cbt_granularity
    vol = create_block_volume(t, max(cfg.volume_size, MIN_GRANULES * g))
    block = volume_capability("block")
    staging, target = t.make_available(vol.volume_id, cap=block)
    capacity = device_size(target)
    assert capacity >= MIN_GRANULES * g, (
        f"the published volume has {capacity} bytes, CreateVolume asked for at least "
        f"{MIN_GRANULES * g}")
    pattern1, pattern2, discard = layout(capacity, g)

    fd = os.open(target, os.O_RDWR)
    try:
        for e in pattern1:
            _fill(fd, e, PATTERN1)
        os.fsync(fd)
    finally:
        os.close(fd)
    snap1 = wait_ready(stubs, caps, t.create_snapshot(vol.volume_id))

    fd = os.open(target, os.O_RDWR)
    try:
        for e in pattern2:
            _fill(fd, e, PATTERN2)
        discarded = [discard] if _discard(fd, discard) else []
        os.fsync(fd)
        # A discard is only a hint: whether it changed anything is what the device reads
        # back. If the granule still holds pattern 1, reporting it as changed is optional.
        zeroed = [discard] if discarded and _reads_zero(fd, discard) else []
    finally:
        os.close(fd)
    snap2 = wait_ready(stubs, caps, t.create_snapshot(vol.volume_id))
    t.release(vol.volume_id, staging, target)
    return Scenario(stubs, capacity, g, snap1, snap2, normalize(pattern1), normalize(pattern2),
                    discarded, zeroed)


@pytest.fixture(scope="module")
def scenario(cfg: Config, stubs: Stubs, caps: Capabilities, node_id: str) -> Iterator[Scenario]:
    """One volume and two snapshots for the whole module: the tests only read metadata."""
    caps.require_plugin("SNAPSHOT_METADATA_SERVICE")
    caps.require_controller("CREATE_DELETE_VOLUME", "CREATE_DELETE_SNAPSHOT")
    t = Tracker(cfg, stubs, caps, node_id)
    try:
        yield build_scenario(t, stubs, caps, cfg)
    finally:
        errors = t.cleanup()
        if errors:
            pytest.fail("teardown failed:\n  " + "\n  ".join(errors), pytrace=False)


def _g(sc: Scenario) -> str:
    return f"--cbt-granularity {sc.granularity}"


# ---------------------------------------------------------------- exactness


def check_exact(sc: Scenario, what: str, covered: list[Extent], required: list[Extent],
                anchors: list[Extent], left_out: str, anchor: str) -> None:
    """``covered`` holds all of ``required`` and nothing more than G away from ``anchors``.
    Both kinds of mistake are reported together: each hints at what the plugin does wrong."""
    problems = []
    missing = subtract(required, covered)
    if missing:
        problems.append(f"leaves out {left_out}: {describe(missing)}")
    extra = subtract(covered, sc.near(anchors))
    if extra:
        # Only possible in a delta: the plugin reports old data as if it had changed.
        stale = intersect(extra, sc.pattern1)
        problems.append(
            f"reports bytes more than {sc.granularity} bytes away from any {anchor}: "
            f"{describe(extra)}"
            + (f"; of these, {describe(stale)} hold data written before snapshot 1 and "
               "never touched since" if stale else "")
            + f" (a plugin with bigger blocks needs a larger {_g(sc)})")
    assert not problems, f"{what} " + "; and it ".join(problems)


def test_allocated_exact(scenario: Scenario) -> None:
    sc = scenario
    s = sc.allocated(sc.snap1)
    if sc.snap1.size_bytes:
        assert set(s.capacities) <= {sc.snap1.size_bytes}, (
            f"volume_capacity_bytes {sorted(set(s.capacities))} differs from the snapshot's "
            f"size_bytes {sc.snap1.size_bytes}")
    # The volume was new and only the suite wrote to it, so pattern 1 is all there is.
    check_exact(sc, "GetMetadataAllocated(snapshot 1)", s.covered, sc.pattern1,
                sc.pattern1, "bytes the suite wrote", "byte the suite wrote")


def test_allocated_second_snapshot(scenario: Scenario) -> None:
    sc = scenario
    s = sc.allocated(sc.snap2)
    written = union(sc.pattern1, sc.pattern2)
    # The discarded granule may or may not still count as allocated.
    check_exact(sc, "GetMetadataAllocated(snapshot 2)", s.covered,
                subtract(written, sc.zeroed), written, "bytes the suite wrote",
                "byte the suite wrote")


def test_delta_exact(scenario: Scenario) -> None:
    sc = scenario
    s = sc.delta()
    check_exact(sc, "GetMetadataDelta(snapshot 1, snapshot 2)", s.covered,
                union(sc.pattern2, sc.zeroed), union(sc.pattern2, sc.discarded),
                "bytes written or discarded between the snapshots",
                "byte written or discarded between the snapshots")


# ---------------------------------------------------------------- paging and resuming


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_max_results_one(scenario: Scenario, kind: str) -> None:
    whole = scenario.query(kind)
    paged = scenario.query(kind, max_results=1)  # checks every message has at most 1 tuple
    assert paged.covered == whole.covered, (
        f"{kind} with max_results=1 covers {describe(paged.covered)}; "
        f"without it {describe(whole.covered)}")


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_resume(scenario: Scenario, kind: str) -> None:
    """Resuming at starting_offset S gives what remains at and after S."""
    whole = scenario.query(kind)
    tuples = whole.tuples
    assert tuples, f"{kind} reported nothing to resume from"
    picks = sorted({0, len(tuples) // 2, max(0, len(tuples) - 2)})
    offsets = [tuples[k][1] for k in picks]
    mid = tuples[len(tuples) // 2]
    offsets.append(mid[0] + (mid[1] - mid[0]) // 2 + 1)  # odd, inside a range (if > 1 byte)
    for start in sorted(set(offsets)):
        if start >= scenario.capacity:
            continue
        rest = scenario.query(kind, start=start)
        got = clip(rest.covered, start, scenario.capacity)
        want = clip(whole.covered, start, scenario.capacity)
        assert got == want, (
            f"{kind} resumed at starting_offset={start} covers {describe(got)} from there on; "
            f"the whole stream covers {describe(want)} from there on")


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_offset_at_capacity(scenario: Scenario, kind: str) -> None:
    rest = scenario.query(kind, start=scenario.capacity)
    assert not rest.tuples, (
        f"{kind} with starting_offset = the volume's capacity returned {describe(rest.tuples)}")


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class ErrCase:
    id: str
    code: grpc.StatusCode
    build: Callable[[Scenario], Any]


BEYOND = -2  # stands for capacity + 1, which is only known once the volume exists


def _offset(sc: Scenario, start: int) -> int:
    return sc.capacity + 1 if start == BEYOND else start


def _alloc(snapshot_id: str | None = None, start: int = 0,
           max_results: int = 0) -> Callable[[Scenario], Any]:
    def build(sc: Scenario) -> Any:
        return csi_pb2.GetMetadataAllocatedRequest(
            snapshot_id=sc.snap1.snapshot_id if snapshot_id is None else snapshot_id,
            starting_offset=_offset(sc, start), max_results=max_results)
    return build


def _delta(base: str | None = None, target: str | None = None, start: int = 0,
           max_results: int = 0) -> Callable[[Scenario], Any]:
    def build(sc: Scenario) -> Any:
        return csi_pb2.GetMetadataDeltaRequest(
            base_snapshot_id=sc.snap1.snapshot_id if base is None else base,
            target_snapshot_id=sc.snap2.snapshot_id if target is None else target,
            starting_offset=_offset(sc, start), max_results=max_results)
    return build


Code = grpc.StatusCode
ERRORS = [
    ErrCase("Allocated-empty-snapshot_id", Code.INVALID_ARGUMENT, _alloc(snapshot_id="")),
    ErrCase("Allocated-unknown-snapshot", Code.NOT_FOUND, _alloc(snapshot_id=UNKNOWN_SNAPSHOT)),
    ErrCase("Allocated-negative-offset", Code.OUT_OF_RANGE, _alloc(start=-1)),
    ErrCase("Allocated-offset-beyond-capacity", Code.OUT_OF_RANGE, _alloc(start=BEYOND)),
    ErrCase("Allocated-negative-max_results", Code.INVALID_ARGUMENT, _alloc(max_results=-1)),
    ErrCase("Delta-empty-base", Code.INVALID_ARGUMENT, _delta(base="")),
    ErrCase("Delta-empty-target", Code.INVALID_ARGUMENT, _delta(target="")),
    ErrCase("Delta-unknown-base", Code.NOT_FOUND, _delta(base=UNKNOWN_SNAPSHOT)),
    ErrCase("Delta-unknown-target", Code.NOT_FOUND, _delta(target=UNKNOWN_SNAPSHOT)),
    ErrCase("Delta-negative-offset", Code.OUT_OF_RANGE, _delta(start=-1)),
    ErrCase("Delta-offset-beyond-capacity", Code.OUT_OF_RANGE, _delta(start=BEYOND)),
    ErrCase("Delta-negative-max_results", Code.INVALID_ARGUMENT, _delta(max_results=-1)),
    # The target is a snapshot "created after the base snapshot".
    ErrCase("Delta-target-older-than-base", Code.INVALID_ARGUMENT,
            lambda sc: csi_pb2.GetMetadataDeltaRequest(
                base_snapshot_id=sc.snap2.snapshot_id, target_snapshot_id=sc.snap1.snapshot_id)),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c.id for c in ERRORS])
def test_metadata_errors(scenario: Scenario, case: ErrCase) -> None:
    req = case.build(scenario)
    if isinstance(req, csi_pb2.GetMetadataDeltaRequest):
        scenario.require_delta()
        rpc = scenario.stubs.snapshot_metadata.GetMetadataDelta
    else:
        rpc = scenario.stubs.snapshot_metadata.GetMetadataAllocated
    expect_code(case.code, lambda: list(rpc(req)))


def test_delta_snapshots_of_different_volumes(scenario: Scenario, tracker: Tracker,
                                              stubs: Stubs, caps: Capabilities) -> None:
    """The target is "a second snapshot in the same volume": a pair from two volumes is an
    invalid argument (the spec names no code of its own for it)."""
    scenario.require_delta()
    other = create_block_volume(tracker, scenario.capacity)
    snap = wait_ready(stubs, caps, tracker.create_snapshot(other.volume_id))
    for base, target in ((scenario.snap1.snapshot_id, snap.snapshot_id),
                         (snap.snapshot_id, scenario.snap2.snapshot_id)):
        _expect_delta(stubs, grpc.StatusCode.INVALID_ARGUMENT, csi_pb2.GetMetadataDeltaRequest(
            base_snapshot_id=base, target_snapshot_id=target))


def _expect_delta(stubs: Stubs, code: grpc.StatusCode, req: Any) -> None:
    expect_code(code, lambda: list(stubs.snapshot_metadata.GetMetadataDelta(req)))
