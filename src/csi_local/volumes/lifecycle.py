"""The steps a volume takes in both plugins, in one place: flush a mounted
source, take a snapshot, make a clone, and prepare a first mount (format
only what was never handed out, give a clone's file system an identity of
its own, mount, grow the file system after an extend, clear the tags).

The CSI plugin (csi/) and the host volume plugin (dhv/) call these and keep
no copy of their own: each brings its own tag names (StepTags) and, for the
CSI plugin, its record of an unfinished mkfs (FormatMarks, the node's state
file). Transport-free: errors are the storage layer's (csi_local.errors);
each front end maps them.

Two rules the plugins once decided differently, decided here:

- Every clone (of a volume or of a snapshot) is tagged new-fsid, whatever
  its file system, and its first mount gives it an identity of its own as
  that file system allows (Filesystems.new_fsid: btrfstune for btrfs; xfs
  is mounted with nouuid, as xfs_admin cannot change a snapshot's dirty
  log; ext4 keeps its UUID: the kernel mounts duplicates, and tune2fs -U
  wants a freshly checked file system, which a copy of a mounted one is
  not). The host volume plugin tagged only btrfs
  clones, the CSI plugin every clone: the CSI controller cannot know a
  clone's file system (only the stage reads it), and one rule keeps the
  decision per file system in one home, Filesystems.new_fsid.
- A volume may be formatted only with proof that it holds nothing of
  anyone's: the kernel's count of the blocks its thin device maps (0: it
  reads as zeros), or, while that count can be read, the plugin's own mark
  that its mkfs of it started and never finished (the CSI node's state
  file; the host volume plugin's fresh tag, set at lvcreate and dropped
  after mkfs, before the volume is ever handed out; an older CSI version's
  fresh tag). A volume whose count cannot be read is never formatted.
  See freshness().
- An encrypted volume (volumes/encryption.py) takes the same rule one step
  earlier: its LUKS2 header is written (luksFormat) only with the same proof,
  and then the file system on its dm-crypt device with it. A volume with a
  header is opened, never formatted again; one that is to be encrypted, has
  no header and holds data is refused (EncryptionMismatch) without a write.
  From CreateVolume to its first stage a new encrypted volume holds a
  placeholder header that no key opens (written only while the volume maps
  no block): csi-local versions from before encryption refuse to mkfs a
  device with a signature, where a bare LV would have taken their
  plain-text file system. Its first stage formats it for real while the
  placeholder is all it holds (the header's label, and no block mapped past
  the placeholder's chunks). See write_placeholder.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from csi_local.errors import (
    CommandError,
    EncryptionMismatch,
    FreezeTimeout,
    KeyMissing,
    KeyRefused,
    StorageError,
    VolumeTooSmall,
)
from csi_local.host.crypt import (
    HEADER_BYTES,
    PLACEHOLDER_BYTES,
    PLACEHOLDER_LABEL,
    Crypt,
    Key,
    mapper_path,
)
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.mounts import Mount, mount_node
from csi_local.storage.lv_devices import thin_mapped_sectors
from csi_local.storage.lvm import LogicalVolume, Lvm, VgReport
from csi_local.volumes import encryption, naming
from csi_local.volumes import host_volume_names as hvn
from csi_local.volumes.freezes import Freezes
from csi_local.volumes.pool import Pool

log = logging.getLogger(__name__)

# A single snapshot's or clone's freeze window, by the LV it makes (both
# plugins' LV names are disjoint, and a group's windows are "group-take.").
FREEZE_PREFIX = "copy."

# Why an encrypted volume's device did not open, as the metrics name it; any
# other failure (cryptsetup's, the kernel's) is "error".
OPEN_FAILURES: dict[type[Exception], str] = {
    KeyRefused: "key_refused", KeyMissing: "key_missing", EncryptionMismatch: "mismatch"}
# A file system is grown at a stage when its device is at least this much
# larger: a tool's own rounding (whole blocks, xfs's smallest allocation
# group) leaves less behind, which no stage should try again and again.
GROW_SLACK = 1 << 20
# Every reason there is: the metrics export each from the start.
OPEN_FAILURE_REASONS = (*OPEN_FAILURES.values(), "error")


@dataclass(frozen=True)
class StepTags:
    """A plugin's names for the tags the steps set and clear."""

    fresh: str  # never handed out: the plugin's own mkfs may format it
    new_fsid: str  # a clone: its file system needs an identity of its own first
    grow_fs: str  # extended: its file system is grown at its next mount
    encrypted: str  # LUKS2: used through its dm-crypt device (carried to copies)


