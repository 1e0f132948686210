"""File systems and mounts: blkid, mkfs, mount, bind, umount, grow, stats, freeze."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from csi_local import mounts
from csi_local.errors import CommandError, FailedPrecondition, InvalidArgument
from csi_local.runner import Runner

log = logging.getLogger(__name__)

SUPPORTED_FS = ("ext4", "xfs", "btrfs")
_MKFS = {
    "ext4": ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1"],
    "xfs": ["mkfs.xfs", "-q", "-K"],
    "btrfs": ["mkfs.btrfs", "-q", "-K"],
}
# Mount flags a CO may pass; anything else is refused rather than handed to mount.
_FLAG_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789=_-.,:/+@")


@dataclass(frozen=True)
class Usage:
    total_bytes: int
    used_bytes: int
    available_bytes: int
    total_inodes: int
    used_inodes: int
    available_inodes: int


def check_mount_flags(flags: Sequence[str]) -> list[str]:
    for flag in flags:
        if not flag or not set(flag) <= _FLAG_CHARS or flag.startswith("-"):
            raise InvalidArgument(f"invalid mount flag {flag!r}")
    return list(flags)


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

    def wipe(self, device: str) -> None:
        self.runner.run(["wipefs", "--all", device])

    def mkfs(self, device: str, fs_type: str) -> None:
        if fs_type not in _MKFS:
            raise InvalidArgument(f"unsupported fs type {fs_type!r}")
        self.runner.run([*_MKFS[fs_type], device])

    def mount(self, device: str, target: str, fs_type: str, flags: Sequence[str]) -> None:
        argv = ["mount", "-t", fs_type]
        opts = check_mount_flags(flags)
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
