"""The SnapshotMetadata servicer over a fake host whose thin pool keeps real
mappings (a write maps new data chunks, a snapshot shares its origin's, a
discard unmaps) and answers dmsetup, thin_dump and thin_delta as the real
tools do. What the real pool reports is proven in the VM
(tests/integration/test_changed_blocks.py)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.rpc import RpcError, status_of
from csi_local.csi.snapshot_metadata_servicer import DEFAULT_MAX_RESULTS, SnapshotMetadataServicer
from csi_local.errors import StorageError
from csi_local.storage.lv_devices import dm_name
from csi_local.storage.thin_mappings import MARK_PREFIX, ThinMetadata
from csi_local.volumes.changed_blocks import ChangedBlocks
from tests.unit.servicers import (
    POOL,
    THREE_CLASSES,
    VG,
    GiB,
    MiB,
    Node,
    block_cap,
    call,
    make_class_node,
    make_node,
)

KiB = 1 << 10
MARK = MARK_PREFIX + dm_name(VG, POOL)
CHUNK = 64 * KiB


def stream(fn: Callable[[Any, Any], Any], request: Any) -> tuple[str, Any]:
    """("OK", [replies]) or (code, message), as the server's interceptor sends them."""
    try:
        return "OK", list(fn(request, None))
    except (RpcError, StorageError) as err:
        return status_of(fn.__name__, err)


def extents(replies: list[Any]) -> list[tuple[int, int]]:
    return [(b.byte_offset, b.size_bytes) for r in replies for b in r.block_metadata]


class Lab:
    """A node, its SnapshotMetadata servicer, and helpers to write and snapshot."""

    def __init__(self, node: Node) -> None:
        self.n = node
        self.sm = SnapshotMetadataServicer(self.changed())

    def changed(self) -> ChangedBlocks:
        """The plugin's changed-block layer, as plugin.py makes it (at each start)."""
        return ChangedBlocks(self.n.backend.pools, self.n.backend.locks, self.state_dir,
                             self.n.host)

    @property
    def state_dir(self) -> str:
        return self.n.backend.config.state_dir

    def reader(self) -> ThinMetadata:
        return ThinMetadata(self.n.host, self.n.host, VG, POOL, self.state_dir)

    def marks(self) -> dict[str, Any]:
        """The state directory's metadata snapshot marks, by file name."""
        return {n: json.loads(Path(self.state_dir, n).read_text(encoding="utf-8"))
                for n in os.listdir(self.state_dir) if n.startswith(MARK_PREFIX)}

    def volume(self, name: str, size: int = GiB, params: dict[str, str] | None = None) -> str:
        code, reply = call(self.n.controller.CreateVolume, pb.CreateVolumeRequest(
            name=name, capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[block_cap()], parameters=params or {}))
        assert code == "OK", reply
        return str(reply.volume.volume_id)

    def snapshot(self, volume_id: str, name: str) -> str:
        self.n.host.clock += 10  # LVM's lv_time is in seconds: snapshots a while apart
        code, reply = call(self.n.controller.CreateSnapshot, pb.CreateSnapshotRequest(
            name=name, source_volume_id=volume_id))
        assert code == "OK", reply
        return str(reply.snapshot.snapshot_id)

    def allocated(self, snapshot_id: str, offset: int = 0, max_results: int = 0
                  ) -> tuple[str, Any]:
        return stream(self.sm.GetMetadataAllocated, pb.GetMetadataAllocatedRequest(
            snapshot_id=snapshot_id, starting_offset=offset, max_results=max_results))

    def delta(self, base: str, target: str, offset: int = 0, max_results: int = 0
              ) -> tuple[str, Any]:
        return stream(self.sm.GetMetadataDelta, pb.GetMetadataDeltaRequest(
            base_snapshot_id=base, target_snapshot_id=target, starting_offset=offset,
            max_results=max_results))

    def held(self) -> bool:
        return any(p.held for fvg in self.n.host.vgs.values() for p in fvg.pools)


