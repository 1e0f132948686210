"""Making and removing the CSI plugin's volumes and snapshots: CreateVolume,
DeleteVolume and CreateSnapshot below the RPC edge, one call each.

The controller validates a request into plain values and makes one call
here; everything from there on is this module's: the locks (the new
object's, its source's, then the pool's, in that order everywhere), where
the object goes (the class asked for, or its source's: a thin snapshot lives
in its origin's pool), whether it exists already (a CO's retry gets the same
object, a conflicting request NameTaken), and the step that makes it
(Pool.create_thin, or VolumeSteps.clone and VolumeSteps.snapshot), all
against one report read under the pool lock. The rules a create shares
with the host volume plugin's are not here: where a name is across the
classes' VGs and which pool a new object goes to (volumes/placement.py), a
repeat's check, the smallest new volume and a copy's limit
(volumes/creation.py).

Transport-free: errors are the storage layer's (csi_local.errors) and the
RPC edge (csi/rpc.py) gives them their codes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from csi_local.errors import (
    AmbiguousName,
    Difference,
    LvNotFound,
    NameTaken,
    VolumeDiffers,
    VolumeInUse,
)
from csi_local.host import stopwatch
from csi_local.host.locks import Locks
from csi_local.storage.lvm import LogicalVolume, VgReport
from csi_local.volumes import creation, encryption, naming, placement, qos, sizes
from csi_local.volumes.lifecycle import VolumeSteps
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.naming import Source, SourceKind
from csi_local.volumes.pool import Pool, Pools

log = logging.getLogger(__name__)

# The size of a new volume whose request names none.
DEFAULT_SIZE = 1 << 30


@dataclass(frozen=True)
class VolumeRequest:
    """What a CreateVolume asks for, as plain values."""

    name: str  # the CO's name; the volume ID is made from it
    device_class: str | None  # None: the default class, or a source's
    required: int  # bytes; 0: not set
    limit: int  # bytes; 0: no limit
    source: Source | None  # a snapshot to restore or a volume to clone
    parameters: Mapping[str, str]  # the CO's, for the volume's name tags
    # The file systems the capabilities ask for, "" for the class's default:
    # the class chosen first, or a source's own, sets the smallest size (and
    # refuses one whose mkfs this node lacks).
    fs_types: tuple[str, ...]
    # Whether the parameters ask for LUKS2 encryption; None: they do not
    # say, so the class's default (a new volume) or the source (a copy) does.
    encrypted: bool | None = None
    # The IO limits the parameters and mutable parameters set ({io.max key:
    # value, None lifting the class's default}), over the class's default.
    qos: Mapping[str, int | None] = field(default_factory=dict)


class UseRecords(Protocol):
    """Where the node records its stages and publishes (the CSI node's state
    file): a volume used on this node is not deleted."""

    def where_used(self, volume_id: str) -> str | None: ...
    def clear_formatting(self, lv_uuid: str) -> None: ...


class Provisioner:
    """CreateVolume, DeleteVolume and CreateSnapshot on the node's pools."""

    def __init__(self, pools: Pools, locks: Locks, steps: VolumeSteps,
                 records: UseRecords) -> None:
        self.pools = pools
        self.locks = locks
        self.steps = steps
        self.records = records

    # volumes -------------------------------------------------------------

    def create_volume(self, req: VolumeRequest) -> LogicalVolume:
        """The volume `req` asks for: made, or the same one again (a retry,
        which also finishes a create killed part-way); NameTaken when the
        name's volume differs, LvNotFound for a source that is not there."""
        asked = req.device_class
        pool = self.pools.select(asked)
        minimum = sizes.minimum_size(req.fs_types, pool.default_fs_type)
        volume_id = naming.volume_id_for(req.name)
        # Where a create's time went (locks, report, lvcreate in the shell or
        # as a process), one debug line: a storm's slow creates say why.
        with stopwatch.recording() as breakdown:
            try:
                return self._create_volume(req, pool, minimum, volume_id)
            finally:
                log.debug("CreateVolume %s: %s", volume_id, breakdown.text())

    def _create_volume(self, req: VolumeRequest, pool: Pool, minimum: int,
                       volume_id: str) -> LogicalVolume:
        asked = req.device_class
        source = req.source
        with contextlib.ExitStack() as stack:
            with stopwatch.phase("volume lock"):
                stack.enter_context(self.locks.hold(volume_key(volume_id)))
            if (source is not None and source.kind is SourceKind.VOLUME
                    and source.id != volume_id):
                # A clone reads its source: keep it from being unstaged or deleted
                # meanwhile (lock order: new volume, source, pool). A volume named
                # as its own source is not locked twice (that waits on itself): it
                # is not found below, or NameTaken for an existing volume.
                stack.enter_context(self.locks.hold(volume_key(source.id)))
            # With several classes the volume (a retry) or its source may be in
            # another VG than the chosen pool's, and a source names the class
            # when the request names none: one `lvs` over the classes' VGs first,
            # placed by the rule both front ends share (volumes/placement.py: a
            # name in two VGs, or nowhere while a VG that may hold it is missing,
            # is refused). Both are under their locks, so this stays true.
            found: tuple[Pool | None, LogicalVolume] | None = None
            found_source: tuple[Pool | None, LogicalVolume] | None = None
            if placement.needs_read(self.pools, source is not None):
                seen = placement.read(
                    self.pools, [volume_id] if source is None else [volume_id, source.id])
                with ambiguous(f"volume {req.name!r}", "which is the volume is unknown, so "
                               "none is used"):
                    found = placement.existing(seen, volume_id)
                if source is not None:
                    with ambiguous(f"{source.kind} {source.id}", "which is the source is "
                                   "unknown, so nothing is made from it"):
                        found_source = placement.only(seen, source.id)
                if asked is None and found_source is not None and found_source[0] is not None:
                    # A restore or clone stays in its source's class.
                    pool = found_source[0]
                    minimum = sizes.minimum_size(req.fs_types, pool.default_fs_type)
            # One report, under the pool lock, answers all: does the volume exist
            # (a retry), its source, the extent size and the pool's room.
            # Without a source no volume's device is acted on: the committed
            # metadata and the pool's status answer without a process.
            report = stack.enter_context(pool.reserved(committed=source is None))
            existing = report.find(volume_id) or (found[1] if found else None)
            if existing is not None:
                return self._reuse(pool, report, existing, req, minimum)
            source_lv = None
            if source is not None:
                source_lv = (report.find(source.id)
                             or (found_source[1] if found_source else None))
                if source_lv is None or not naming.is_source(source_lv, source):
                    raise LvNotFound(f"{source.kind} {source.id!r} not found")
                naming.check_format(source_lv)  # a newer csi-local's: not copied
                # With no class asked, `pool` is the source's (placed above); a
                # source in no class of this node is refused here, not "not found".
                self.pools.pool_of_copy(source_lv, asked or pool.class_name,
                                        f"{source.kind} {source.id}",
                                        naming.DEVICE_CLASS_PARAMETER)
            return self._create(pool, report, volume_id, req, minimum, source_lv)

    def _reuse(self, pool: Pool, report: VgReport, lv: LogicalVolume, req: VolumeRequest,
               minimum: int) -> LogicalVolume:
        """The same name again: the same volume if compatible, converging an
        interrupted create; NameTaken otherwise (under the pool lock)."""
        name = req.name
        # A newer csi-local's volume: its tags may not say what the check reads.
        if naming.is_csi_volume(lv) and self.pools.of_lv(lv) is not None:
            naming.check_format(lv)
        # What a CSI CO's repeat asks: what it asked the first time, so the
        # class chosen (the default when none is named), exactly the content
        # source named (none included), and a new volume's encryption as the
        # class's default has it when the parameters do not say.
        try:
            creation.check_repeat(
                self.pools, lv, ours=naming.is_csi_volume(lv), device_class=pool.class_name,
                same_source=naming.source_of(lv) == req.source,
                encrypted=None if req.source is not None else bool(encryption.new_volume_tags(
                    req.encrypted, pool.encrypted_by_default, naming.TAG_ENCRYPTED, None)),
                encrypted_tag=naming.TAG_ENCRYPTED)
        except VolumeDiffers as err:
            raise NameTaken(self._differs(err.difference, name, lv, pool, req)) from None
        want = naming.requested_size(lv)
        if not sizes.in_range(want, req.required, req.limit):
            raise NameTaken(
                f"volume {name!r} exists with {want} bytes, outside the requested range"
            )
        if want < minimum:
            raise NameTaken(
                f"volume {name!r} exists with {want} bytes, too small for the requested "
                f"file system (at least {minimum} bytes)"
            )
        if lv.size < want:  # killed between snapshot and extend: finish the job
            pool.require_room(report, want - lv.size)
            lv = pool.lvm.extend_to(lv, want)
        if self.steps.is_encrypted(lv) and naming.source_of(lv) is None:
            # Killed before its placeholder header was written: written now
            # (only while the volume maps no block).
            self.steps.write_placeholder(pool.lvm.activate(lv))
        return lv

    def _differs(self, difference: Difference, name: str, lv: LogicalVolume, pool: Pool,
                 req: VolumeRequest) -> str:
        """The CSI plugin's words for a volume that exists and differs."""
        if difference is Difference.NOT_OURS:
            return f"name {name!r} maps to LV {lv.vg}/{lv.name}, which is not a volume"
        if difference is Difference.NO_CLASS:
            return (f"name {name!r} maps to LV {lv.vg}/{lv.name}, in thin pool {lv.vg}/"
                    f"{lv.pool}, which is no device class of this node: left alone")
        if difference is Difference.CLASS:
            other = self.pools.of_lv(lv)
            assert other is not None
            return (f"volume {name!r} exists in device class {other.class_name!r}, not in "
                    f"{pool.class_name!r}" + ("" if req.device_class else " (the default)"))
        if difference is Difference.SOURCE:
            return f"volume {name!r} exists with another content source"
        return f"volume {name!r} exists, and its encryption is not what the request asks"

    def _create(self, pool: Pool, report: VgReport, volume_id: str, req: VolumeRequest,
                minimum: int, source_lv: LogicalVolume | None) -> LogicalVolume:
        """Make the volume (under its lock, its source's and the pool's);
        `source_lv` is the source, found in `pool`."""
        encrypted = encryption.new_volume_tags(req.encrypted, pool.encrypted_by_default,
                                               naming.TAG_ENCRYPTED, source_lv)
        minimum = creation.smallest_size(pool, report, minimum, bool(encrypted))
        if source_lv is not None:
            creation.check_copy_limit(source_lv, req.limit, "limit_bytes")
            minimum = max(minimum, source_lv.size)
        size = sizes.size_for(req.required, req.limit, report.extent_size,
                              default=DEFAULT_SIZE, minimum=minimum)
        limits = pool.device_class.qos.merged(req.qos)
        tags = [*naming.new_lv_tags(naming.KIND_VOLUME), f"{naming.TAG_SIZE}={size}",
                *naming.co_name_tags(dict(req.parameters)), *encrypted, *qos.tags_of(limits)]
        if req.source is None or source_lv is None:
            # No "fresh" tag: the node formats a volume only while its thin
            # device maps no block (see VolumeSteps.freshness).
            lv = pool.create_thin(report, volume_id, size, tags)
            if encrypted:
                # Its placeholder LUKS2 header (VolumeSteps.write_placeholder).
                try:
                    self.steps.write_placeholder(lv)
                except BaseException:
                    pool.lvm.remove(volume_id)
                    raise
            return lv
        # Tagged new-fsid and, when it outgrows its source, grow-fs by the clone step.
        return self.steps.clone(pool, report, source_lv, volume_id,
                                [*tags, req.source.tag()], size)

    def delete_volume(self, volume_id: str) -> None:
        """Remove the volume; nothing to do when it is gone, or was never a
        volume of ours. VolumeInUse while this node has it staged or
        published (or LVM finds it open)."""
        if not naming.is_volume_id(volume_id):
            return  # never ours, so already gone
        with self.locks.hold(volume_key(volume_id)):
            where = self.records.where_used(volume_id)
            if where is not None:
                raise VolumeInUse(
                    f"volume {volume_id} is still staged or published on this node ({where})")
            # An LV in the committed metadata is found without a process; only
            # one that is not there (a retry, most likely) costs an `lvs`.
            found = self.pools.find_committed(volume_id) or self.pools.find(volume_id)
            if found is not None and naming.is_csi_volume(found[1]):
                naming.check_format(found[1])  # a newer csi-local's: never removed here
                found[0].lvm.remove(volume_id)  # VolumeInUse when it is open
                if found[1].uuid:  # a mark left by a stage killed in its mkfs
                    self.records.clear_formatting(found[1].uuid)

    def modify_volume(self, volume_id: str, changes: Mapping[str, int | None]) -> qos.Limits:
        """Set the volume's IO limits that `changes` name (io.max keys; None
        lifts one), the others kept: its tags changed in one lvchange. The
        node that publishes it writes them into its workloads' io.max within
        one reconcile interval (volumes/qos_enforcement.py). LvNotFound for a
        volume that is not there. The limits the volume has now."""
        with self.locks.hold(volume_key(volume_id)):
            # The committed metadata, when it answers: a repeat that changes
            # nothing (the node's VolumeAttributesClass sync asks every
            # round) starts no process.
            pool, lv = naming.get_volume(self.pools, volume_id, committed=True)
            naming.check_format(lv)  # a newer csi-local's tags: not rewritten here
            limits = qos.limits_of(lv).merged(changes)
            add, delete = qos.tag_changes(lv, limits)
            pool.lvm.change_tags(lv.name, add=add, delete=delete)
            return limits

    # snapshots -----------------------------------------------------------

    def create_snapshot(self, name: str, source_id: str,
                        device_class: str | None) -> LogicalVolume:
        """Snapshot `name` of volume `source_id`: taken, or the same one again
        (a retry); NameTaken when the name's snapshot is another volume's,
        LvNotFound when the volume is not there. `device_class`, if given,
        must be the volume's (UnknownDeviceClass otherwise)."""
        asked = device_class
        if asked is not None:
            self.pools.select(asked)  # an unknown class: refused, nothing done
        snapshot_id = naming.snapshot_id_for(name)
        # Lock order: snapshot, source, pool. One report then answers all: a retry,
        # the source, and the pool's room. A source ID that is this snapshot's own
        # is not locked twice (that waits on itself): it is no volume, not found.
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.locks.hold(volume_key(snapshot_id)))
            if source_id != snapshot_id:
                stack.enter_context(self.locks.hold(volume_key(source_id)))
            # A snapshot lives in its source's pool. With one class that is the
            # pool; with several, one `lvs` over them finds the source (and a
            # snapshot of the same name in any class) first, placed by the rule
            # volumes share (volumes/placement.py): a name in two VGs, or
            # nowhere while a VG that may hold it is missing, is refused.
            pool = self.pools.default
            found: tuple[Pool | None, LogicalVolume] | None = None
            found_source: tuple[Pool | None, LogicalVolume] | None = None
            if placement.needs_read(self.pools, True):
                seen = placement.read(self.pools, [snapshot_id, source_id])
                with ambiguous(f"snapshot {name!r}", "which is the snapshot is unknown, so "
                               "none is used"):
                    found = placement.existing(seen, snapshot_id)
                with ambiguous(f"volume {source_id}", "which is the volume is unknown, so "
                               "nothing is made from it"):
                    found_source = placement.only(seen, source_id)
                pool = next((p for p in (found and found[0], found_source and found_source[0])
                             if p is not None), pool)
            report = stack.enter_context(pool.reserved())
            existing = report.find(snapshot_id) or (found[1] if found else None)
            if existing is not None:
                src = naming.source_of(existing)
                if self.pools.of_lv(existing) is None:
                    raise NameTaken(f"snapshot {name!r} maps to LV {existing.vg}/"
                                    f"{existing.name}, in thin pool {existing.vg}/"
                                    f"{existing.pool}, which is no device class of this node")
                if (not naming.is_csi_snapshot(existing)
                        or src != Source(SourceKind.VOLUME, source_id)):
                    raise NameTaken(f"snapshot {name!r} exists for another source volume")
                naming.check_format(existing)
                self.pools.pool_of_copy(existing, asked, f"snapshot {snapshot_id}",
                                        naming.DEVICE_CLASS_PARAMETER)
                return existing
            source_lv = report.find(source_id) or (found_source[1] if found_source else None)
            if source_lv is None or not naming.is_csi_volume(source_lv):
                raise LvNotFound(f"volume {source_id!r} not found")
            naming.check_format(source_lv)
            # A source in no class of this node is refused here, not "not found".
            if self.pools.pool_of_copy(source_lv, asked, f"volume {source_id}",
                                       naming.DEVICE_CLASS_PARAMETER) is not pool:
                raise LvNotFound(f"volume {source_id!r} not found")
            tags = [*naming.new_lv_tags(naming.KIND_SNAPSHOT),
                    Source(SourceKind.VOLUME, source_id).tag()]
            return self.steps.snapshot(pool, report, source_lv, snapshot_id, tags)


@contextlib.contextmanager
def ambiguous(what: str, consequence: str) -> Iterator[None]:
    """The CSI plugin's words for a name placement found in several VGs
    (volumes/placement.py): `what` has LVs in several volume groups (the
    LVs), `consequence`; remove or rename the others."""
    try:
        yield
    except AmbiguousName as err:
        raise AmbiguousName(
            f"{what} has LVs in several volume groups ({', '.join(err.lvs)}): {consequence}; "
            "remove or rename the others", err.lvs) from None
