"""A thin pool's block mappings, read from a metadata snapshot of the pool:
the only module that runs dmsetup and thin-provisioning-tools.

The kernel's thin pool keeps, for every thin device, which chunk of the
device maps which chunk of the pool's data. That is exactly what
changed-block tracking needs: a snapshot's allocated chunks are its
mappings, and two snapshots of one volume differ exactly where their
mappings differ (a chunk written after the first snapshot was copied on
write, so it maps another data chunk; a discarded chunk is unmapped).

The metadata of a live pool changes under a reader, so the tools read a
metadata snapshot: `reserve_metadata_snap` (the kernel commits its
transaction and keeps a read-only copy of the btree roots), the read, and
`release_metadata_snap`. The pool holds at most one; while it is held,
every metadata change is copied on write, so it is held only for the read.
Other programs (thin_dump or thin_delta run by an administrator, a backup
tool) reserve it too, and the kernel does not say who did: a durable mark in
the state directory records the one this plugin reserves, and only that one
is ever released by it.

Numbers are in the pool's chunks here (thin_delta and thin_dump speak in
them); bytes are the caller's business.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from csi_local.errors import (
    CommandError,
    MappingToolsMissing,
    MetadataSnapshotReserved,
    MetadataUnavailable,
    StorageError,
)
from csi_local.host.atomic_files import sync_directory, write_atomic
from csi_local.storage.lv_devices import dm_name, pool_usage

if TYPE_CHECKING:
    from csi_local.host.kernel import Kernel
    from csi_local.host.runner import Output, Runner

log = logging.getLogger(__name__)

SECTOR = 512
# The mark of a metadata snapshot this plugin reserves, in its state directory,
# one per pool; its phases. The phase strings are on disk, read by other
# versions (docs/on-disk-format.md): RESERVED is written "held", as ever.
MARK_PREFIX = "metadata-snap."
RESERVING, RESERVED, RELEASING = "reserving", "held", "releasing"
# thin_delta's kinds of run: "same" is shared by both devices; the others
# differ (overwritten, only in the base: discarded, only in the target: new).
_CHANGED = ("different", "left_only", "right_only")


@dataclass(frozen=True)
class Run:
    """`length` chunks from chunk `begin`."""

    begin: int
    length: int


class Runs:
    """Runs of chunks, sorted and merged, two machine integers each: a
    fragmented volume has millions, and as Python objects each would cost
    about a hundred bytes."""

    def __init__(self, flat: array[int] | None = None) -> None:
        self._flat = flat if flat is not None else array("q")  # begin, length, begin, ...

    def __len__(self) -> int:
        return len(self._flat) // 2

    def pairs(self) -> Iterator[tuple[int, int]]:
        """(begin, length) of each run, in order."""
        numbers = iter(self._flat)
        return zip(numbers, numbers)  # noqa: B905 (pairs of one iterator)

    def __iter__(self) -> Iterator[Run]:
        return (Run(b, n) for b, n in self.pairs())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Runs) and self._flat == other._flat

    def __hash__(self) -> int:
        return hash(self._flat.tobytes())

    def __repr__(self) -> str:
        return f"Runs({list(self.pairs())!r})"


@dataclass(frozen=True)
class Mapping:
    """Runs of chunks, sorted and merged, and the pool's chunk size in bytes."""

    chunk_size: int
    runs: Runs


@dataclass(frozen=True)
class Mark:
    """What a mark records: the phase, and the root once the snapshot is held."""

    phase: str
    root: int | None


class ReservedBy(enum.Enum):
    """Who reserved the metadata snapshot a pool holds (the kernel keeps one,
    and does not say whose it is)."""

    NONE = "none"
    PLUGIN = "plugin"  # the one this plugin's mark names: left by a killed reader
    UNSURE = "unsure"  # a mark of a reserve or release under way: perhaps ours
    OTHER = "other"  # no mark: another program's (thin_dump, a backup tool)


def reserved_by_text(whose: ReservedBy) -> str:
    """What a held snapshot is, said to an administrator."""
    return {
        ReservedBy.NONE: "no metadata snapshot is held",
        ReservedBy.PLUGIN: "a metadata snapshot csi-local reserved is held (left by a reader "
                       "that was killed; its next start releases it)",
        ReservedBy.UNSURE: "a metadata snapshot is held that csi-local may have reserved when it "
                       "was killed (its mark records a reserve or release under way), or "
                       "another program reserved since: csi-local does not release it. If no "
                       "thin_dump, thin_delta or backup tool is reading, release it with "
                       "dmsetup message <pool device> 0 release_metadata_snap",
        ReservedBy.OTHER: "a metadata snapshot is held by another program (thin_dump, "
                      "thin_delta, a backup tool), which csi-local never releases",
    }[whose]