@pytest.fixture
def made() -> Iterator[list[Node]]:
    """Nodes a test makes, their state files closed after it (an open state
    file's descriptor per test adds up over the suite)."""
    nodes: list[Node] = []
    yield nodes
    for node in nodes:
        node.backend.state.close()


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[Node]) -> Lab:
    made.append(make_node(tmp_path, monkeypatch))
    return Lab(made[-1])


@pytest.fixture
def two(lab: Lab) -> tuple[Lab, str, str, str]:
    """A 1 GiB volume; pattern 1, snapshot s1; pattern 2 (overwrites, new
    writes, a discard), snapshot s2."""
    vol = lab.volume("v")
    w = lab.n.host.write
    w(vol, 0, 4 * KiB)                       # chunk 0
    w(vol, MiB + 4097, 100 * KiB)            # odd offset: chunks 16-17
    w(vol, 3 * MiB, 256 * KiB)               # chunks 48-51
    w(vol, GiB - 1000, 1000)                 # the last chunk
    s1 = lab.snapshot(vol, "s1")
    w(vol, 8 * KiB, 4 * KiB)                 # chunk 0 again: copied on write
    lab.n.host.discard(vol, 3 * MiB, 128 * KiB)  # chunks 48-49 unmapped
    w(vol, 512 * MiB + 1, 1)                 # a new chunk: 8192
    w(vol, 5 * MiB - 1, 2)                   # across a boundary: chunks 79-80
    s2 = lab.snapshot(vol, "s2")
    return lab, vol, s1, s2


