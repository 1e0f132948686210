"""File systems and mounts: blkid, mkfs, mount, bind, umount, grow, stats, freeze."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from csi_local import fsrules, mounts
from csi_local.errors import CommandError, FailedPrecondition, InvalidArgument
from csi_local.runner import Runner

log = logging.getLogger(__name__)

SUPPORTED_FS = fsrules.SUPPORTED_FS
_MKFS = {
    "ext4": ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1"],
    "xfs": ["mkfs.xfs", "-q", "-K"],
    "btrfs": ["mkfs.btrfs", "-q", "-K"],
}


@dataclass(frozen=True)
class Usage:
    total_bytes: int
    used_bytes: int
    available_bytes: int
    total_inodes: int
    used_inodes: int
    available_inodes: int


def check_mount_flags(flags: Sequence[str]) -> list[str]:
    """The CO's mount flags as single options; INVALID_ARGUMENT per fsrules' rule."""
    try:
        return fsrules.check(flags)
    except fsrules.MountOptionError as err:
        raise InvalidArgument(f"mount flag refused: {err}") from None


class Filesystems:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def probe(self, device: str) -> tuple[str | None, bool]:
        """(file-system type or None, ambivalent/partial signature present).

        blkid -p reads the device itself, not a cache. Exit 2: nothing found.
        Exit 8: ambivalent result (stray, conflicting signatures).
        """
        res = self.runner.run(
            ["blkid", "-p", "-o", "export", device], ok_codes=(0, 2, 8)
        )
        if res.returncode == 2:
            return None, False
        if res.returncode == 8:
            return None, True
        values = dict(
            line.split("=", 1) for line in res.stdout.splitlines() if "=" in line
        )
        fs = values.get("TYPE")
        if fs is None:
            # A signature that is not a file system (e.g. a partition table).
            return values.get("PTTYPE", "unknown"), False
        return fs, False

    def ensure_filesystem(self, device: str, fs_type: str, *, fresh: bool,
                          name: str = "") -> str:
        """The file system on `device`, made with mkfs only if the volume was never used.

        The one rule for formatting, shared by the CSI and host volume plugins:
        only a volume that has never been handed out (`fresh`) is ever
        formatted. Anything else without a recognisable file system may hold a
        raw block device's data, or blkid may simply have failed to read it
        (blkid exits 2 for "nothing found" and for an unreadable device alike),
        so it is refused without a single write. A fresh volume that carries
        stray signatures is wiped first; one that cannot be read is refused.
        """
        what = name or device
        found, ambivalent = self.probe(device)
        if ambivalent:
            if not fresh:
                raise FailedPrecondition(
                    f"volume {what} carries conflicting signatures and has been used before; "
                    "refusing to format it (inspect it with blkid/wipefs)"
                )
            log.warning("wiping stray signatures on never-used volume %s", what)
            self.wipe(device)
            found = None
        if found is None:
            if not fresh:
                raise FailedPrecondition(
                    f"volume {what} has no recognisable file system but has been used before "
                    "(as a raw block device, or its file system is damaged); refusing to "
                    f"format it as {fs_type}: its data is left untouched"
                )
            _check_readable(device)
            self.mkfs(device, fs_type)
            return fs_type
        if found != fs_type:
            raise FailedPrecondition(
                f"volume {what} holds a {found} file system, but {fs_type} was requested; "
                "it is left untouched"
            )
        return found

    def wipe(self, device: str) -> None:
        self.runner.run(["wipefs", "--all", device])

    def mkfs(self, device: str, fs_type: str) -> None:
        if fs_type not in _MKFS:
            raise InvalidArgument(f"unsupported fs type {fs_type!r}")
        self.runner.run([*_MKFS[fs_type], device])

    def mount(self, device: str, target: str, fs_type: str, flags: Sequence[str]) -> None:
        argv = ["mount", "-t", fs_type]
        opts = check_mount_flags(flags)
        if fs_type == "xfs" and "nouuid" not in opts:
            # Restores and clones carry their origin's UUID, and the kernel refuses a
            # second xfs with a mounted one's UUID; the origin is on this node, often
            # mounted. A new UUID is not an option: xfs_admin -U refuses a snapshot's
            # dirty log (and exits 0). nouuid is what xfs provides for snapshots, and
            # every xfs is mounted with it, so the order of mounts never matters.
            opts.append("nouuid")
        if opts:
            argv += ["-o", ",".join(opts)]
        self.runner.run([*argv, device, target])

    def bind(self, source: str, target: str, *, readonly: bool, flags: Sequence[str] = ()) -> None:
        """Bind-mount; a read-only bind needs a remount after the bind itself."""
        self.runner.run(["mount", "--bind", source, target])
        extra = check_mount_flags(flags)
        if readonly or extra:
            opts = ["remount", "bind", *(["ro"] if readonly else []), *extra]
            try:
                self.runner.run(["mount", "-o", ",".join(opts), target])
            except CommandError:
                self.umount(target)
                raise

    def readonly_loop(self, device: str) -> str:
        """A read-only loop device over `device`.

        A read-only bind mount of a device node does not stop writes to the
        device (the mount's flag guards the file system, not the device), so
        read-only block publishes go through a loop device the kernel itself
        keeps read-only.
        """
        out = self.runner.run(["losetup", "--find", "--show", "--read-only",
                               "--direct-io=on", device])
        return out.stdout.strip()

    def detach_loop(self, node: str) -> None:
        self.runner.run(["losetup", "--detach", node], ok_codes=(0, 1))

    def remount_bind(self, target: str, *, readonly: bool) -> None:
        self.runner.run(["mount", "-o", f"remount,bind,{'ro' if readonly else 'rw'}", target])

    def umount(self, target: str) -> None:
        """Unmount every mount stacked at `target`; a no-op when none is."""
        for _ in range(16):
            if not mounts.is_mount_point(target):
                return
            self.runner.run(["umount", target])
        raise FailedPrecondition(f"{target} is still mounted after repeated umount")

    def new_fsid(self, device: str, fs_type: str) -> None:
        """Give an unmounted clone's file system an identity of its own.

        btrfs (before 6.7's temp-fsid) takes a device with a mounted file
        system's fsid for another device of that file system and refuses to
        mount it; btrfstune -m sets a new fsid through metadata_uuid, without
        rewriting every block. ext4 mounts duplicates; xfs is mounted with
        nouuid (see mount), as xfs_admin cannot change a snapshot's UUID.
        """
        if fs_type == "btrfs":
            self.runner.run(["btrfstune", "-f", "-m", device])

    def grow(self, device: str, mount_point: str, fs_type: str) -> None:
        if fs_type == "ext4":
            self.runner.run(["resize2fs", device])
        elif fs_type == "xfs":
            self.runner.run(["xfs_growfs", mount_point])
        elif fs_type == "btrfs":
            self.runner.run(["btrfs", "filesystem", "resize", "max", mount_point])
        else:
            raise InvalidArgument(f"cannot grow a {fs_type} file system")

    def usage(self, path: str) -> Usage:
        st = os.statvfs(path)
        total = st.f_blocks * st.f_frsize
        avail = st.f_bavail * st.f_frsize
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return Usage(
            total_bytes=total,
            used_bytes=used,
            available_bytes=avail,
            total_inodes=st.f_files,
            used_inodes=st.f_files - st.f_ffree,
            available_inodes=st.f_favail,
        )

    def fs_size(self, path: str) -> int:
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize

    def sync(self, mount_point: str) -> None:
        """syncfs: flush the file system's dirty data (shortens a following freeze)."""
        self.runner.run(["sync", "--file-system", mount_point])


def _check_readable(device: str, length: int = 1 << 20) -> None:
    """Read the start of `device`: blkid's "nothing found" is trusted only when
    the device can really be read."""
    try:
        with open(device, "rb", buffering=0) as f:
            f.read(length)
    except OSError as err:
        raise FailedPrecondition(
            f"cannot read {device} ({err.strerror}); refusing to format it"
        ) from err


def block_device_size(device: str) -> int:
    with open(device, "rb") as f:
        return f.seek(0, os.SEEK_END)


def wait_for_device(path: str, timeout: float = 30.0) -> None:
    """Wait until udev has made `path`, listening to udev instead of sleeping."""
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
            raise FailedPrecondition(f"device {path} did not appear within {timeout:.0f}s")
        monitor.poll(timeout=min(left, 1.0))