def _root(field: str) -> int | None:
    """The held metadata root of `dmsetup status` ("-": none held)."""
    if field == "-":
        return None
    return int(field) if field.isdigit() else -1  # held, at a root not read


def merged(runs: Iterable[tuple[int, int]]) -> Runs:
    """(begin, length) runs sorted, with touching or overlapping runs joined,
    and empty ones dropped. The tools print runs in order, so they are joined
    as they come and only the joined ones are kept; a run out of order (never
    seen from the tools) has the whole list sorted and joined at the end."""
    flat: array[int] = array("q")
    begin = end = 0  # the run being joined, once `joining`
    joining = False
    ordered = True
    for b, n in runs:
        if n <= 0:
            continue
        if not joining:
            begin, end, joining = b, b + n, True
        elif b < begin:
            ordered = False
            flat.extend((b, n))
        elif b <= end:
            end = max(end, b + n)
        else:
            flat.extend((begin, end - begin))
            begin, end = b, b + n
    if joining:
        flat.extend((begin, end - begin))
    if ordered:
        return Runs(flat)
    return merged(sorted(Runs(flat).pairs()))  # no longer out of order


# Bytes read from a tool's output at a time: the parser holds no more of it.
READ_SIZE = 1 << 16
_DEVICE = "\0device"  # the device thin_dump was asked for, on the stack of open elements


class _Document:
    """expat's handlers over one tool's XML: the tags of the open elements,
    the runs taken from the elements seen so far, and, at the end, the
    superblock's chunk size. No element is kept once its start is seen."""

    tool = ""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.runs: list[tuple[int, int]] = []
        self.block_size = ""  # the superblock's data_block_size, in sectors

    def start(self, tag: str, attrs: dict[str, str]) -> None:
        if self.open:
            self.open.append(self.child(self.open[-1], tag, attrs))
            return
        if tag != "superblock":
            raise StorageError(f"{self.tool} printed <{tag}>, not <superblock>")
        self.block_size = attrs.get("data_block_size", "0")
        self.open.append(tag)

    def end(self, _tag: str) -> None:
        self.open.pop()

    def child(self, parent: str, tag: str, attrs: dict[str, str]) -> str:
        """Takes the runs an element lists; what to push for it."""
        raise NotImplementedError

    def finish(self) -> int:
        """At the document's end: the chunk size in bytes."""
        sectors = int(self.block_size)
        if sectors <= 0:
            raise StorageError(f"{self.tool}: no data_block_size in its superblock")
        return sectors * SECTOR


class _Dump(_Document):
    """`thin_dump --dev-id`: the mappings that are children of the device."""

    tool = "thin_dump"

    def __init__(self, dev_id: int) -> None:
        super().__init__()
        self.dev_id = str(dev_id)
        self.found = False

    def child(self, parent: str, tag: str, attrs: dict[str, str]) -> str:
        if parent == _DEVICE:
            if tag == "single_mapping":
                self.runs.append((int(attrs.get("origin_block", "0")), 1))
            elif tag == "range_mapping":
                self.runs.append((int(attrs.get("origin_begin", "0")),
                                  int(attrs.get("length", "0"))))
        elif tag == "device" and not self.found and attrs.get("dev_id") == self.dev_id:
            self.found = True  # the first one: thin_dump --dev-id prints only it
            return _DEVICE
        return tag

    def finish(self) -> int:
        if not self.found:
            raise StorageError(f"thin device {self.dev_id} is not in the pool's metadata")
        return super().finish()


class _Delta(_Document):
    """`thin_delta` (not --verbose): the runs of each <diff> that differ."""

    tool = "thin_delta"

    def child(self, parent: str, tag: str, attrs: dict[str, str]) -> str:
        if parent == "diff" and tag in _CHANGED:
            self.runs.append((int(attrs.get("begin", "0")), int(attrs.get("length", "0"))))
        return tag


class Scan:
    """The runs one tool's XML lists, (begin, length) in the document's order,
    each as soon as its element has been read from `out`: the output is parsed
    READ_SIZE bytes at a time, never held whole. `chunk_size` is set once the
    iteration has ended."""

    def __init__(self, out: Output, document: _Document) -> None:
        self.out = out
        self.document = document
        self.chunk_size = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # Imported here: only changed-block tracking reads XML.
        from xml.parsers import expat

        doc = self.document
        parser = expat.ParserCreate()
        parser.StartElementHandler = doc.start
        parser.EndElementHandler = doc.end
        try:
            while data := self.out.read(READ_SIZE):
                # The text is what a root-run tool printed from the pool's own
                # metadata, not input from a caller; expat resolves no external
                # entities.
                parser.Parse(data, False)
                if doc.runs:
                    runs, doc.runs = doc.runs, []
                    yield from runs
            parser.Parse(b"", True)
        except expat.ExpatError as err:
            raise StorageError(f"{doc.tool} printed what is not its XML: {err}") from None
        yield from doc.runs
        doc.runs = []
        self.chunk_size = doc.finish()