def test_allocated_is_exactly_the_written_chunks(two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, s2 = two
    code, replies = lab.allocated(s1)
    assert code == "OK", replies
    assert extents(replies) == [(0, CHUNK), (16 * CHUNK, 2 * CHUNK), (48 * CHUNK, 4 * CHUNK),
                                (GiB - CHUNK, CHUNK)]
    assert {r.volume_capacity_bytes for r in replies} == {GiB}
    assert {r.block_metadata_type for r in replies} == {pb.VARIABLE_LENGTH}
    code, replies = lab.allocated(s2)
    assert extents(replies) == [(0, CHUNK), (16 * CHUNK, 2 * CHUNK), (50 * CHUNK, 2 * CHUNK),
                                (79 * CHUNK, 2 * CHUNK), (8192 * CHUNK, CHUNK),
                                (GiB - CHUNK, CHUNK)]
    assert not lab.held()


def test_delta_is_overwrites_discards_and_new_chunks(two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, s2 = two
    code, replies = lab.delta(s1, s2)
    assert code == "OK", replies
    # chunk 0 overwritten, 48-49 discarded, 79-80 and 8192 new; 16-17, 50-51 and
    # the last chunk are shared, so not reported.
    assert extents(replies) == [(0, CHUNK), (48 * CHUNK, 2 * CHUNK), (79 * CHUNK, 2 * CHUNK),
                                (8192 * CHUNK, CHUNK)]
    assert {r.volume_capacity_bytes for r in replies} == {GiB}
    assert lab.delta(s1, s1)[1][0].block_metadata == []  # a snapshot against itself
    assert not lab.held()


def test_thin_delta_and_thin_dump_read_the_metadata_snapshot(
        two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, s2 = two
    lab.n.host.calls.clear()
    lab.delta(s1, s2)
    tools = [c[:3] for c in lab.n.host.calls if c[0] in ("dmsetup", "thin_delta")]
    # The held root for the mark is read by ioctl (the Kernel's dm_status), not
    # by a second dmsetup status.
    assert tools == [("dmsetup", "status", "vg0-pool0-tpool"),
                     ("dmsetup", "message", "vg0-pool0-tpool"),
                     ("thin_delta", "--metadata-snap", "--snap1"),
                     ("dmsetup", "message", "vg0-pool0-tpool")]
    assert [c[-1] for c in lab.n.host.calls if c[:2] == ("dmsetup", "message")] == [
        "reserve_metadata_snap", "release_metadata_snap"]


@pytest.mark.parametrize("max_results", [1, 2, 3])
def test_max_results_bounds_every_message(two: tuple[Lab, str, str, str],
                                          max_results: int) -> None:
    lab, _vol, s1, s2 = two
    whole = extents(lab.delta(s1, s2)[1])
    code, replies = lab.delta(s1, s2, max_results=max_results)
    assert code == "OK"
    assert all(len(r.block_metadata) <= max_results for r in replies)
    assert len(replies) == -(-len(whole) // max_results)
    assert extents(replies) == whole


def test_default_max_results(lab: Lab) -> None:
    vol = lab.volume("v")
    for i in range(DEFAULT_MAX_RESULTS + 5):  # every other chunk: nothing merges
        lab.n.host.write(vol, 2 * i * CHUNK, 1)
    s = lab.snapshot(vol, "s")
    code, replies = lab.allocated(s)
    assert code == "OK"
    assert [len(r.block_metadata) for r in replies] == [DEFAULT_MAX_RESULTS, 5]


@pytest.mark.parametrize(("offset", "expected"), [
    (0, [(0, CHUNK), (48 * CHUNK, 2 * CHUNK), (79 * CHUNK, 2 * CHUNK), (8192 * CHUNK, CHUNK)]),
    # At a range's end: the next one. Inside one: from the offset on.
    (CHUNK, [(48 * CHUNK, 2 * CHUNK), (79 * CHUNK, 2 * CHUNK), (8192 * CHUNK, CHUNK)]),
    (48 * CHUNK + 7, [(48 * CHUNK + 7, 2 * CHUNK - 7), (79 * CHUNK, 2 * CHUNK),
                      (8192 * CHUNK, CHUNK)]),
    (8193 * CHUNK, []),
    (GiB, []),  # the end of a finished stream, resumed
])
def test_starting_offset_resumes(two: tuple[Lab, str, str, str], offset: int,
                                 expected: list[tuple[int, int]]) -> None:
    lab, _vol, s1, s2 = two
    code, replies = lab.delta(s1, s2, offset=offset)
    assert code == "OK", replies
    assert extents(replies) == expected
    assert len(replies) >= 1 and all(r.volume_capacity_bytes == GiB for r in replies)


def _other_volume(lab: Lab) -> str:
    other = lab.volume("w")
    lab.n.host.write(other, 0, 1)
    return lab.snapshot(other, "w1")


ERRORS: list[tuple[str, Callable[[Lab, str, str], tuple[str, Any]], str]] = [
    ("allocated: no id", lambda lab, s1, s2: lab.allocated(""), "INVALID_ARGUMENT"),
    ("allocated: unknown", lambda lab, s1, s2: lab.allocated("csi-s-" + "0" * 32), "NOT_FOUND"),
    ("allocated: not an id", lambda lab, s1, s2: lab.allocated("../etc"), "NOT_FOUND"),
    ("allocated: a volume's id", lambda lab, s1, s2: lab.allocated(
        lab.n.host.lvs[s1].origin), "NOT_FOUND"),
    ("allocated: negative offset", lambda lab, s1, s2: lab.allocated(s1, -1), "OUT_OF_RANGE"),
    ("allocated: offset past the end", lambda lab, s1, s2: lab.allocated(s1, GiB + 1),
     "OUT_OF_RANGE"),
    ("allocated: negative max_results", lambda lab, s1, s2: lab.allocated(s1, 0, -1),
     "INVALID_ARGUMENT"),
    ("delta: no base", lambda lab, s1, s2: lab.delta("", s2), "INVALID_ARGUMENT"),
    ("delta: no target", lambda lab, s1, s2: lab.delta(s1, ""), "INVALID_ARGUMENT"),
    ("delta: unknown base", lambda lab, s1, s2: lab.delta("csi-s-" + "1" * 32, s2),
     "NOT_FOUND"),
    ("delta: unknown target", lambda lab, s1, s2: lab.delta(s1, "csi-s-" + "1" * 32),
     "NOT_FOUND"),
    ("delta: negative offset", lambda lab, s1, s2: lab.delta(s1, s2, -5), "OUT_OF_RANGE"),
    ("delta: offset past the end", lambda lab, s1, s2: lab.delta(s1, s2, 2 * GiB),
     "OUT_OF_RANGE"),
    ("delta: negative max_results", lambda lab, s1, s2: lab.delta(s1, s2, 0, -1),
     "INVALID_ARGUMENT"),
    ("delta: target older than base", lambda lab, s1, s2: lab.delta(s2, s1),
     "INVALID_ARGUMENT"),
    ("delta: two volumes", lambda lab, s1, s2: lab.delta(s1, _other_volume(lab)),
     "INVALID_ARGUMENT"),
    ("delta: two volumes, other way", lambda lab, s1, s2: lab.delta(_other_volume(lab), s2),
     "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize(("what", "ask", "code"), ERRORS, ids=[e[0] for e in ERRORS])
def test_error_table(two: tuple[Lab, str, str, str], what: str,
                     ask: Callable[[Lab, str, str], tuple[str, Any]], code: str) -> None:
    lab, _vol, s1, s2 = two
    lab.n.host.calls.clear()
    got, message = ask(lab, s1, s2)
    assert got == code, message
    assert not lab.held()
    if code != "OK":  # refused before any metadata snapshot was taken
        assert not [c for c in lab.n.host.calls if c[:2] == ("dmsetup", "message")]


def test_the_metadata_snapshot_is_released_when_the_read_fails(
        two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, s2 = two
    lab.n.host.fail_next(["thin_delta"], rc=1, stderr="bad metadata")
    code, message = lab.delta(s1, s2)
    assert code == "INTERNAL" and "thin_delta" in message
    assert not lab.held()
    assert lab.delta(s1, s2)[0] == "OK"  # and the next read takes it again


def test_output_that_is_not_the_tools_xml_is_internal_and_released(
        two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, _s2 = two
    lab.n.host.fail_next(["thin_dump"], rc=0, stdout='<superblock data_block_size="128">'
                         '<device dev_id="1"><single_mapping origin_block="0"/>')
    code, message = lab.allocated(s1)
    assert code == "INTERNAL" and "thin_dump printed what is not its XML" in message
    assert not lab.held() and lab.marks() == {}
    assert lab.allocated(s1)[0] == "OK"


def test_held_by_another_program_is_unavailable_and_left_held(
        two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, s2 = two
    lab.n.host.lvs["pool0"].held = True
    for code, message in (lab.allocated(s1), lab.delta(s1, s2)):
        assert code == "UNAVAILABLE", message
        assert "held by another program (root block 42)" in message
        assert "never releases one it did not take" in message
    assert lab.n.host.lvs["pool0"].held  # not ours to release while we serve
    assert lab.marks() == {}  # nothing recorded: nothing of ours was reserved
    assert not [c for c in lab.n.host.calls if "reserve_metadata_snap" in c]


def test_reserved_by_another_program_after_the_status_is_unavailable(
        two: tuple[Lab, str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The other program wins the race between our status and our reserve:
    # the kernel's EBUSY is theirs, so no mark of ours may stay.
    lab, _vol, s1, _s2 = two
    real = ThinMetadata._pool_target

    def pool_target(self: ThinMetadata) -> tuple[str, list[str]]:
        found = real(self)
        lab.n.host.lvs["pool0"].held = True
        return found

    monkeypatch.setattr(ThinMetadata, "_pool_target", pool_target)
    code, message = lab.allocated(s1)
    assert code == "UNAVAILABLE" and "held by another program" in message
    assert lab.marks() == {} and lab.n.host.lvs["pool0"].held


def test_the_mark_records_the_read_and_goes_after_it(
        two: tuple[Lab, str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    lab, _vol, s1, _s2 = two
    seen: list[dict[str, Any]] = []
    real = ThinMetadata.allocated

    def allocated(self: ThinMetadata, dev_id: int) -> Any:
        seen.append(lab.marks())
        return real(self, dev_id)

    monkeypatch.setattr(ThinMetadata, "allocated", allocated)
    assert lab.allocated(s1)[0] == "OK"
    root = lab.n.host.lvs["pool0"].held_root
    assert seen == [{MARK: {"vg": VG, "pool": POOL, "phase": "held", "root": root}}]
    assert lab.marks() == {} and not lab.held()


def killed_while_reading(lab: Lab) -> contextlib.AbstractContextManager[None]:
    """A reader killed while it held the pool's metadata snapshot: reserved,
    never released (the context is entered and never left; the caller keeps
    it, or its collection would run the release)."""
    held = lab.reader().snapshot()
    held.__enter__()
    assert lab.held() and lab.marks()[MARK]["phase"] == "held"
    return held


def test_the_plugins_leftover_is_released_at_start_up(
        two: tuple[Lab, str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    lab, _vol, s1, _s2 = two
    killed = killed_while_reading(lab)
    lab.changed().release_leftovers()
    assert not lab.held() and lab.marks() == {}
    lab.changed().release_leftovers()  # none: no-op
    assert lab.allocated(s1)[0] == "OK"
    # The dead reader's context, closed without a word to the kernel.
    monkeypatch.setattr(ThinMetadata, "_message", lambda *_: None)
    killed.__exit__(None, None, None)


def test_another_programs_snapshot_is_left_at_start_up(
        two: tuple[Lab, str, str, str], caplog: pytest.LogCaptureFixture) -> None:
    # thin_dump run by an administrator, or a backup tool: releasing theirs
    # would turn what they read into garbage.
    lab, _vol, _s1, _s2 = two
    lab.n.host.lvs["pool0"].held = True
    lab.n.host.calls.clear()
    lab.changed().release_leftovers()
    assert lab.n.host.lvs["pool0"].held
    assert not [c for c in lab.n.host.calls if "release_metadata_snap" in c]
    assert f"thin pool {VG}/{POOL}: a metadata snapshot is held by another program" in (
        caplog.text)
    assert "left held" in caplog.text


def write_mark(lab: Lab, phase: str, root: int | None) -> None:
    Path(lab.state_dir, MARK).write_text(json.dumps(
        {"vg": VG, "pool": POOL, "phase": phase, "root": root}), encoding="utf-8")


@pytest.mark.parametrize(("phase", "root"), [
    ("reserving", None),  # killed between the mark and the reserve (or in the reserve)
    ("releasing", 43),  # killed between the mark and the release (or after it)
])
def test_a_mark_of_a_step_under_way_releases_nothing(
        two: tuple[Lab, str, str, str], caplog: pytest.LogCaptureFixture,
        phase: str, root: int | None) -> None:
    lab, _vol, _s1, _s2 = two
    pool = lab.n.host.lvs["pool0"]
    pool.held, pool.held_root = True, 43  # held now: ours, or another program's since
    write_mark(lab, phase, root)
    lab.changed().release_leftovers()
    assert pool.held, "perhaps another program's: never released on a guess"
    assert not [c for c in lab.n.host.calls if "release_metadata_snap" in c]
    assert "csi-local may have reserved" in caplog.text and "left held" in caplog.text
    assert lab.marks()[MARK]["phase"] == phase  # kept while it is held


def test_a_mark_of_another_root_is_not_the_held_snapshot(
        two: tuple[Lab, str, str, str], caplog: pytest.LogCaptureFixture) -> None:
    # Ours (root 41) was released by hand; another program reserved since.
    lab, _vol, _s1, _s2 = two
    pool = lab.n.host.lvs["pool0"]
    pool.held, pool.held_root = True, 43
    write_mark(lab, "held", 41)
    lab.changed().release_leftovers()
    assert pool.held and "held by another program" in caplog.text
    assert lab.marks() == {}  # it named a snapshot that is gone


@pytest.mark.parametrize("phase", ["reserving", "held", "releasing"])
def test_a_mark_with_nothing_held_is_dropped(two: tuple[Lab, str, str, str],
                                             phase: str) -> None:
    lab, _vol, s1, _s2 = two
    write_mark(lab, phase, 43)
    lab.changed().release_leftovers()
    assert lab.marks() == {} and not lab.held()
    assert not [c for c in lab.n.host.calls if "release_metadata_snap" in c]
    assert lab.allocated(s1)[0] == "OK"


def test_start_up_tolerates_a_pool_that_is_not_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[Node]) -> None:
    n = make_node(tmp_path, monkeypatch, with_vg=False)
    made.append(n)
    ChangedBlocks(n.backend.pools, n.backend.locks, n.backend.config.state_dir,
                  n.host).release_leftovers()  # logs, no raise


def test_tools_missing_is_failed_precondition(two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, s2 = two
    lab.n.host.fail_next(["dmsetup"], rc=127, stderr="dmsetup: command not found")
    code, message = lab.delta(s1, s2)
    assert code == "FAILED_PRECONDITION" and "not installed" in message


def test_an_inactive_pool_is_unavailable(two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, _s2 = two
    lab.n.host.lvs["pool0"].active = False
    code, message = lab.allocated(s1)
    assert code == "UNAVAILABLE" and "not active" in message


def test_pool_without_active_thin_volumes_is_read_by_its_own_name(lab: Lab) -> None:
    vol = lab.volume("v")
    lab.n.host.write(vol, 0, 1)
    s = lab.snapshot(vol, "s")
    lab.n.host.lvs[vol].active = False  # the pool is then "vg0-pool0", not "-tpool"
    code, replies = lab.allocated(s)
    assert code == "OK" and extents(replies) == [(0, CHUNK)]


def test_delta_capacity_is_the_targets_after_growth(lab: Lab) -> None:
    vol = lab.volume("v", 64 * MiB)
    lab.n.host.write(vol, 0, 1)
    s1 = lab.snapshot(vol, "s1")
    code, _ = call(lab.n.controller.ControllerExpandVolume, pb.ControllerExpandVolumeRequest(
        volume_id=vol, capacity_range=pb.CapacityRange(required_bytes=128 * MiB),
        volume_capability=block_cap()))
    assert code == "OK"
    lab.n.host.write(vol, 100 * MiB, 1)
    s2 = lab.snapshot(vol, "s2")
    code, replies = lab.delta(s1, s2)
    assert {r.volume_capacity_bytes for r in replies} == {128 * MiB}
    assert extents(replies) == [(1600 * CHUNK, CHUNK)]
    assert lab.allocated(s1)[1][0].volume_capacity_bytes == 64 * MiB


def test_a_chunk_past_the_end_is_cut_at_the_capacity(lab: Lab) -> None:
    lab.n.host.lvs["pool0"].chunk_size = 8 * MiB  # 12 MiB volume: 1.5 chunks
    vol = lab.volume("v", 12 * MiB)
    lab.n.host.write(vol, 12 * MiB - 1, 1)
    s = lab.snapshot(vol, "s")
    assert extents(lab.allocated(s)[1]) == [(8 * MiB, 4 * MiB)]


def test_delta_of_a_restored_volume_is_against_its_own_snapshots(
        two: tuple[Lab, str, str, str]) -> None:
    lab, _vol, s1, _s2 = two
    code, reply = call(lab.n.controller.CreateVolume, pb.CreateVolumeRequest(
        name="r", capacity_range=pb.CapacityRange(required_bytes=GiB),
        volume_capabilities=[block_cap()],
        volume_content_source=pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=s1))))
    assert code == "OK", reply
    restored = reply.volume.volume_id
    r1 = lab.snapshot(restored, "r1")
    assert lab.delta(s1, r1)[0] == "INVALID_ARGUMENT"  # another volume, though it shares data
    lab.n.host.write(restored, 0, 1)
    r2 = lab.snapshot(restored, "r2")
    assert extents(lab.delta(r1, r2)[1]) == [(0, CHUNK)]


def test_snapshots_of_another_device_class_read_that_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[Node]) -> None:
    made.append(make_class_node(tmp_path, monkeypatch, THREE_CLASSES))
    lab = Lab(made[-1])
    vol = lab.volume("v", params={"deviceClass": "cold"})
    lab.n.host.write(vol, 2 * CHUNK, 1, vg="vg-hdd")
    s1 = lab.snapshot(vol, "s1")
    lab.n.host.write(vol, 5 * CHUNK, 1, vg="vg-hdd")
    s2 = lab.snapshot(vol, "s2")
    lab.n.host.calls.clear()
    assert extents(lab.delta(s1, s2)[1]) == [(5 * CHUNK, CHUNK)]
    assert extents(lab.allocated(s2)[1]) == [(2 * CHUNK, CHUNK), (5 * CHUNK, CHUNK)]
    assert {c[2] for c in lab.n.host.calls if c[0] == "dmsetup"} == {"vg--hdd-cold-tpool"}