CSI_TAGS = StepTags(naming.TAG_FRESH, naming.TAG_NEW_FSID, naming.TAG_GROW_FS,
                    naming.TAG_ENCRYPTED)
DHV_TAGS = StepTags(hvn.TAG_FRESH, hvn.TAG_NEW_FSID, hvn.TAG_GROW_FS, hvn.TAG_ENCRYPTED)


class FormatMarks(Protocol):
    """Where a plugin records, durably, that its mkfs of an LV (by lv_uuid)
    started and has not finished (the CSI node's state file)."""

    def formatting(self, lv_uuid: str) -> bool: ...
    def mark_formatting(self, lv_uuid: str) -> None: ...
    def clear_formatting(self, lv_uuid: str) -> None: ...


@dataclass(frozen=True)
class Freshness:
    fresh: bool  # mkfs may write to it
    empty: bool  # it maps no block: it holds nothing at all (implies fresh)


def carried_tags(tags: StepTags, source: LogicalVolume) -> list[str]:
    """The tags a copy of `source` (a snapshot, a clone, a group's member)
    inherits: its grow-fs tag (its LV was extended and its file system not
    yet grown, so the copy's must grow), and its encryption tag (the copy
    holds its LUKS2 header)."""
    return [t for t in (tags.grow_fs, tags.encrypted) if t in source.tags]