def dump_runs(out: Output, dev_id: int) -> Scan:
    """The runs thin device `dev_id` maps, from `thin_dump --dev-id` as it prints."""
    return Scan(out, _Dump(dev_id))


def delta_runs(out: Output) -> Scan:
    """The runs two thin devices map differently, from `thin_delta` (not
    --verbose) as it prints: overwritten, discarded (only in the first) and
    new (only in the second)."""
    return Scan(out, _Delta())


def read_mapping(scan: Scan) -> Mapping:
    """A scan's runs, merged as they come."""
    runs = merged(scan)
    return Mapping(scan.chunk_size, runs)


@contextlib.contextmanager
def _tools_needed(argv: list[str]) -> Iterator[None]:
    """A tool that is not installed is MappingToolsMissing."""
    try:
        yield
    except CommandError as err:
        if err.returncode == 127:
            raise MappingToolsMissing(
                f"{argv[0]} is not installed (dmsetup and thin-provisioning-tools are "
                "needed for changed-block tracking)") from None
        raise


class ThinMetadata:
    """Reads the mappings of one thin pool's devices (`vg`/`pool`)."""

    def __init__(self, runner: Runner, host: Kernel, vg: str, pool: str, mark_dir: str) -> None:
        self.runner = runner
        self.host = host  # the pool's status, by ioctl
        self.vg = vg
        self.pool = pool
        self.mark_dir = mark_dir  # the plugin's state directory

    @property
    def metadata_device(self) -> str:
        return f"/dev/mapper/{dm_name(self.vg, self.pool)}_tmeta"

    def _run(self, argv: list[str]) -> str:
        with _tools_needed(argv):
            return self.runner.run(argv).stdout

    def _pool_target(self) -> tuple[str, list[str]]:
        """(dm name, `dmsetup status` fields) of the pool's thin-pool target.

        With a thin volume active, LVM stacks the pool as "<vg>-<pool>-tpool"
        (the thin-pool target) under a linear "<vg>-<pool>"; with none, the
        pool alone is "<vg>-<pool>". Which one holds the target is read, not
        assumed.
        """
        base = dm_name(self.vg, self.pool)
        for name in (f"{base}-tpool", base):
            try:
                fields = self._run(["dmsetup", "status", name]).split()
            except CommandError:
                continue
            if len(fields) > 6 and fields[2] == "thin-pool":
                return name, fields
        raise MetadataUnavailable(f"thin pool {self.vg}/{self.pool} is not active")

    def reserved_root(self) -> int | None:
        """The root block of the metadata snapshot reserved in the pool now
        (dmsetup status's "held metadata root"); None when none is.
        MetadataUnavailable when the pool is not active."""
        try:
            usage = pool_usage(self.host, self.vg, self.pool)
        except (StorageError, OSError):
            usage = None  # the kernel could not be asked by ioctl: dmsetup is
        if usage is not None and (usage.metadata_snapshot_root is not None
                                  or not usage.metadata_snapshot_held):
            return usage.metadata_snapshot_root
        _name, fields = self._pool_target()
        return _root(fields[6])

    def _message(self, name: str, message: str) -> None:
        self._run(["dmsetup", "message", name, "0", message])

    # The mark: what this plugin has reserved ---------------------------------

    @property
    def mark_path(self) -> str:
        return os.path.join(self.mark_dir, MARK_PREFIX + dm_name(self.vg, self.pool))

    def _mark(self, phase: str, root: int | None = None) -> None:
        write_atomic(self.mark_path, json.dumps(
            {"vg": self.vg, "pool": self.pool, "phase": phase, "root": root}))

    def _unmark(self) -> None:
        try:
            os.unlink(self.mark_path)
        except FileNotFoundError:
            return
        sync_directory(self.mark_dir)

    def mark(self) -> Mark | None:
        """What the mark says (None: no mark); an unreadable mark reads as a
        reservation under way (the one state in which nothing is released)."""
        try:
            with open(self.mark_path, encoding="utf-8") as f:
                entry = json.load(f)
            phase, root = str(entry["phase"]), entry["root"]
            return Mark(phase, root if isinstance(root, int) else None)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return Mark(RESERVING, None)

    def reserved_by(self) -> ReservedBy:
        """Who holds the pool's metadata snapshot, by the mark and the kernel."""
        root = self.reserved_root()
        if root is None:
            return ReservedBy.NONE
        mark = self.mark()
        if mark is None:
            return ReservedBy.OTHER
        if mark.phase == RESERVED:
            # A held snapshot keeps its root: another root is not the one marked.
            return ReservedBy.PLUGIN if mark.root == root and root >= 0 else ReservedBy.OTHER
        return ReservedBy.UNSURE

    def release_leftover(self) -> ReservedBy:
        """At start-up: release the metadata snapshot this plugin recorded
        taking (and did not release: it was killed), and nothing else.

        The mark is written before the reserve and says which root was
        reserved once it is held (see snapshot()). Only a mark that names the
        root the pool holds now is proof: a mark of a reserve or a release
        under way when the plugin died cannot tell its own snapshot from one
        another program reserved since, so that one is left, and reported.
        Returns who reserved it (ReservedBy.PLUGIN: released now); the mark goes when
        nothing is held any more, when it names another root than the one
        held, or once the plugin's own is released.
        """
        whose = self.reserved_by()
        if whose in (ReservedBy.NONE, ReservedBy.OTHER):
            self._unmark()  # it names no snapshot held now (if there is one)
        elif whose is ReservedBy.PLUGIN:
            name, _fields = self._pool_target()
            self._message(name, "release_metadata_snap")
            self._unmark()
        return whose

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """The pool's metadata snapshot, held for the block and always released.

        The caller serialises (one per pool). A snapshot held by anyone else
        (an administrator's thin_dump, a backup tool) is theirs: never
        released here, MetadataSnapshotReserved (UNAVAILABLE: retry later).

        A mark in the state directory, written (fsync'd) before the reserve
        and removed after the release, records the reservation, so that a
        plugin killed in between releases its own at the next start and only
        its own: "reserving" before the reserve, "held" with the root the
        kernel reports once it is held, "releasing" before the release.
        """
        name, fields = self._pool_target()
        if (root := _root(fields[6])) is not None:
            raise self._reserved_elsewhere(root)
        self._mark(RESERVING)
        try:
            self._message(name, "reserve_metadata_snap")
        except CommandError as err:
            if "busy" in err.stderr.lower():
                # Reserved by another program since the status: none of ours.
                self._unmark()
                raise self._reserved_elsewhere(None) from None
            raise  # the mark stays: the reserve may have been made (a timeout)
        root = None
        try:
            root = self.reserved_root()
            if root is not None and root >= 0:
                self._mark(RESERVED, root)  # else the mark proves nothing: left as it is
            yield
        finally:
            try:
                self._mark(RELEASING, root)
            except OSError as err:
                log.error("cannot update the metadata snapshot mark %s: %s",
                          self.mark_path, err)
            self._message(name, "release_metadata_snap")
            self._unmark()

    def _reserved_elsewhere(self, root: int | None) -> MetadataSnapshotReserved:
        at = f" (root block {root})" if root is not None and root >= 0 else ""
        return MetadataSnapshotReserved(
            f"thin pool {self.vg}/{self.pool}'s metadata snapshot is held by another "
            f"program{at}, and a pool has only one: csi-local never releases one it did "
            "not take. Retry when that program is done (dmsetup status shows the held "
            "root; `dmsetup message <pool device> 0 release_metadata_snap` frees one that "
            "nothing reads)")

    def _read(self, argv: list[str], scan: Callable[[Output], Scan]) -> Mapping:
        """The mapping a tool prints, merged while it prints (a large volume's
        XML is hundreds of megabytes): the tool's failure (its exit code,
        its standard error, a timeout) is the error, else a document that is
        not its XML."""
        with _tools_needed(argv), self.runner.stream(argv) as out:
            return read_mapping(scan(out))

    def allocated(self, dev_id: int) -> Mapping:
        """The chunks thin device `dev_id` maps; inside `snapshot()`."""
        return self._read(["thin_dump", "--metadata-snap", "--dev-id", str(dev_id),
                           self.metadata_device], lambda out: dump_runs(out, dev_id))

    def delta(self, base_id: int, target_id: int) -> Mapping:
        """The chunks thin devices `base_id` and `target_id` map differently;
        inside `snapshot()`."""
        return self._read(["thin_delta", "--metadata-snap", "--snap1", str(base_id),
                           "--snap2", str(target_id), self.metadata_device], delta_runs)
