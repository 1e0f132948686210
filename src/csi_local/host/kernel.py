"""What the kernel shows the plugins (the mount table, device nodes, loop
devices, device-mapper's devices and their status, the bytes of a block
device) and the mount calls they make, behind one object.

The node service, the file-system layer, state recovery, the host volume
plugin and the committed-metadata reader ask these questions through a
`Kernel`, never through /proc, /dev or an ioctl directly, so a unit test can
hand them a fake host (a mount table and devices, their bytes included, in
memory) and run every branch of NodeStageVolume in milliseconds. The real
proof stays the integration suite in the VM.

The Kernel knows nothing of LVM: it reads N bytes of a device, or the status
of a device-mapper device by its name; what LVM's names, layouts and
stacked devices mean is storage/'s (storage/vg_text.py, storage/lv_devices.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from csi_local.errors import DeviceMissing, SyscallError
from csi_local.host import mounts
from csi_local.host.mounts import Mount

if TYPE_CHECKING:
    from csi_local.host.device_mapper import DmDevice, Target

log = logging.getLogger(__name__)

# linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
_FIFREEZE = 0xC0045877
_FITHAW = 0xC0045878
# xfs/xfs_fs.h: _IOR('X', 100, struct xfs_fsop_geom_v1), 112 bytes: blocksize
# (u32) first, datablocks (u64) at byte 32, in the host's byte order.
_XFS_IOC_FSGEOMETRY_V1 = 0x80705864
_XFS_GEOMETRY_V1 = 112
# ext4's superblock, 1024 bytes into the device: its fields, little-endian.
_EXT4_SUPERBLOCK = 1024
_EXT4_MAGIC = 0xEF53
_EXT4_64BIT = 0x80  # s_feature_incompat: s_blocks_count_hi is used
# btrfs's superblock, 64 KiB into the device: its magic and total_bytes.
_BTRFS_SUPERBLOCK = 64 << 10
_BTRFS_MAGIC = b"_BHRfS_M"
_DIRECT_ALIGN = 4096  # O_DIRECT's alignment: the largest logical block size there is

# linux/mount.h: the flags of mount(2) that mount(8) passes.
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_REMOUNT = 32
MS_MANDLOCK = 64
MS_DIRSYNC = 128
MS_NOSYMFOLLOW = 256
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_SILENT = 1 << 15
MS_RELATIME = 1 << 21
MS_I_VERSION = 1 << 23
MS_STRICTATIME = 1 << 24
MS_LAZYTIME = 1 << 25
# What statvfs(2) reports of a mount (ST_*) and the MS_* flag that sets it.
# linux/statfs.h ST_NOSYMFOLLOW (8192) is not in Python's os module.
_FROM_STATVFS = ((os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID),
                 (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                 (os.ST_RELATIME, MS_RELATIME), (8192, MS_NOSYMFOLLOW))
# mount(8)'s names of per-mount options: the flag each sets, or clears (True).
# This is libmount's own map (optmap.c), and it is applied as libmount applies
# it: each option sets or clears its one flag, in order, and nothing else. In
# particular the atime options do not clear each other: `noatime,relatime`
# passes both flags, and the kernel decides (noatime wins over relatime,
# strictatime over both), whatever their order.
MOUNT_FLAGS: dict[str, tuple[int, bool]] = {
    "ro": (MS_RDONLY, False), "rw": (MS_RDONLY, True),
    "nosuid": (MS_NOSUID, False), "suid": (MS_NOSUID, True),
    "nodev": (MS_NODEV, False), "dev": (MS_NODEV, True),
    "noexec": (MS_NOEXEC, False), "exec": (MS_NOEXEC, True),
    "nosymfollow": (MS_NOSYMFOLLOW, False), "symfollow": (MS_NOSYMFOLLOW, True),
    "nodiratime": (MS_NODIRATIME, False), "diratime": (MS_NODIRATIME, True),
    "noatime": (MS_NOATIME, False), "atime": (MS_NOATIME, True),
    "relatime": (MS_RELATIME, False), "norelatime": (MS_RELATIME, True),
    "strictatime": (MS_STRICTATIME, False), "nostrictatime": (MS_STRICTATIME, True),
}


# A new mount's options that mount(8) (libmount) passes as flags of mount(2):
# the per-mount flags and these, which belong to the file system's superblock.
# `defaults` is no flag at all (rw, suid, dev, exec, async: the cleared ones).
_NEW_MOUNT_FLAGS: dict[str, tuple[int, bool]] = {
    **MOUNT_FLAGS,
    "defaults": (0, False),
    "sync": (MS_SYNCHRONOUS, False), "async": (MS_SYNCHRONOUS, True),
    "dirsync": (MS_DIRSYNC, False),
    "lazytime": (MS_LAZYTIME, False), "nolazytime": (MS_LAZYTIME, True),
    "iversion": (MS_I_VERSION, False), "noiversion": (MS_I_VERSION, True),
    "mand": (MS_MANDLOCK, False), "nomand": (MS_MANDLOCK, True),
    "silent": (MS_SILENT, False), "loud": (MS_SILENT, True),
}
# File-system options that csi-local adds itself (fs.py: xfs's nouuid), which
# mount(8) hands to the file system unchanged, as mount(2)'s data.
_FS_DATA = frozenset({"nouuid"})


def _apply(flags: int, options: Sequence[str], table: dict[str, tuple[int, bool]]) -> int:
    """`flags` with each option of `table` set or cleared in order, as libmount
    does; options not in `table` change nothing."""
    for opt in options:
        flag, clear = table.get(opt, (0, False))
        flags = flags & ~flag if clear else flags | flag
    return flags


def mount_call(options: Sequence[str]) -> tuple[int, str] | None:
    """(flags, data) of the mount(2) call that `mount -t T -o OPTIONS DEV DIR`
    makes, or None when an option is not one of those above: mount(8) knows
    many more (its own, such as nofail, and every file system's), and runs
    then. SELinux's context options are among those: mount(8) drops them when
    SELinux is disabled (the kernel would refuse them: EINVAL) and gives the
    kernel their raw form (libselinux's translation) when it is enabled.
    Nothing is passed that mount(8) would not pass: no option at all is flags
    0, as `mount -t T DEV DIR` calls it."""
    data: list[str] = []
    for opt in options:
        if opt in _FS_DATA:
            data.append(opt)
        elif opt not in _NEW_MOUNT_FLAGS:
            return None
    return _apply(0, options, _NEW_MOUNT_FLAGS), ",".join(data)


def remount_flags(current: int, options: Sequence[str], *, readonly: bool = False) -> int:
    """The mount(2) flags of a bind remount that applies `options` to a mount
    whose statvfs f_flag is `current`; with `readonly`, the mount is read-only
    whatever `options` say (a `rw` among them included).

    The kernel sets a bind mount's flags to exactly those of the remount, so
    whatever is not passed again is dropped: a read-only remount of a nosuid,
    nodev mount would quietly make it suid and dev. The mount's own flags are
    therefore carried over, then the options applied in order, as mount(8)
    applies them to the options the mount shows. Options that are not
    per-mount flags (a file system's own, such as discard) cannot change on a
    bind mount, and the kernel ignores them; so are they here.
    """
    flags = 0
    for st, ms in _FROM_STATVFS:
        if current & st:
            flags |= ms
    flags = _apply(flags, options, MOUNT_FLAGS)
    if not current & (os.ST_NOATIME | os.ST_RELATIME) and not flags & (
            MS_NOATIME | MS_RELATIME | MS_STRICTATIME):
        # A strictatime mount (statvfs has no flag for it) stays one unless an
        # option says otherwise: said, or the kernel would make it relatime.
        flags |= MS_STRICTATIME
    if readonly:
        flags |= MS_RDONLY
    return flags | MS_REMOUNT | MS_BIND


_LIBC: Any = None


def _libc() -> Any:
    """libc, loaded at the first mount call (ctypes is kept off the host volume
    plugin's fingerprint path), with the calls' C types declared: a flag word
    passed as a bare int would leave the upper half of an unsigned long unset."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                              ctypes.c_ulong, ctypes.c_void_p]
        lib.mount.restype = ctypes.c_int
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.umount2.restype = ctypes.c_int
        _LIBC = lib
    return _LIBC


def _syscall(call: str, args: Sequence[str], fn: str, *params: object) -> None:
    """Call libc's `fn`; SyscallError (named `call`, with `args`) when it fails.

    A mount is one system call: running mount(8) for it costs a process (and
    libmount's parsing), many times the call itself."""
    import ctypes  # loaded already by _libc()

    lib = _libc()
    ctypes.set_errno(0)
    if getattr(lib, fn)(*params) != 0:
        err = ctypes.get_errno()
        raise SyscallError(call, args, err, os.strerror(err))


class Kernel:
    """The real kernel, read through /proc/self/mountinfo, /dev and /sys."""

    # The primitives: a fake host overrides these and nothing else.

    def mounts(self) -> list[Mount]:
        """The mount table of this process's mount namespace, in mount order."""
        return mounts.read_mounts()

    def mounts_at_path(self, path: str) -> list[Mount]:
        """The mounts whose mount point is `path` (normalised), oldest first:
        mounts_at() of the live table, reading only what names `path`."""
        return mounts.read_mounts_at(path)

    def device_numbers(self, path: str) -> tuple[int, int] | None:
        """major:minor of the block device node at `path` (None: no such node)."""
        try:
            return mounts.device_numbers(path)
        except OSError:
            return None

    def loop_backing(self, node: str) -> str | None:
        """The backing file of a loop device node such as /dev/loop3, if attached."""
        return mounts.loop_backing(node)

    def underlying(self, major: int, minor: int) -> list[tuple[int, int]]:
        """The devices block device major:minor is stacked on (a dm-crypt
        device's LV), from /sys/dev/block/M:m/slaves; [] for none or no such
        device."""
        base = f"/sys/dev/block/{major}:{minor}/slaves"
        try:
            names = os.listdir(base)
        except OSError:
            return []
        found = []
        for name in sorted(names):
            try:
                with open(f"{base}/{name}/dev", encoding="ascii") as f:
                    major_s, _, minor_s = f.read().strip().partition(":")
                found.append((int(major_s), int(minor_s)))
            except (OSError, ValueError):
                continue
        return found

    def luks_label(self, path: str) -> str | None:
        """The label of the LUKS2 header on `path` (crypt.header_label); None
        when there is none."""
        from csi_local.host import crypt

        return crypt.header_label(path)

    def optimal_io_size(self, path: str) -> int:
        """The block device's optimal I/O size in bytes, as the kernel
        gives it (sysfs `queue/optimal_io_size`); a thin volume's is its
        pool's chunk size. 0 when unknown."""
        try:
            rdev = os.stat(path).st_rdev
            with open(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/queue/"
                      "optimal_io_size", encoding="ascii") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return 0

    def device_size(self, path: str) -> int:
        """Bytes of the block device at `path`."""
        with open(path, "rb") as f:
            return f.seek(0, os.SEEK_END)

    def filesystem_size(self, device: str, mount_point: str, fs_type: str) -> int | None:
        """Bytes the file system mounted at `mount_point` spans on `device`, as
        the file system itself counts them (what resize2fs, xfs_growfs and
        `btrfs filesystem resize` change); None when it cannot tell.

        Not statvfs: ext4's and xfs's f_blocks leave out the space their own
        metadata (the journal, the log) takes, and btrfs's divides by its
        data profile's copies, so a file system as large as its device would
        look smaller. ext4 and btrfs: the superblock, read through the device
        (the page cache the mounted file system writes its superblock
        through); xfs: its geometry (the ioctl xfs_info asks)."""
        try:
            if fs_type == "ext4":
                return _ext4_size(device)
            if fs_type == "xfs":
                return _xfs_size(mount_point)
            if fs_type == "btrfs":
                return _btrfs_size(device)
        except (OSError, struct.error) as err:
            log.warning("cannot read the size of the %s file system at %s: %s", fs_type,
                        mount_point, err)
        return None

    def freeze(self, mount_point: str) -> None:
        """FIFREEZE the file system mounted at `mount_point`: its dirty data is
        written and every new write waits until `thaw`. OSError as the kernel
        says it (EBUSY: frozen already; EOPNOTSUPP: cannot freeze)."""
        fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _FIFREEZE, 0)
        finally:
            os.close(fd)

    def thaw(self, mount_point: str) -> bool:
        """FITHAW; False when the file system was not frozen (EINVAL)."""
        fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _FITHAW, 0)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.close(fd)
        return True

    def read_error(self, path: str, length: int = 1 << 20) -> str | None:
        """Why the first `length` bytes of `path` cannot be read, or None when
        they can: blkid's "nothing found" is trusted only for a readable device."""
        try:
            with open(path, "rb", buffering=0) as f:
                f.read(length)
        except OSError as err:
            return err.strerror or str(err)
        return None

    def read_device(self, path: str, offset: int, length: int) -> bytes:
        """`length` bytes of block device `path` from byte `offset`, read with
        O_DIRECT, past the page cache (a writer that bypasses the cache, as
        LVM writes its metadata, would otherwise be read stale); fewer bytes
        at the device's end.
        A file that takes no direct I/O (an image on tmpfs) is read through
        the cache. OSError as open(2) or the read fails."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # O_DIRECT: the offset, the length and the buffer aligned to the block.
            start = offset - offset % _DIRECT_ALIGN
            span = -(-(offset + length - start) // _DIRECT_ALIGN) * _DIRECT_ALIGN
            with mmap.mmap(-1, span) as buf:  # page-aligned
                got = os.preadv(fd, [buf], start)
                end = min(got, offset - start + length)
                return bytes(buf[offset - start:end]) if end > offset - start else b""
        finally:
            os.close(fd)

    def dm_device(self, name: str) -> DmDevice | None:
        """Device-mapper device `name` (its numbers, open count, whether a
        table is live), None when there is none; one ioctl."""
        from csi_local.host import device_mapper as dm

        return dm.device(name)

    def dm_devices(self) -> dict[str, tuple[int, int]]:
        """{name: (major, minor)} of every device-mapper device; one ioctl."""
        from csi_local.host import device_mapper as dm

        return dm.devices()

    def dm_status(self, name: str) -> list[Target] | None:
        """The targets of device-mapper device `name`'s live table with their
        status text (what `dmsetup status` prints); [] when no table is live,
        None when there is no such device; one ioctl."""
        from csi_local.host import device_mapper as dm

        return dm.status(name)

    def mount_filesystem(self, device: str, target: str, fs_type: str,
                         options: Sequence[str]) -> bool:
        """mount -t FS_TYPE -o OPTIONS DEVICE TARGET as the one system call
        mount(8) would make; False (nothing done) when `options` need mount(8)
        itself (see mount_call)."""
        call = mount_call(options)
        if call is None:
            return False
        flags, data = call
        _syscall("mount(2)", (device, target, fs_type, ",".join(options)), "mount",
                 os.fsencode(device), os.fsencode(target), fs_type.encode(), flags,
                 data.encode() if data else None)
        return True

    def bind_mount(self, source: str, target: str) -> None:
        """mount --bind: `source` (a directory, a file or a device node) at `target`."""
        _syscall("mount(2) MS_BIND", (source, target), "mount",
                 os.fsencode(source), os.fsencode(target), None, MS_BIND, None)

    def remount_bind(self, target: str, options: Sequence[str], *,
                     readonly: bool = False) -> None:
        """mount -o remount,bind,OPTIONS[,ro]: change the per-mount flags of the
        mount at `target`, keeping those `options` do not name; `readonly`
        wins over every option (see remount_flags)."""
        flags = remount_flags(os.statvfs(target).f_flag, options, readonly=readonly)
        shown = [*options, *(["ro"] if readonly else [])]
        _syscall("mount(2) MS_REMOUNT|MS_BIND", (target, ",".join(shown)), "mount",
                 None, os.fsencode(target), None, flags, None)

    def unmount(self, target: str) -> None:
        """umount: take down the mount visible at `target` (EINVAL: none there;
        EBUSY: in use)."""
        _syscall("umount2(2)", (target,), "umount2", os.fsencode(target), 0)

    def wait_for_device(self, path: str, timeout: float = 30.0) -> None:
        """Return once udev has made `path`; DeviceMissing after `timeout` seconds.

        Listens to udev instead of sleeping in a loop."""
        if os.path.exists(path):
            return
        import pyudev  # kept off import paths that must start fast

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context)
        monitor.filter_by(subsystem="block")
        monitor.start()
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeviceMissing(f"device {path} did not appear within {timeout:.0f}s")
            monitor.poll(timeout=min(left, 1.0))

    # Derived questions, the same for the real and a fake host.

    def mounts_at(self, path: str, table: list[Mount] | None = None) -> list[Mount]:
        """Mounts whose mount point is `path` (normalised), oldest first."""
        if table is None:
            return self.mounts_at_path(path)
        return mounts.mounts_at(path, table)

    def top_mount(self, path: str, table: list[Mount] | None = None) -> Mount | None:
        """The mount visible at `path` (the last one stacked there)."""
        found = self.mounts_at(path, table)
        return found[-1] if found else None

    def is_mount_point(self, path: str, table: list[Mount] | None = None) -> bool:
        return bool(self.mounts_at(path, table))

    def shows_device(self, mount: Mount, major: int, minor: int) -> bool:
        """Whether `mount` shows block device major:minor (see mounts.mount_is_device)."""
        return mounts.mount_is_device(mount, major, minor, numbers=self._numbers,
                                      backing=self.loop_backing)

    def device_mounted_at(self, path: str, major: int, minor: int,
                          table: list[Mount] | None = None) -> bool:
        """Whether the device is what is visible at `path` (a file system or a node bind)."""
        top = self.top_mount(path, table)
        return top is not None and major >= 0 and self.shows_device(top, major, minor)

    def mounts_of(self, major: int, minor: int,
                  table: list[Mount] | None = None) -> list[Mount]:
        """Every mount that shows the device, in mount order."""
        rows = self.mounts() if table is None else table
        return [m for m in rows if self.shows_device(m, major, minor)]

    def _numbers(self, path: str) -> tuple[int, int]:
        found = self.device_numbers(path)
        if found is None:
            raise FileNotFoundError(path)
        return found


def _read_at(device: str, length: int, offset: int) -> bytes:
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _ext4_size(device: str) -> int | None:
    sb = _read_at(device, 1024, _EXT4_SUPERBLOCK)
    magic: int = struct.unpack_from("<H", sb, 0x38)[0]
    if magic != _EXT4_MAGIC:
        return None
    blocks: int = struct.unpack_from("<I", sb, 0x04)[0]
    log_block: int = struct.unpack_from("<I", sb, 0x18)[0]
    incompat: int = struct.unpack_from("<I", sb, 0x60)[0]
    if incompat & _EXT4_64BIT:
        high: int = struct.unpack_from("<I", sb, 0x150)[0]
        blocks |= high << 32
    return blocks * (1024 << log_block)


def _btrfs_size(device: str) -> int | None:
    sb = _read_at(device, 0x80, _BTRFS_SUPERBLOCK)
    if sb[0x40:0x48] != _BTRFS_MAGIC:
        return None
    total: int = struct.unpack_from("<Q", sb, 0x70)[0]  # one device: its bytes
    return total


def _xfs_size(mount_point: str) -> int:
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        geometry = bytearray(_XFS_GEOMETRY_V1)
        fcntl.ioctl(fd, _XFS_IOC_FSGEOMETRY_V1, geometry)
    finally:
        os.close(fd)
    (block_size,) = struct.unpack_from("=I", geometry, 0)
    (data_blocks,) = struct.unpack_from("=Q", geometry, 32)
    return int(block_size) * int(data_blocks)
