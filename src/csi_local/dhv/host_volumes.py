"""create and delete of the Nomad dynamic host volume plugin: a thin LV with a
file system, mounted at DHV_VOLUMES_DIR/<volume id>.

The CSI plugin's layers do the work: the same pools (device classes, each
with its room and its pool lock), the same lock keys and order (the volume's
key outside, the pool's inside), the same formatting rule and mount-option
rule, the same volume steps (csi_local.volumes.lifecycle: snapshot,
clone, format once, new fs id, mount, grow), the same placement
(csi_local.volumes.placement: where a name is across the classes' volume
groups) and the same creation policy (csi_local.volumes.creation: what a
repeated create may meet, the smallest new volume, a copy's limit; a new
volume's or a copy's encryption is csi_local.volumes.encryption's). Only
Nomad's request and answer are the host volume plugin's own, and the words
of its refusals; delete's unmounting is in dhv/removal.

Device classes: a new volume goes to the class its `device_class` parameter
names (or the default class), a clone to its source's class; a volume that
exists is found in whatever class it is, by one `lvs` over the classes'
volume groups (its VG and thin pool say its class; nothing else records it).
A class whose volume group is missing never makes a volume look gone, nor
lets one be made while it may hold its name; a name with LVs in two volume
groups is left alone.

Everything here is imported lazily by csi_local.dhv, off the fingerprint path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence

from csi_local.dhv.config import PluginConfig
from csi_local.dhv.deadline import RESERVE, Deadline, DeadlineRunner
from csi_local.dhv.removal import VolumeRemoval, device_numbers
from csi_local.dhv.request import (
    DEVICE_CLASS,
    DhvError,
    Parameters,
    Request,
    lv_name_for,
    snapshot_lv_name,
)
from csi_local.errors import (
    AmbiguousName,
    Difference,
    SizeOutOfRange,
    SourceMismatch,
    VolumeDiffers,
    VolumeGroupMissing,
)
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.crypt import Key, read_key_file
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.host.runner import ProcessRunner, Runner
from csi_local.storage.lvm import LogicalVolume, Lvm, VgReport, hex_tag
from csi_local.volumes import creation, encryption, placement, sizes
from csi_local.volumes.freezes import DEFAULT_FREEZE_LIMIT, Freezes
from csi_local.volumes.host_volume_names import (
    KIND_SNAPSHOT,
    KIND_VOLUME,
    TAG_ENCRYPTED,
    TAG_FRESH,
    TAG_FS,
    TAG_GROW_FS,
    TAG_ID,
    TAG_KIND,
    TAG_NAME,
    TAG_NAMESPACE,
    TAG_SNAPSHOT,
    TAG_SOURCE,
    TAG_SOURCE_NAME,
    check_format,
    decode_hex_tag,
    snapshot_tags,
    volume_tags,
)
from csi_local.volumes.lifecycle import DHV_TAGS, VolumeSteps
from csi_local.volumes.lock_keys import volume_key
from csi_local.volumes.pool import Pool, Pools

log = logging.getLogger("csi_local.dhv")


class HostVolumes:
    """create and delete, on the pools (device classes) the configuration names."""

    def __init__(self, config: PluginConfig, runner: Runner | None = None,
                 host: Kernel | None = None) -> None:
        self.config = config
        self.deadline = Deadline(config.timeout_seconds)
        inner = runner if runner is not None else ProcessRunner(timeout=config.timeout_seconds)
        self.runner = DeadlineRunner(inner, self.deadline)
        self.host = host if host is not None else Kernel()
        self.fs = Filesystems(self.runner, self.host)
        self.locks = Locks(config.lock_dir)
        self.pools = Pools(config.classes, self.runner, self.locks, config.pool_policy)
        # The one freeze rule (volumes/freezes.py), with the CSI plugin's default
        # limit; its journals in the lock directory both plugins share.
        self.freezes = Freezes(self.host, self.locks, DEFAULT_FREEZE_LIMIT,
                               limit_name="the host volume plugin's freeze limit")
        self.steps = VolumeSteps(self.fs, self.host, DHV_TAGS, freezes=self.freezes)
        self.removal = VolumeRemoval(self.fs, self.host, self.steps.close_device)

    def thaw_leftovers(self) -> None:
        """Thaw what a snapshot or clone killed mid-way (this plugin's, or the
        CSI plugin's) left frozen: every run of create, delete and snapshot
        starts with it, as the CSI plugin's start does. A failure is logged,
        never the run's end: the next run, or the CSI plugin, tries again."""
        try:
            self.freezes.recover()
        except Exception as err:
            log.error("thawing file systems left frozen by an unfinished snapshot: %s", err)

    def _lock_timeout(self) -> float:
        return self.deadline.left(reserve=2 * RESERVE)

    @contextlib.contextmanager
    def _hold(self, lv_name: str) -> Iterator[None]:
        with self.locks.hold(volume_key(lv_name), timeout=self._lock_timeout()):
            yield

    def class_of(self, lv: LogicalVolume) -> str | None:
        """The device class of an LV (its VG and thin pool say it), None for an
        LV in no class's pool."""
        pool = self.pools.of_lv(lv)
        return pool.class_name if pool is not None else None

    def _where(self) -> str:
        """Where volumes are looked for, for messages: the pool, or the classes."""
        if len(self.pools) == 1:
            return self.pools.default.name
        return f"the device classes of this node ({', '.join(sorted(self.pools.names))})"

    # create ------------------------------------------------------------------

    def create(self, req: Request) -> tuple[str, int]:
        """Make (or converge) the volume; returns (path, bytes)."""
        self.thaw_leftovers()
        params = req.parameters
        if params is None:
            raise DhvError("create needs the volume's parameters")
        asked = self.pools.select(params.device_class)  # unknown: refused, nothing done
        with self._hold(req.lv_name):
            pool, lv = self._placement(req, params, asked)
            created = False
            if lv is None:
                # One report, under the pool lock, says whether the volume exists and,
                # if not, whether (and from what) it may be made.
                with pool.reserved(self._lock_timeout()) as report:
                    lv = report.find(req.lv_name)
                    if lv is None:
                        created = True
                        if params.source is not None:
                            lv, fs_type = self._new_clone(pool, req, params, report)
                        else:
                            fs_type = params.fs_type or pool.default_fs_type
                            lv = self._new_lv(pool, req, fs_type, report)
            if created:
                source = lv.tag_value(TAG_SOURCE)
                log.info("created LV %s/%s (%d bytes) for volume %s in device class %s%s",
                         lv.vg, lv.name, lv.size, req.volume_id, pool.class_name,
                         f", a clone of {source}" if source else "")
            else:
                pool = self._check_existing(req, params, lv)
                fs_type = lv.tag_value(TAG_FS) or ""
            try:
                lv = self._converge(pool, req, lv, fs_type, params.mount_options)
            except BaseException:
                if created:  # a first create that failed leaves nothing behind
                    self._rollback(pool, req, lv)
                raise
            return req.path, lv.size

    def _placement(self, req: Request, params: Parameters,
                   asked: Pool) -> tuple[Pool, LogicalVolume | None]:
        """The pool to make the volume in, and the volume's LV if it exists in
        another class's volume group than that pool's.

        The placement rule the CSI plugin shares (volumes/placement.py): with
        the classes in one VG and no source, that pool's report (read under
        its lock) sees every LV of the name. Otherwise one `lvs` over the
        classes' volume groups first: a volume made earlier is where it is,
        whatever its parameters say now (Nomad repeats the create at every
        client start); a name with LVs in two volume groups is neither used
        nor made again; a volume group that is missing may hold the volume,
        so nothing is made until it is back; and a clone goes to its source's
        class, the only pool a thin snapshot of it can be in."""
        if not placement.needs_read(self.pools, params.source is not None):
            return asked, None
        if params.source is None:
            seen = placement.read(self.pools, [req.lv_name])
        else:  # a source may be named by its name, which only the tags say
            seen = placement.Seen(*self.pools.scan())
        try:
            found = placement.existing(seen, req.lv_name)
        except AmbiguousName as err:
            raise DhvError(f"volume {req.volume_id} has an LV in several volume groups ("
                           f"{', '.join(err.lvs)}); leaving them alone: remove or rename "
                           "the ones that are not the volume") from None
        except VolumeGroupMissing:
            raise VolumeGroupMissing(
                f"volume group {', '.join(seen.missing)} not found: volume {req.volume_id} "
                "(or its source) may be there, so nothing is made until it is back") from None
        if found is not None:
            owner, lv = found
            return owner or asked, lv
        if params.source is None:
            return asked, None
        kind, ref = params.source
        source = self._find_source([lv for _, lv in seen.lvs], kind, ref, req.namespace)
        try:
            placement.only(seen, source.name)
        except AmbiguousName as err:
            raise DhvError(f"source_{kind} {ref!r} has an LV in several volume groups ("
                           f"{', '.join(err.lvs)}); nothing is made from it: remove or "
                           "rename the ones that are not the source") from None
        return self.pools.pool_of_copy(source, params.device_class, f"source_{kind} {ref!r}",
                                       DEVICE_CLASS), None

    def _check_existing(self, req: Request, params: Parameters, lv: LogicalVolume) -> Pool:
        """The pool of the volume's existing LV, if the request may converge it:
        the same volume, in the class and from the source it names (if it names
        them), with the encryption and the file system it names (if it does)."""
        # What Nomad's repeat asks: only what the parameters name now (they
        # may leave out what the volume was made with).
        if _is_ours(lv, req):
            check_format(lv)  # ours, but a newer csi-local-dhv's: left alone
        try:
            pool = creation.check_repeat(
                self.pools, lv, ours=_is_ours(lv, req), device_class=params.device_class or None,
                same_source=_same_source(lv, params), encrypted=params.encryption,
                encrypted_tag=TAG_ENCRYPTED)
        except VolumeDiffers as err:
            raise DhvError(self._differs(err.difference, req, params, lv)) from None
        fs_type = lv.tag_value(TAG_FS) or ""
        if not fs_type:
            raise DhvError(f"LV {lv.vg}/{lv.name} has no {TAG_FS} tag")
        if params.fs_type and params.fs_type != fs_type:
            raise DhvError(
                f"volume {req.volume_id} has a {fs_type} file system; changing "
                f"fs_type to {params.fs_type} would need a reformat, which is refused"
            )
        return pool

    def _differs(self, difference: Difference, req: Request, params: Parameters,
                 lv: LogicalVolume) -> str:
        """The host volume plugin's words for a volume that exists and differs:
        what Nomad's operator may do about it."""
        if difference is Difference.NOT_OURS:
            return _not_ours(lv, req)
        if difference is Difference.NO_CLASS:
            return (f"volume {req.volume_id} is LV {lv.vg}/{lv.name}, in thin pool "
                    f"{lv.vg}/{lv.pool}, which is no device class of this node "
                    f"({', '.join(sorted(self.pools.names))}); leaving it alone")
        if difference is Difference.CLASS:
            return (f"volume {req.volume_id} exists in device class {self.class_of(lv)!r}, not "
                    f"{params.device_class!r}; a volume cannot change class (delete it first "
                    "to make it anew in another)")
        if difference is Difference.SOURCE:
            assert params.source is not None
            kind, ref = params.source
            made_from = lv.tag_value(TAG_SOURCE)
            was = f"was made from {made_from}" if made_from else "was not made from a source"
            return (f"volume {req.volume_id} exists and {was}; its source cannot change to "
                    f"{kind} {ref!r} (delete the volume first to make it anew)")
        return (f"volume {req.volume_id} {'is' if TAG_ENCRYPTED in lv.tags else 'is not'} "
                "encrypted; encryption cannot be turned on or off for an existing volume")

    def _new_lv(self, pool: Pool, req: Request, fs_type: str,
                report: VgReport) -> LogicalVolume:
        """A new thin LV for the volume (inside `pool.reserved()`)."""
        assert req.parameters is not None
        encrypted = encryption.new_volume_tags(req.parameters.encryption,
                                               pool.encrypted_by_default, TAG_ENCRYPTED, None)
        size = sizes.size_for(
            req.capacity_min, req.capacity_max, report.extent_size,
            default=self.config.default_size,
            minimum=creation.smallest_size(pool, report, fsrules.min_size(fs_type),
                                           bool(encrypted)),
        )
        tags = volume_tags(req.volume_id, req.volume_name, req.namespace, fs_type)
        return pool.create_thin(report, req.lv_name, size, [*tags, *encrypted])

    def _new_clone(self, pool: Pool, req: Request, params: Parameters,
                   report: VgReport) -> tuple[LogicalVolume, str]:
        """A writable thin snapshot of the source the parameters name; returns it
        and its file system (the source's). Never formatted: it holds the
        source's file system as it was at the instant of the snapshot.

        Inside `pool.reserved()` of the source's pool: found and snapshotted
        against the one report read under the pool lock. The source's own lock
        is not needed: its first create formats it outside the pool lock but
        keeps the fresh tag until done (refused below), a grow of it takes the
        pool lock, and a delete racing with lvcreate either loses (the clone is
        independent) or makes it fail before anything exists."""
        assert params.source is not None
        kind, ref = params.source
        source = self._find_source(report.lvs, kind, ref, req.namespace)
        if self.pools.pool_of_copy(source, params.device_class, f"source_{kind} {ref!r}",
                                       DEVICE_CLASS) is not pool:
            raise DhvError(f"source_{kind} {ref!r} moved to another device class while "
                           "the clone was being made; create it again")
        fs_type = source.tag_value(TAG_FS) or ""
        if fs_type not in fsrules.SUPPORTED_FS:
            raise DhvError(f"source LV {source.vg}/{source.name} has no usable "
                           f"{TAG_FS} tag ({fs_type!r})")
        if params.fs_type and params.fs_type != fs_type:
            raise DhvError(
                f"the source holds a {fs_type} file system, not {params.fs_type}; a "
                "clone keeps its source's file system (leave fs_type out)"
            )
        try:
            # What a copy is: its source's encryption (the clone step carries
            # the tag), and at least its size.
            encryption.new_volume_tags(params.encryption, pool.encrypted_by_default,
                                       TAG_ENCRYPTED, source)
            creation.check_copy_limit(source, req.capacity_max, "capacity_max")
        except SourceMismatch:
            raise DhvError(
                f"the source {'is' if TAG_ENCRYPTED in source.tags else 'is not'} encrypted, "
                "and a clone is what its source is (its LUKS2 header and key included); "
                "leave encryption out") from None
        except SizeOutOfRange:
            raise DhvError(
                f"the source is {source.size} bytes, more than capacity_max "
                f"{req.capacity_max}; a clone is at least as large as its source") from None
        # Made at once at the size capacity_min asks for (whole extents).
        size = sizes.grow_target(source.size, req.capacity_min, req.capacity_max,
                                 report.extent_size)
        tags = volume_tags(req.volume_id, req.volume_name, req.namespace, fs_type,
                           _source_ref(source))
        if kind == "volume":
            # Its name too: a repeated create may name the source either way.
            tags += hex_tag(TAG_SOURCE_NAME, decode_hex_tag(source.tag_value(TAG_NAME)) or "")
        return self.steps.clone(pool, report, source, req.lv_name, tags, size), fs_type

    def _find_source(self, lvs: Sequence[LogicalVolume], kind: str, ref: str,
                     namespace: str) -> LogicalVolume:
        """The LV of the volume (by Nomad ID, else by name) or snapshot `ref`, in
        `namespace`, among `lvs`; a clear error for anything else."""
        where = self._where()
        if kind == "snapshot":
            snap_lv = snapshot_lv_name(ref)
            lv = next((x for x in lvs if x.name == snap_lv), None)
            if lv is None or lv.tag_value(TAG_KIND) != KIND_SNAPSHOT \
                    or lv.tag_value(TAG_SNAPSHOT) != ref:
                raise DhvError(f"source_snapshot {ref!r} not found in {where} (see "
                               "`csi-local-dhv snapshot list`)")
            what = f"snapshot {ref!r}"
        else:
            lv = None
            try:
                id_lv: str | None = lv_name_for(ref)
            except DhvError:  # not shaped like a volume ID: a name
                id_lv = None
            by_id = next((x for x in lvs if x.name == id_lv), None)
            if by_id is not None and by_id.tag_value(TAG_KIND) == KIND_VOLUME \
                    and by_id.tag_value(TAG_ID) == ref:
                lv = by_id
            else:
                named = [x for x in lvs if x.tag_value(TAG_KIND) == KIND_VOLUME
                         and decode_hex_tag(x.tag_value(TAG_NAME)) == ref
                         and _namespace(x) == namespace]
                if len(named) > 1:
                    raise DhvError(f"source_volume {ref!r} names {len(named)} host volumes in "
                                   f"namespace {namespace!r}; give its ID instead")
                lv = named[0] if named else None
                if lv is None:
                    elsewhere = sorted({_namespace(x) for x in lvs
                                        if x.tag_value(TAG_KIND) == KIND_VOLUME
                                        and decode_hex_tag(x.tag_value(TAG_NAME)) == ref})
                    if elsewhere:
                        raise DhvError(
                            f"source volume {ref!r} is in namespace "
                            f"{', '.join(map(repr, elsewhere))}, not {namespace!r}; a clone's "
                            "source must be in its own namespace")
            if lv is None:
                raise DhvError(f"source_volume {ref!r}: no host volume with that ID, or that "
                               f"name in namespace {namespace!r}, in {where}")
            if TAG_FRESH in lv.tags:
                raise DhvError(f"source_volume {ref!r} was never formatted (its first create "
                               "has not finished); create it first")
            what = f"volume {ref!r}"
        if _namespace(lv) != namespace:
            raise DhvError(f"source {what} is in namespace {_namespace(lv)!r}, not "
                           f"{namespace!r}; a clone's source must be in its own namespace")
        check_format(lv)  # a newer csi-local-dhv's: not copied
        return lv

    def _converge(self, pool: Pool, req: Request, lv: LogicalVolume, fs_type: str,
                  mount_options: Sequence[str]) -> LogicalVolume:
        """Activate, format (once), grow and mount the volume's LV, of `pool`."""
        lvm = pool.lvm
        if not lv.active:
            lv = lvm.activate(lv)
        self.host.wait_for_device(lv.path, timeout=min(30.0, self.deadline.left()))
        lv = self._grow_lv(pool, req, lv)
        key = self._key(req, pool, lv)
        self._mount(lvm, req, lv, fs_type, mount_options, key)
        if TAG_GROW_FS in lv.tags:
            self.steps.grow_device(lv, key)  # an open dm-crypt device grows to its LV
        if self.steps.grow_pending(lvm, lv, req.path, fs_type):
            lv = lvm.get(lv.name)
            log.info("grew the %s file system of %s to %d bytes", fs_type, lv.name, lv.size)
        return lv

    def _key(self, req: Request, pool: Pool, lv: LogicalVolume) -> Key | None:
        """An encrypted volume's key, from the key file the configuration
        names for it or its class; None for a volume that is not encrypted."""
        if not self.steps.is_encrypted(lv):
            return None
        path = self.config.key_file(req.volume_id, pool.class_name)
        if path is None:
            raise DhvError(
                f"volume {req.volume_id} is encrypted, and the configuration names no key "
                f"file for it: add \"volume:{req.volume_id}\" or \"class:{pool.class_name}\" "
                "to encryption_key_files (docs/encryption.md)")
        return read_key_file(path)

    def _grow_lv(self, pool: Pool, req: Request, lv: LogicalVolume) -> LogicalVolume:
        """The LV grown to capacity_min (a shrink is refused); the grow-fs tag goes
        on before lvextend, so a run killed after it still grows the file system."""
        grown = pool.grow(
            lv, req.capacity_min, req.capacity_max, timeout=self._lock_timeout(),
            before=lambda: pool.lvm.add_tags(lv.name, [TAG_GROW_FS]))
        if grown.size != lv.size:
            log.info("extended LV %s to %d bytes", lv.name, grown.size)
            # As `before` tagged it (the pool describes the LV it grew without a
            # report after lvextend).
            grown = dataclasses.replace(grown, tags=grown.tags | {TAG_GROW_FS})
        return grown

    def _mount(self, lvm: Lvm, req: Request, lv: LogicalVolume, fs_type: str,
               options: Sequence[str], key: Key | None) -> None:
        os.makedirs(req.volumes_dir, mode=0o711, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(req.path, 0o755)
        major, minor = device_numbers(self.host, lv)
        top = self.host.top_mount(req.path)
        if top is None:
            self.steps.first_mount(lvm, lv, req.path, fs_type, options, key)
            log.info("mounted %s at %s", lv.path, req.path)
        elif not self.host.shows_device(top, major, minor):
            raise DhvError(
                f"{req.path} is already a mount point of another device ({top.source}); "
                "refusing to mount over it"
            )

    def _rollback(self, pool: Pool, req: Request, lv: LogicalVolume) -> None:
        """Best effort: undo what this run's failed first create made, in
        reverse order: the mount at the volume's path, an encrypted volume's
        dm-crypt device, the new LV, the directory. Each step is tried
        whatever became of the one before (a step that cannot be done fails
        and is logged: lvremove refuses a mounted or open LV); the original
        error is the one reported."""
        where = f"the failed create of {req.volume_id}"
        try:
            numbers: tuple[int, int] | None = device_numbers(self.host, lv)
        except Exception:  # no device node (it never appeared): nothing is mounted
            numbers = None
        with _undoing(where, "unmount"):
            if numbers is not None and self.host.device_mounted_at(req.path, *numbers):
                self.fs.umount(req.path, device=numbers)
        if self.steps.is_encrypted(lv):
            with _undoing(where, "close its dm-crypt device"):
                self.steps.close_over(lv)
        with _undoing(where, "lvremove"):
            if numbers is None or not self.host.mounts_of(*numbers):  # never under a mount
                pool.lvm.remove(lv.name)
        with _undoing(where, "rmdir"):
            if not self.host.is_mount_point(req.path):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(req.path)

    # snapshots ---------------------------------------------------------------
    # Nomad has no snapshot verb for host volumes: `csi-local-dhv snapshot`
    # runs these for an operator. A snapshot is a thin snapshot LV, inactive
    # like the CSI plugin's, that clones are made from.

    def snapshot_create(self, volume_id: str, name: str,
                        device_class: str | None = None) -> LogicalVolume:
        """A snapshot `name` of host volume `volume_id` (the same one again if it
        exists already), in the volume's device class: `device_class`, if
        given, must be that class."""
        self.thaw_leftovers()
        lv_name = lv_name_for(volume_id)
        snap_lv = snapshot_lv_name(name)
        if device_class is not None:
            self.pools.select(device_class)  # unknown: refused, nothing done
        # The volume's lock: not while its first create formats it, nor while
        # delete takes it down. The snapshot's: one create of a name at a time.
        with self._hold(lv_name), self._hold(snap_lv):
            pool, existing, located = self._locate_snapshot(snap_lv, lv_name, volume_id, name)
            if existing is not None:
                _check_snapshot(existing, name)
                if existing.tag_value(TAG_SOURCE) != f"volume:{volume_id}":
                    raise DhvError(
                        f"snapshot {name!r} exists already, of "
                        f"{existing.tag_value(TAG_SOURCE)}; snapshot names are unique in "
                        f"{self._where()}")
                self.pools.pool_of_copy(existing, device_class, f"snapshot {name!r}",
                                        DEVICE_CLASS)
                return existing
            with pool.reserved(self._lock_timeout()) as report:
                volume = report.find(lv_name) or located
                if volume is None or volume.tag_value(TAG_KIND) != KIND_VOLUME \
                        or volume.tag_value(TAG_ID) != volume_id:
                    raise DhvError(f"host volume {volume_id!r} not found in {self._where()}")
                check_format(volume)
                if TAG_FRESH in volume.tags:
                    raise DhvError(f"host volume {volume_id!r} was never formatted (its first "
                                   "create has not finished)")
                # One in no class of this node is refused here, not "not found".
                if self.pools.pool_of_copy(volume, device_class, f"host volume {volume_id!r}",
                                           DEVICE_CLASS) is not pool:
                    raise DhvError(f"host volume {volume_id!r} not found in {self._where()}")
                tags = snapshot_tags(name, volume_id, volume.tag_value(TAG_FS) or "",
                                     _namespace(volume))
                snap = self.steps.snapshot(pool, report, volume, snap_lv, tags)
        log.info("snapshot %s of volume %s: LV %s/%s (device class %s)", name, volume_id,
                 snap.vg, snap.name, pool.class_name)
        return snap

    def _locate_snapshot(self, snap_lv: str, lv_name: str, volume_id: str, name: str
                         ) -> tuple[Pool, LogicalVolume | None, LogicalVolume | None]:
        """The pool a snapshot of the volume `lv_name` is (or would be) in, the
        snapshot's LV if it exists, and the volume's LV if found in another VG
        than that pool's. With several classes, one `lvs` over their volume
        groups, placed by the rule the CSI plugin shares (volumes/placement.py):
        a name with LVs in two volume groups is refused, and so is a snapshot
        found nowhere while a volume group that may hold it is missing."""
        pool = self.pools.default
        if not placement.needs_read(self.pools, True):
            return pool, pool.lvm.find(snap_lv), None
        seen = placement.read(self.pools, [snap_lv, lv_name])
        try:
            snap = placement.existing(seen, snap_lv)
        except AmbiguousName as err:
            raise DhvError(f"snapshot {name!r} has an LV in several volume groups ("
                           f"{', '.join(err.lvs)}); leaving them alone: remove or rename the "
                           "ones that are not the snapshot") from None
        except VolumeGroupMissing:
            raise VolumeGroupMissing(
                f"volume group {', '.join(seen.missing)} not found: the volume or a snapshot "
                "of that name may be there, so nothing is made until it is back") from None
        if snap is not None:
            return snap[0] or pool, snap[1], None
        try:
            volume = placement.only(seen, lv_name)
        except AmbiguousName as err:
            raise DhvError(f"host volume {volume_id!r} has an LV in several volume groups ("
                           f"{', '.join(err.lvs)}); nothing is made from it: remove or rename "
                           "the ones that are not the volume") from None
        if volume is None:
            return pool, None, None
        return volume[0] or pool, None, volume[1]

    def snapshot_delete(self, name: str) -> bool:
        """Remove snapshot `name`; False when it was gone already. Its clones
        are thin LVs of their own and keep working. A volume group that is
        missing may hold it: VolumeGroupMissing then, never "gone"."""
        self.thaw_leftovers()
        snap_lv = snapshot_lv_name(name)
        with self._hold(snap_lv):
            found = self.pools.find(snap_lv)
            if found is None:
                return False
            pool, lv = found
            _check_snapshot(lv, name)
            removed = pool.lvm.remove(snap_lv)
        log.info("removed snapshot %s (LV %s/%s)", name, lv.vg, lv.name)
        return removed

    def snapshots(self, volume_id: str | None = None) -> list[LogicalVolume]:
        """The host volume snapshots in every class's pool, of `volume_id` if given."""
        lvs, missing = self.pools.scan()
        if missing:
            log.warning("volume group %s not found: its snapshots are not listed",
                        ", ".join(missing))
        found = [lv for pool, lv in lvs if pool is not None
                 and lv.tag_value(TAG_KIND) == KIND_SNAPSHOT
                 and lv.tag_value(TAG_SNAPSHOT) is not None]
        if volume_id is not None:
            found = [lv for lv in found if lv.tag_value(TAG_SOURCE) == f"volume:{volume_id}"]
        return sorted(found, key=lambda lv: (lv.created, lv.tag_value(TAG_SNAPSHOT) or ""))

    # delete ------------------------------------------------------------------

    def delete(self, req: Request) -> None:
        """Unmount, lvremove and rmdir; a no-op for what is already gone. The LV
        is looked for in every class (one `lvs`); a class whose volume group is
        missing may hold it, so delete then fails (VolumeGroupMissing) rather
        than call the volume gone."""
        self.thaw_leftovers()
        with self._hold(req.lv_name):
            found = self.pools.find(req.lv_name)
            if found is not None:
                _check_ours(found[1], req)
            self.removal.remove(req, found)


@contextlib.contextmanager
def _undoing(what: str, step: str) -> Iterator[None]:
    """One step of a rollback: a failure is logged, never raised (the error
    that made the rollback is the one to report)."""
    try:
        yield
    except Exception as err:
        log.warning("could not undo %s (%s): %s", what, step, err)


def _is_ours(lv: LogicalVolume, req: Request) -> bool:
    """Whether `lv` is this plugin's LV of the request's volume."""
    return lv.tag_value(TAG_KIND) == KIND_VOLUME and lv.tag_value(TAG_ID) == req.volume_id


def _not_ours(lv: LogicalVolume, req: Request) -> str:
    return (f"LV {lv.vg}/{lv.name} exists but is not host volume {req.volume_id} made by "
            "this plugin; leaving it alone")


def _check_ours(lv: LogicalVolume, req: Request) -> None:
    if not _is_ours(lv, req):
        raise DhvError(_not_ours(lv, req))
    check_format(lv)  # ours, but a newer csi-local-dhv's: left alone too


def _check_snapshot(lv: LogicalVolume, name: str) -> None:
    if lv.tag_value(TAG_KIND) != KIND_SNAPSHOT or lv.tag_value(TAG_SNAPSHOT) != name:
        raise DhvError(f"LV {lv.vg}/{lv.name} exists but is not snapshot {name!r} made by "
                       "this plugin; leaving it alone")
    check_format(lv)


def _namespace(lv: LogicalVolume) -> str:
    return decode_hex_tag(lv.tag_value(TAG_NAMESPACE)) or ""


def _source_ref(source: LogicalVolume) -> str:
    """The source tag of a clone of `source`: "volume:<ID>" or "snapshot:<name>"."""
    if source.tag_value(TAG_KIND) == KIND_SNAPSHOT:
        return f"snapshot:{source.tag_value(TAG_SNAPSHOT)}"
    return f"volume:{source.tag_value(TAG_ID)}"


def _same_source(lv: LogicalVolume, params: Parameters) -> bool:
    """Whether an existing volume was made from the source the parameters name
    (by its ID or, as the first create named it, its name). Checked against
    its tags, never by looking the source up again: Nomad repeats the create
    request at every client start, also after the source is gone."""
    if params.source is None:
        return True  # a volume's parameters may drop the source once it is made
    kind, ref = params.source
    made_from = lv.tag_value(TAG_SOURCE)
    if made_from == f"{kind}:{ref}":
        return True
    return (kind == "volume" and made_from is not None and made_from.startswith("volume:")
            and decode_hex_tag(lv.tag_value(TAG_SOURCE_NAME)) == ref)