class VolumeSteps:
    """The volume steps of one plugin: its file systems, its host, its tags
    and (the CSI node) its record of unfinished mkfs runs."""

    def __init__(self, fs: Filesystems, host: Kernel, tags: StepTags,
                 marks: FormatMarks | None = None, crypt: Crypt | None = None, *,
                 on_open_failure: Callable[[str], None] | None = None,
                 freezes: Freezes | None = None) -> None:
        self.fs = fs
        self.host = host
        self.tags = tags
        self.marks = marks
        self.crypt = crypt if crypt is not None else Crypt(fs.runner)
        # Told why an encrypted volume's device did not open (OPEN_FAILURES).
        self.on_open_failure = on_open_failure
        # The one freeze rule (volumes/freezes.py), for a snapshot or clone of a
        # mounted encrypted volume; a plugin that makes none may leave it out.
        self.freezes = freezes

    # snapshots and clones ------------------------------------------------------

    def device_mounts(self, lv: LogicalVolume,
                      table: list[Mount] | None = None) -> list[Mount]:
        """Every mount of the LV's device (none for an inactive LV): its file
        system's, and its node bound onto a file (a raw block volume staged or
        published). From the kernel's mount table, which no lost state write
        can make wrong."""
        if not lv.active or lv.kernel_major < 0:
            return []
        top = encryption.top_device(self.host, lv)  # an encrypted one's dm-crypt device
        return self.host.mounts_of(top.major, top.minor, table)

    def mounted_filesystem(self, lv: LogicalVolume,
                           table: list[Mount] | None = None) -> Mount | None:
        """Where the LV's file system is mounted (the first such mount), None
        when it is not: an inactive LV, a raw block volume whose node is only
        bound onto a file, or nothing at all. From the kernel's mount table,
        which no lost state write can make wrong."""
        return next((m for m in self.device_mounts(lv, table) if mount_node(m) is None), None)

    def flush(self, source: LogicalVolume) -> None:
        """syncfs a mounted source before a thin snapshot of it.

        LVM suspends the thin origin with device-mapper's lockfs for the
        instant of the snapshot, but that alone is not enough: a btrfs clone
        taken after an fsync, with the fsync's log tree not yet committed,
        fails to mount ("parent transid verify failed ... failed to read log
        tree"). syncfs commits the journal or the transaction first (one
        mount of a superblock is enough). An fsfreeze of our own around
        lvcreate is not possible: LVM's suspend of a frozen thin origin fails
        with EBUSY on Debian 12's kernel.
        """
        mount = self.mounted_filesystem(source)
        if mount is not None:
            self.fs.sync(mount.mount_point)

    @contextlib.contextmanager
    def _still(self, pool: Pool, source: LogicalVolume, name: str,
               what: str) -> Iterator[None]:
        """Flush a mounted source, and hold an encrypted one's file system
        frozen while the snapshot `name` is cut. LVM's lockfs suspend freezes
        a file system on the thin LV itself; an encrypted volume's is one
        device higher, on dm-crypt, where that suspend does not reach it, so
        it is frozen here (FIFREEZE, as fsfreeze does) under the one freeze
        rule (volumes/freezes.py): journaled first, thawed whatever happens,
        and for at most the freeze limit. Past the limit it is thawed while
        lvcreate still runs, and once lvcreate returns the snapshot is
        removed and FreezeTimeout raised: a snapshot cut after the thaw is
        no instant."""
        mount = self.mounted_filesystem(source)
        if mount is None:
            yield
            return
        self.fs.sync(mount.mount_point)
        if not self.is_encrypted(source):
            yield
            return
        if self.freezes is None:
            raise RuntimeError("a snapshot of a mounted encrypted volume needs the freeze rule")
        top = encryption.top_device(self.host, source)
        with self.freezes.window(f"{FREEZE_PREFIX}{name}",
                                 [(mount.mount_point, (top.major, top.minor))],
                                 f"{what} {name} of {source.vg}/{source.name}") as window:
            window.freeze_all()
            made = False
            try:
                yield
                made = True
                window.check()
            except FreezeTimeout:
                if made:
                    self._remove_late(pool, name)
                raise
            finally:
                window.close()

    @staticmethod
    def _remove_late(pool: Pool, name: str) -> None:
        """Remove a snapshot cut after its window's thaw; a failure is logged,
        never put in place of the FreezeTimeout the caller must see."""
        try:
            pool.lvm.remove(name)
        except StorageError as err:
            log.error("could not remove %s/%s, cut after its freeze was thawed: %s",
                      pool.lvm.vg, name, err.message)

    def _carried(self, source: LogicalVolume) -> list[str]:
        return carried_tags(self.tags, source)

    def snapshot(self, pool: Pool, report: VgReport, source: LogicalVolume, name: str,
                 tags: Sequence[str]) -> LogicalVolume:
        """A read-only thin snapshot `name` of `source` (inside `pool.reserved()`,
        against its `report`): admitted like a volume of the source's size (it
        may own every block once the source is rewritten), the source flushed
        first."""
        pool.admit(report, source.size)
        with self._still(pool, source, name, "snapshot"):
            made = pool.lvm.snapshot(source.name, name, [*tags, *self._carried(source)],
                                     writable_volume=False)
        return made

    def clone(self, pool: Pool, report: VgReport, source: LogicalVolume, name: str,
              tags: Sequence[str], size: int) -> LogicalVolume:
        """A new volume `name` of `size` bytes (at least the source's, whole
        extents) holding `source`'s file system as it was at this instant: a
        writable thin snapshot, extended to `size`. Inside `pool.reserved()`.

        Tagged new-fsid (see the module's text) and, when it is extended or
        its source's file system was not yet grown, grow-fs. An extend that
        fails removes the snapshot again: no stray LV."""
        pool.admit(report, size)
        tags = [*tags, self.tags.new_fsid, *self._carried(source)]
        if size > source.size and self.tags.grow_fs not in tags:
            tags.append(self.tags.grow_fs)
        # Described from what lvcreate was told (a thin snapshot has its origin's
        # size) and grown with one lvextend: no report after either.
        with self._still(pool, source, name, "clone"):
            lv = pool.lvm.snapshot(source.name, name, tags, writable_volume=True,
                                   read_back=False, size=source.size)
        try:
            return pool.lvm.extend_to(lv, size)
        except BaseException:
            pool.lvm.remove(name)
            raise

    # the first mount -----------------------------------------------------------

    def freshness(self, lv: LogicalVolume) -> Freshness:
        """Whether mkfs may write to the (active) volume, and whether it holds
        nothing at all.

        A thin volume that maps no block reads as zeros everywhere: formatting
        it loses nothing, whoever had it before. That is asked of the kernel
        (one ioctl, no process) and is proof. A volume that maps blocks is
        fresh only while the plugin's own mkfs of it is unfinished: its mark
        (FormatMarks) or its fresh tag. When the count cannot be read (a
        failed pool, an inactive LV), nothing proves the volume empty and the
        marks cannot be weighed against it: never formatted. This is the
        safer of what the plugins did (the host volume plugin formatted on its
        tag alone, the CSI node on its mark alone).
        """
        mapped = thin_mapped_sectors(self.host, lv.vg, lv.name)
        if mapped == 0:
            return Freshness(fresh=True, empty=True)
        if mapped is None:
            log.warning("cannot read how much of volume %s/%s is mapped; it is not formatted "
                        "(it may hold data)", lv.vg, lv.name)
            return Freshness(fresh=False, empty=False)
        marked = self.tags.fresh in lv.tags or (
            self.marks is not None and bool(lv.uuid) and self.marks.formatting(lv.uuid))
        return Freshness(fresh=marked, empty=False)

    def mark_used(self, lvm: Lvm, lv: LogicalVolume) -> None:
        """Once the volume is formatted or handed out raw, nothing may format it
        again: its formatting mark goes, and its fresh tag."""
        if self.marks is not None and lv.uuid:
            self.marks.clear_formatting(lv.uuid)
        if self.tags.fresh in lv.tags:
            lvm.delete_tags(lv.name, [self.tags.fresh])

    def _mark(self, lv: LogicalVolume, fresh: Freshness) -> None:
        if fresh.fresh and self.marks is not None and lv.uuid:
            # Before the first write: a run killed inside mkfs (or luksFormat)
            # may format again.
            self.marks.mark_formatting(lv.uuid)

    def format_once(self, lvm: Lvm, lv: LogicalVolume, fs_type: str,
                    device: str | None = None) -> str:
        """The file system on the volume (on `device`, its dm-crypt device
        when it is encrypted): made by mkfs only if the volume is fresh
        (Filesystems.ensure_filesystem has the rest of the rule); returns its
        type. The volume is then used: never formatted again."""
        fresh = self.freshness(lv)
        self._mark(lv, fresh)
        found = self.fs.ensure_filesystem(device or lv.path, fs_type, fresh=fresh.fresh,
                                          empty=fresh.empty and device in (None, lv.path),
                                          name=f"{lv.vg}/{lv.name}")
        self.mark_used(lvm, lv)
        return found

    def first_mount(self, lvm: Lvm, lv: LogicalVolume, target: str, fs_type: str,
                    options: Sequence[str], key: Key | None = None) -> str:
        """Open an encrypted volume (`key`), format (once), give a clone's file
        system its own identity, and mount the active volume at `target`,
        where it is not mounted yet; returns the file system's type. Each tag
        goes once its step is done, so a run killed part-way repeats only what
        is left; a failure closes a dm-crypt device this call opened."""
        device, opened = self.open_device(lv, key)
        try:
            found = self.format_once(lvm, lv, fs_type, device)
            if self.tags.new_fsid in lv.tags:
                # The source is on this node too, most likely mounted.
                self.fs.new_fsid(device, found)
                lvm.delete_tags(lv.name, [self.tags.new_fsid])
            self.fs.mount(device, target, found, list(options))
        except BaseException:
            if opened:
                self.close_device(lv.name)
            raise
        return found

    def grow_pending(self, lvm: Lvm, lv: LogicalVolume, mount_point: str,
                     fs_type: str) -> bool:
        """Grow the mounted file system to its extended LV when the LV says it
        is due (grow-fs tag), then drop the tag; True when it grew."""
        if self.tags.grow_fs not in lv.tags:
            return False
        self.fs.grow(encryption.top_device(self.host, lv).path, mount_point, fs_type)
        lvm.delete_tags(lv.name, [self.tags.grow_fs])
        return True

    def grow_to_device(self, lvm: Lvm, lv: LogicalVolume, mount_point: str, fs_type: str,
                       key: Key | None, *, was_open: bool) -> bool:
        """Offline growth, at a stage: the file system mounted at `mount_point`
        grows to its device when the device is larger (the LV was extended
        while nothing used it: a CO that expands an unused volume calls no
        node at all), as kubelet's resizefs does at mount. An encrypted
        volume's dm-crypt device grows to its LV first, when it was open
        before this stage (a device opened now spans the LV already).

        Measured, never assumed: the device's size against the file system's
        own count (Kernel.filesystem_size), and a tool runs only when the device
        is at least GROW_SLACK larger; only a device that is what is mounted
        there, read-write, is grown, and only ever grown. The grow-fs tag (a
        clone larger than its source) goes once its volume has grown. True
        when it grew."""
        top = encryption.top_device(self.host, lv)
        if top.encrypted and was_open:
            self._resize_open_device(lv, top.path, key)
        grew = False
        mount = self.host.top_mount(mount_point)
        if (mount is not None and not mount.read_only and not mount.fs_read_only
                and top.major >= 0 and self.host.shows_device(mount, top.major, top.minor)):
            size = self.host.filesystem_size(top.path, mount_point, fs_type)
            device = self.host.device_size(top.path)
            if size is not None and device - size >= GROW_SLACK:
                log.info("volume %s/%s: its %s file system spans %d of the %d bytes of %s; "
                         "growing it", lv.vg, lv.name, fs_type, size, device, top.path)
                self.fs.grow(top.path, mount_point, fs_type)
                grew = True
        if self.tags.grow_fs in lv.tags:
            lvm.delete_tags(lv.name, [self.tags.grow_fs])
        return grew

    def _resize_open_device(self, lv: LogicalVolume, path: str, key: Key | None) -> None:
        """Grow a dm-crypt device, open before this stage, to its grown LV:
        its size and its header's data offset against the LV's size. The
        header is read only when the LV is more than a default header larger
        than the device (no data offset is smaller): a stage's retry runs
        neither luksDump nor resize. Crypt.resize needs no key for a device whose volume key is
        in its dm-crypt table (one this plugin opened); a stage that reuses an
        open device has checked its key already (verify_key)."""
        lv_size, size = self.host.device_size(lv.path), self.host.device_size(path)
        if lv_size - size <= HEADER_BYTES or size >= lv_size - self.crypt.data_offset(lv.path):
            return
        try:
            self.crypt.resize(encryption.mapper_name(lv.name), key)
        except (KeyRefused, KeyMissing, CommandError) as err:
            self._tell_open_failure(err)
            raise

    # encryption ------------------------------------------------------------------

    def is_encrypted(self, lv: LogicalVolume) -> bool:
        return self.tags.encrypted in lv.tags

    def _open_over(self, lv: LogicalVolume) -> str | None:
        """The path of the volume's dm-crypt device when it is open over this
        LV; None when it is not open. EncryptionMismatch when a device of its
        name is open over something else (never used, never closed here). An
        LV described without its device numbers (as lvcreate was told, a new
        clone's) is known by its node's."""
        top = encryption.top_device(self.host, lv)
        if not top.encrypted:
            return None
        numbers: tuple[int, int] | None = (lv.kernel_major, lv.kernel_minor)
        if lv.kernel_major < 0:
            numbers = self.host.device_numbers(lv.path)
        if numbers is not None and numbers in self.host.underlying(top.major, top.minor):
            return top.path
        raise EncryptionMismatch(
            f"{top.path} is open, but not over volume {lv.vg}/{lv.name}; it is left alone")

    def _tell_open_failure(self, err: Exception) -> None:
        """Tell on_open_failure why a device did not open (or grow)."""
        if self.on_open_failure is not None:
            try:  # a failing counter never hides the failure it counts
                self.on_open_failure(OPEN_FAILURES.get(type(err), "error"))
            except Exception:
                log.exception("counting a failed open")

    @staticmethod
    def _need_key(lv: LogicalVolume, key: Key | None) -> Key:
        if key is None:
            raise KeyMissing(
                f"volume {lv.vg}/{lv.name} is encrypted: its key is needed, in the secret "
                f"{encryption.SECRET_KEY!r} (docs/encryption.md)")
        return key

    def verify_key(self, lv: LogicalVolume, key: Key | None) -> None:
        """For a volume already in use through its open dm-crypt device (a
        repeated stage): `key` must open its LUKS2 header, as at its first
        open (KeyMissing, KeyRefused; told to on_open_failure). Nothing for a
        volume that is not encrypted."""
        if not self.is_encrypted(lv):
            return
        try:
            self.crypt.verify(lv.path, self._need_key(lv, key))
        except (KeyRefused, KeyMissing, CommandError) as err:
            self._tell_open_failure(err)
            raise

    def open_device(self, lv: LogicalVolume, key: Key | None) -> tuple[str, bool]:
        """_open_device, telling on_open_failure why it failed."""
        try:
            return self._open_device(lv, key)
        except (KeyRefused, KeyMissing, EncryptionMismatch, VolumeTooSmall,
                CommandError) as err:
            self._tell_open_failure(err)
            raise

    def _open_device(self, lv: LogicalVolume, key: Key | None) -> tuple[str, bool]:
        """The device to use the active volume through: the LV itself, or for
        an encrypted volume its dm-crypt device, opened with `key` (and its
        LUKS2 header made first, only on a volume with the proof freshness()
        gives). Returns (path, whether this call opened it). A device open
        already (an earlier call's) is reused only once its header takes
        `key` (Crypt.verify): the open device itself proves nothing of it.

        A header whose keyslots refuse the key: KeyRefused, nothing written;
        unless the plugin's own luksFormat of this never handed out volume
        was cut short (its formatting mark or fresh tag, as for mkfs), which
        may leave a header without a keyslot: formatted again. No header and
        used before: EncryptionMismatch, nothing written."""
        if not self.is_encrypted(lv):
            return lv.path, False
        path = self._open_over(lv)
        if path is not None:
            # Opened by an earlier call (one killed before its mount, say):
            # reused only for the key that opens its header, as a first open.
            self.crypt.verify(lv.path, self._need_key(lv, key))
            return path, False
        key = self._need_key(lv, key)
        name = encryption.mapper_name(lv.name)
        luks = self.crypt.is_luks(lv.path)
        placeholder = luks and self.host.luks_label(lv.path) == PLACEHOLDER_LABEL
        if placeholder and self._placeholder_only(lv):
            # CreateVolume's placeholder header, nothing written past it: the
            # volume was never handed out, and no key opens the placeholder.
            path = self._format_and_open(lv, name, key, Freshness(fresh=True, empty=False))
        elif placeholder:
            raise EncryptionMismatch(
                f"volume {lv.vg}/{lv.name} holds the placeholder LUKS2 header of a volume "
                "never staged, and data written past it (handed out unencrypted, by a "
                "csi-local from before encryption?); refusing to format it: its data is "
                "left untouched")
        elif luks:
            try:
                path = self._open(lv, name, key)
            except (KeyRefused, CommandError):
                # A luksFormat killed part-way may leave a header whose keyslot
                # is missing or torn; only the plugin's own unfinished format
                # (never handed out) is formatted again.
                fresh = self.freshness(lv)
                if not fresh.fresh:
                    raise
                log.warning("volume %s/%s: the LUKS2 header of an unfinished format does "
                            "not open; formatting it again", lv.vg, lv.name)
                path = self._format_and_open(lv, name, key, fresh)
        else:
            fresh = self.freshness(lv)
            if not fresh.fresh:
                raise EncryptionMismatch(
                    f"volume {lv.vg}/{lv.name} is to be encrypted but has no LUKS2 header and "
                    "has been used before (it may hold data); refusing to format it: its "
                    "data is left untouched")
            path = self._format_and_open(lv, name, key, fresh)
        self.host.wait_for_device(path)
        return path, True

    def write_placeholder(self, lv: LogicalVolume) -> None:
        """Give a new encrypted volume the placeholder LUKS2 header
        (Crypt.format_placeholder) while its thin device maps no block (the
        proof that it holds nothing; a retry finds the header there and
        writes nothing). From CreateVolume on, no csi-local version takes it
        for a plain volume to format; its first stage formats it for real
        (_open_device, _placeholder_only)."""
        if not self.is_encrypted(lv):
            return
        self.host.wait_for_device(lv.path)
        mapped = thin_mapped_sectors(self.host, lv.vg, lv.name)
        if mapped == 0:
            self.crypt.format_placeholder(lv.path)
        elif mapped is None:
            # Not written blind: without the kernel's count nothing proves the
            # device holds nothing. The volume works as before; what it lacks
            # is the guard against a rollback to a version before encryption.
            log.warning("volume %s/%s: cannot read how much of it is mapped, so it gets no "
                        "placeholder LUKS2 header (docs/on-disk-format.md, \"Rolling back past "
                        "encryption\")", lv.vg, lv.name)

    def _placeholder_only(self, lv: LogicalVolume) -> bool:
        """Whether the volume, whose header's label says placeholder, holds
        that header and nothing else: its thin device maps no block past the
        chunks the placeholder wrote (the kernel's count, the same proof as
        freshness()'s). A volume handed out raw by a version that knows no
        encryption, and written, maps more."""
        mapped = thin_mapped_sectors(self.host, lv.vg, lv.name)
        chunk = self.host.optimal_io_size(lv.path) or PLACEHOLDER_BYTES
        reach = -(-PLACEHOLDER_BYTES // chunk) * chunk
        return mapped is not None and 0 < mapped * 512 <= reach

    def _format_and_open(self, lv: LogicalVolume, name: str, key: Key,
                         fresh: Freshness) -> str:
        self._mark(lv, fresh)
        self.crypt.format(lv.path, key)
        return self._open(lv, name, key)

    def _open(self, lv: LogicalVolume, name: str, key: Key) -> str:
        """crypt.open; when cryptsetup fails, VolumeTooSmall if the LV ends
        where its header's data starts, or before (cryptsetup's "Requested
        offset is beyond real size of device"): the header's own offset, read
        only then, since it is aligned to the pool's chunk size."""
        try:
            return self.crypt.open(lv.path, name, key)
        except CommandError:
            try:
                offset = self.crypt.data_offset(lv.path)
                size = self.host.device_size(lv.path)
            except (CommandError, OSError):
                offset = size = 0
            if offset and size <= offset:
                raise VolumeTooSmall(
                    f"volume {lv.vg}/{lv.name} is {size} bytes and the data behind its LUKS2 "
                    f"header starts at {offset}: nothing fits; expand the volume") from None
            raise

    def close_device(self, lv_name: str) -> bool:
        """Close the volume's dm-crypt device, if open; True when it was.
        Busy (still mounted): CommandError."""
        path = mapper_path(encryption.mapper_name(lv_name))
        if self.host.device_numbers(path) is None:
            return False
        self.crypt.close(encryption.mapper_name(lv_name))
        return True

    def close_over(self, lv: LogicalVolume) -> bool:
        """Close the volume's dm-crypt device when it is open over this LV;
        True when it was. One of its name over something else:
        EncryptionMismatch, left alone."""
        if self._open_over(lv) is None:
            return False
        self.crypt.close(encryption.mapper_name(lv.name))
        return True

    def grow_device(self, lv: LogicalVolume, key: Key | None) -> str:
        """_grow_device, telling on_open_failure why it failed: a resize asks
        for the key as an open does, and fails as one."""
        try:
            return self._grow_device(lv, key)
        except (KeyRefused, KeyMissing, EncryptionMismatch, CommandError) as err:
            self._tell_open_failure(err)
            raise

    def _grow_device(self, lv: LogicalVolume, key: Key | None) -> str:
        """After the LV grew: grow an encrypted volume's open dm-crypt device
        to it (cryptsetup resize, online); returns the path of the device to
        grow a file system on (the LV itself for a volume that is not
        encrypted, or whose dm-crypt device is not open: it takes the LV's
        size when opened).

        No key is needed for a device this plugin opened (its volume key is
        in its dm-crypt table: Crypt.open), which is how Nomad's
        NodeExpandVolume, without secrets, grows it. A key given must open
        the header (KeyRefused otherwise), as everywhere a key is given; a
        device whose volume key is in the kernel's keyring needs one
        (KeyMissing, Crypt.resize)."""
        if not self.is_encrypted(lv):
            return lv.path
        path = self._open_over(lv)
        if path is None:
            return lv.path
        if key is not None:
            self.crypt.verify(lv.path, key)
        self.crypt.resize(encryption.mapper_name(lv.name), key)
        return path
