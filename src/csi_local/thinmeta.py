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

Numbers are in the pool's chunks here (thin_delta and thin_dump speak in
them); bytes are the caller's business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from csi_local import dm
from csi_local.dm import dm_name
from csi_local.errors import (
    CommandError,
    MappingToolsMissing,
    MetadataUnavailable,
    StorageError,
)

if TYPE_CHECKING:
    import xml.etree.ElementTree as ET

    from csi_local.runner import Runner

SECTOR = 512
# thin_delta's kinds of run: "same" is shared by both devices; the others
# differ (overwritten, only in the base: discarded, only in the target: new).
_CHANGED = ("different", "left_only", "right_only")


@dataclass(frozen=True)
class Run:
    """`length` chunks from chunk `begin`."""

    begin: int
    length: int


@dataclass(frozen=True)
class Mapping:
    """Runs of chunks, sorted and merged, and the pool's chunk size in bytes."""

    chunk_size: int
    runs: tuple[Run, ...]


def merge(runs: list[Run]) -> tuple[Run, ...]:
    """Sorted, with touching or overlapping runs joined."""
    out: list[Run] = []
    for run in sorted(runs, key=lambda r: r.begin):
        if run.length <= 0:
            continue
        if out and run.begin <= out[-1].begin + out[-1].length:
            last = out[-1]
            end = max(last.begin + last.length, run.begin + run.length)
            out[-1] = Run(last.begin, end - last.begin)
        else:
            out.append(run)
    return tuple(out)


def _superblock(xml: str, tool: str) -> ET.Element:
    # Imported here: only changed-block tracking reads XML, and the serve
    # path's start-up should not pay for the parser (TCG: 0.1-0.2 s).
    import xml.etree.ElementTree as ET

    try:
        # The text is what a root-run tool printed from the pool's own metadata,
        # not input from a caller; expat resolves no external entities.
        root = ET.fromstring(xml)  # noqa: S314
    except ET.ParseError as err:
        raise StorageError(f"{tool} printed what is not its XML: {err}") from None
    if root.tag != "superblock":
        raise StorageError(f"{tool} printed <{root.tag}>, not <superblock>")
    return root


def _chunk_size(root: ET.Element, tool: str) -> int:
    sectors = int(root.get("data_block_size", "0"))
    if sectors <= 0:
        raise StorageError(f"{tool}: no data_block_size in its superblock")
    return sectors * SECTOR


def parse_dump(xml: str, dev_id: int) -> Mapping:
    """The mapped chunks of thin device `dev_id`, from `thin_dump --dev-id`."""
    root = _superblock(xml, "thin_dump")
    device = next((d for d in root.iter("device") if d.get("dev_id") == str(dev_id)), None)
    if device is None:
        raise StorageError(f"thin device {dev_id} is not in the pool's metadata")
    runs = []
    for m in device:
        if m.tag == "single_mapping":
            runs.append(Run(int(m.get("origin_block", "0")), 1))
        elif m.tag == "range_mapping":
            runs.append(Run(int(m.get("origin_begin", "0")), int(m.get("length", "0"))))
    return Mapping(_chunk_size(root, "thin_dump"), merge(runs))


def parse_delta(xml: str) -> Mapping:
    """The chunks two thin devices map differently, from `thin_delta` (not
    --verbose): overwritten, discarded (only in the first) and new (only in
    the second)."""
    root = _superblock(xml, "thin_delta")
    runs = [
        Run(int(e.get("begin", "0")), int(e.get("length", "0")))
        for diff in root.iter("diff") for e in diff if e.tag in _CHANGED
    ]
    return Mapping(_chunk_size(root, "thin_delta"), merge(runs))


def _not_installed(err: CommandError) -> bool:
    return err.returncode == 127


class ThinMetadata:
    """Reads the mappings of one thin pool's devices (`vg`/`pool`)."""

    def __init__(self, runner: Runner, vg: str, pool: str) -> None:
        self.runner = runner
        self.vg = vg
        self.pool = pool

    @property
    def metadata_device(self) -> str:
        return f"/dev/mapper/{dm_name(self.vg, self.pool)}_tmeta"

    def _run(self, argv: list[str]) -> str:
        try:
            return self.runner.run(argv).stdout
        except CommandError as err:
            if _not_installed(err):
                raise MappingToolsMissing(
                    f"{argv[0]} is not installed (dmsetup and thin-provisioning-tools are "
                    "needed for changed-block tracking)") from None
            raise

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

    def held(self) -> bool:
        """Whether the pool holds a metadata snapshot now (`dmsetup status`'s
        held metadata root, "-" when none)."""
        _name, fields = self._pool_target()
        return fields[6] != "-"

    def _message(self, name: str, message: str) -> None:
        self._run(["dmsetup", "message", name, "0", message])

    def _none_held(self) -> bool:
        """Whether the kernel, asked by ioctl (no process), says the pool holds
        no metadata snapshot. False whenever it cannot tell; `dmsetup status`
        is asked then."""
        try:
            usage = dm.pool_usage(self.vg, self.pool)
        except (StorageError, OSError):
            return False
        return usage is not None and not usage.metadata_snapshot_held

    def release(self) -> bool:
        """Release a held metadata snapshot; whether there was one."""
        if self._none_held():
            return False  # the common case, at every start: no process
        name, fields = self._pool_target()
        if fields[6] == "-":
            return False
        self._message(name, "release_metadata_snap")
        return True

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """The pool's metadata snapshot, held for the block and always released.

        The caller serialises (one per pool): the kernel refuses a second one
        with EBUSY, which here means someone else (an administrator's tool)
        holds it.
        """
        name, _fields = self._pool_target()
        try:
            self._message(name, "reserve_metadata_snap")
        except CommandError as err:
            if "busy" in err.stderr.lower():
                raise MetadataUnavailable(
                    f"thin pool {self.vg}/{self.pool}'s metadata snapshot is held by another "
                    "program (dmsetup status shows its held root); retry when it is released"
                ) from None
            raise
        try:
            yield
        finally:
            self._message(name, "release_metadata_snap")

    def allocated(self, dev_id: int) -> Mapping:
        """The chunks thin device `dev_id` maps; inside `snapshot()`."""
        out = self._run(["thin_dump", "--metadata-snap", "--dev-id", str(dev_id),
                         self.metadata_device])
        return parse_dump(out, dev_id)

    def delta(self, base_id: int, target_id: int) -> Mapping:
        """The chunks thin devices `base_id` and `target_id` map differently;
        inside `snapshot()`."""
        out = self._run(["thin_delta", "--metadata-snap", "--snap1", str(base_id),
                         "--snap2", str(target_id), self.metadata_device])
        return parse_delta(out)
