"""File systems and mounts: blkid, mkfs, mount, bind, umount, grow, sync, stats.

The rules (which file systems, their minimum sizes, which mount options)
live in fsrules; this module runs the commands that apply them, through the
Runner, and asks the Kernel what is mounted. Bind mounts, their remounts and
unmounts are system calls the Kernel makes (no process); a file system's mount
stays with mount(8), which owns the translation of its options.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from csi_local.errors import (
    CommandError,
    FormatRefused,
    StillMounted,
    UnsupportedFilesystem,
)
from csi_local.host import filesystem_rules as fsrules
from csi_local.host.kernel import Kernel
from csi_local.host.mounts import Mount
from csi_local.host.runner import Runner

log = logging.getLogger(__name__)

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


class Filesystems:
    def __init__(self, runner: Runner, host: Kernel) -> None:
        self.runner = runner
        self.host = host

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
                          empty: bool = False, name: str = "") -> str:
        """The file system on `device`, made with mkfs only if the volume was never used.

        The one rule for formatting, shared by the CSI and host volume plugins:
        only a volume that has never been handed out (`fresh`) is ever
        formatted. Anything else without a recognisable file system may hold a
        raw block device's data, or blkid may simply have failed to read it
        (blkid exits 2 for "nothing found" and for an unreadable device alike),
        so it is refused without a single write. A fresh volume that carries
        stray signatures is wiped first; one that cannot be read is refused.

        `empty`: the caller knows the device holds no data at all (a thin
        volume that maps no block reads as zeros): there is nothing for blkid
        to find, so the probe is skipped, and with it the read that makes its
        "nothing found" trustworthy (a device that cannot be read fails mkfs,
        and holds nothing to lose). It implies `fresh`.
        """
        what = name or device
        if empty:
            self.mkfs(device, fs_type)
            return fs_type
        found, ambivalent = self.probe(device)
        if ambivalent:
            if not fresh:
                raise FormatRefused(
                    f"volume {what} carries conflicting signatures and has been used before; "
                    "refusing to format it (inspect it with blkid/wipefs)"
                )
            log.warning("wiping stray signatures on never-used volume %s", what)
            self.wipe(device)
            found = None
        if found is None:
            if not fresh:
                raise FormatRefused(
                    f"volume {what} has no recognisable file system but has been used before "
                    "(as a raw block device, or its file system is damaged); refusing to "
                    f"format it as {fs_type}: its data is left untouched"
                )
            self._format_readable(device, fs_type)
            return fs_type
        if found != fs_type:
            raise FormatRefused(
                f"volume {what} holds a {found} file system, but {fs_type} was requested; "
                "it is left untouched"
            )
        return found

    def _format_readable(self, device: str, fs_type: str) -> None:
        problem = self.host.read_error(device)
        if problem is not None:
            raise FormatRefused(f"cannot read {device} ({problem}); refusing to format it")
        self.mkfs(device, fs_type)

    def wipe(self, device: str) -> None:
        self.runner.run(["wipefs", "--all", device])

    def mkfs(self, device: str, fs_type: str) -> None:
        if fs_type not in _MKFS:
            raise UnsupportedFilesystem(f"unsupported fs type {fs_type!r}")
        self.runner.run([*_MKFS[fs_type], device])

    def mount(self, device: str, target: str, fs_type: str, flags: Sequence[str]) -> None:
        argv = ["mount", "-t", fs_type]
        opts = fsrules.check(flags)
        if fs_type == "xfs" and "nouuid" not in opts:
            # Restores and clones carry their origin's UUID, and the kernel refuses a
            # second xfs with a mounted one's UUID; the origin is on this node, often
            # mounted. A new UUID is not an option: xfs_admin -U refuses a snapshot's
            # dirty log (and exits 0). nouuid is what xfs provides for snapshots, and
            # every xfs is mounted with it, so the order of mounts never matters.
            opts.append("nouuid")
        # One system call, as mount(8) would make it, for the options whose
        # call is known; mount(8) for any other (its own, a file system's).
        if self.host.mount_filesystem(device, target, fs_type, opts):
            return
        if opts:
            argv += ["-o", ",".join(opts)]
        self.runner.run([*argv, device, target])

    def bind(self, source: str, target: str, *, readonly: bool, flags: Sequence[str] = ()) -> None:
        """Bind-mount; read-only and the other per-mount flags take a remount
        after the bind itself (the kernel ignores them on the bind). Read-only
        wins over the flags: a `rw` among them (a StorageClass's mountOptions)
        is overridden, never a way to make a read-only publish writable."""
        extra = fsrules.check(flags)
        before = {m.mount_id for m in self.host.mounts_at(target)} if readonly or extra else set()
        self.host.bind_mount(source, target)
        if readonly or extra:
            try:
                self.host.remount_bind(target, extra, readonly=readonly)
            except CommandError:
                self._undo_mounts(target, before)
                raise

    def _undo_mounts(self, target: str, before: set[int]) -> None:
        """Unmount what this call stacked at `target`, by mount ID: every mount
        there that is not in `before` (the IDs there before it), down to the
        first that is. A mount that was there before is never taken down (a
        CO's, or another publish's); mount IDs are unique while mounted."""
        for _ in range(16):
            top = self.host.top_mount(target)
            if top is None or top.mount_id in before:
                return
            self.host.unmount(target)
        raise StillMounted(f"{target} is still mounted after repeated umount")

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
        self.host.remount_bind(target, [] if readonly else ["rw"], readonly=readonly)

    def umount(self, target: str, *, device: tuple[int, int] | None = None) -> list[Mount]:
        """Unmount every mount stacked at `target`; returns them, top first (none:
        nothing was mounted there).

        With `device` (major, minor), only mounts of that device are taken
        down: StillMounted, before any umount of it, for a mount of anything
        else at `target` (never unmount what is not ours).
        """
        done: list[Mount] = []
        for _ in range(16):
            top = self.host.top_mount(target)
            if top is None:
                return done
            if device is not None and not self.host.shows_device(top, *device):
                raise StillMounted(
                    f"{target} is a mount point of another device ({top.source}); "
                    "leaving it alone"
                )
            self.host.unmount(target)
            done.append(top)
        raise StillMounted(f"{target} is still mounted after repeated umount")

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
            raise UnsupportedFilesystem(f"cannot grow a {fs_type} file system")

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

    def sync(self, mount_point: str) -> None:
        """syncfs: commit the file system's dirty data and journal (before a snapshot)."""
        self.runner.run(["sync", "--file-system", mount_point])
