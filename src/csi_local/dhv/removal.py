"""delete of a Nomad dynamic host volume: unmount, lvremove, rmdir. Nothing
is unmounted while something uses the volume; when lvremove fails after the
unmount all the same (a user no scan sees), the volume is mounted again
where Nomad expects it, rather than leave an empty directory there.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence

from csi_local.dhv.request import DhvError, Request
from csi_local.host.filesystems import Filesystems
from csi_local.host.kernel import Kernel
from csi_local.host.mounts import Mount
from csi_local.host.volume_users import VolumeUsers, volume_users
from csi_local.storage.lvm import LogicalVolume
from csi_local.volumes import encryption
from csi_local.volumes.pool import Pool

log = logging.getLogger("csi_local.dhv")

# Per-mount flags carried over when delete mounts a volume again. Its file
# system options (mount_options) are not part of a delete request; when a
# user made lvremove fail, the superblock it keeps alive still has them.
_VFS_FLAGS = frozenset({"ro", "rw", "nosuid", "nodev", "noexec", "noatime", "nodiratime",
                        "relatime", "strictatime", "nosymfollow"})
_NAMED = 8  # users named in one error message; the rest are counted
# Pauses before looking again when something uses a volume: udev's probes
# (blkid after a change event on the LV) open the device for a moment, and
# only users that stay count.
_SETTLE = (0.2, 0.5)


def device_numbers(host: Kernel, lv: LogicalVolume) -> tuple[int, int]:
    """The major:minor of the device the volume's file system is on: an
    encrypted volume's open dm-crypt device, else the LV's, from the report or
    else from its device node."""
    top = encryption.top_device(host, lv)
    if top.encrypted:
        return top.major, top.minor
    if lv.kernel_major >= 0 and lv.kernel_minor >= 0:
        return lv.kernel_major, lv.kernel_minor
    found = host.device_numbers(lv.path)
    if found is None:
        raise DhvError(f"LV {lv.vg}/{lv.name} has no device node at {lv.path} "
                       "(inactive?)")
    return found


class VolumeRemoval:
    """Takes a host volume down: its mounts, its LV, its directories."""

    def __init__(self, fs: Filesystems, host: Kernel,
                 close: Callable[[str], bool] | None = None) -> None:
        self.fs = fs
        self.host = host
        # Closes an encrypted volume's dm-crypt device, by LV name, before its
        # lvremove (VolumeSteps.close_device).
        self.close = close

    def remove(self, req: Request, found: tuple[Pool, LogicalVolume] | None) -> None:
        lv = found[1] if found is not None else None
        targets = [req.path]
        created = created_path(req)
        if created is not None:
            targets.append(created)
        if found is not None and lv is not None:
            pool = found[0]
            major, minor = device_numbers(self.host, lv)
            # Before any umount: unmounting a volume that something still
            # uses cannot end in lvremove, and would leave Nomad a registered
            # volume whose directory is an empty one on the root file system.
            users = self._users(major, minor, targets)
            if users.busy:
                raise DhvError(in_use_message(req, lv, users.busy))
            unmounted: list[Mount] = []
            try:
                for target in targets:
                    unmounted += self.fs.umount(target, device=(major, minor))
                left = [m.mount_point for m in self.host.mounts_of(major, minor)]
                if left:
                    raise DhvError(
                        f"LV {lv.vg}/{lv.name} is still mounted at {', '.join(left)} "
                        "(in use?); not removing it"
                    )
                if self.close is not None:
                    self.close(lv.name)  # an encrypted volume's dm-crypt device
                pool.lvm.remove(lv.name)
            except Exception as err:
                if not unmounted:
                    raise
                # A user no scan can see (a mount namespace without
                # processes, a kernel user): put the volume back where Nomad
                # expects it rather than leave an empty directory there.
                raise DhvError(self._mount_again(lv, unmounted, err, users)) from err
            log.info("removed LV %s/%s", lv.vg, lv.name)
        elif self.host.is_mount_point(req.path):
            top = self.host.top_mount(req.path)
            raise DhvError(
                f"{req.path} is a mount point of {top.source if top else 'something'} that "
                "is not this volume's LV; leaving it alone"
            )
        for target in targets:
            if self.host.is_mount_point(target):
                continue
            try:
                os.rmdir(target)
            except FileNotFoundError:
                pass
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                log.warning("%s is not empty; left in place", target)

    def _users(self, major: int, minor: int, targets: Sequence[str]) -> VolumeUsers:
        users = volume_users(major, minor, targets)
        for delay in _SETTLE:
            if not users.busy:
                break
            time.sleep(delay)
            users = volume_users(major, minor, targets)
        return users

    def _mount_again(self, lv: LogicalVolume, unmounted: Sequence[Mount],
                     err: Exception, users: VolumeUsers) -> str:
        """Mount the LV again where delete unmounted it; returns the error to report."""
        reason = getattr(err, "message", None) or str(err)
        points = list(dict.fromkeys(m.mount_point for m in reversed(unmounted)))
        restored: list[str] = []
        try:
            for mount in reversed(unmounted):
                if mount.mount_point in restored:
                    continue
                flags = sorted(mount.options & _VFS_FLAGS)
                # Its dm-crypt device, while open (a closed one needs its key:
                # this mount fails and says to run create).
                device = encryption.top_device(self.host, lv).path
                self.fs.mount(device, mount.mount_point, mount.fs_type, flags)
                restored.append(mount.mount_point)
        except Exception as again:
            log.error("could not mount %s again at %s: %s", lv.path, points, again)
            lost = [p for p in points if p not in restored]
            return (f"LV {lv.vg}/{lv.name} was unmounted but could not be removed ({reason}), "
                    f"and mounting it again at {', '.join(lost)} failed too ({again}); "
                    "run create for the volume to mount it again")
        hint = ""
        if users.pinned:
            hint = (f"; mount namespaces that no process is in, pinned at "
                    f"{', '.join(users.pinned)}, may hold it")
        return (f"LV {lv.vg}/{lv.name} could not be removed ({reason}); it is mounted again "
                f"at {', '.join(restored)}, as before the delete{hint}")


def created_path(req: Request) -> str | None:
    """DHV_CREATED_PATH when it names this volume's directory somewhere else
    (the volumes directory moved); never the volumes directory itself."""
    raw = req.created_path
    if not raw or "\0" in raw or not os.path.isabs(raw):
        return None
    path = os.path.normpath(raw)
    if path == req.path or os.path.basename(path) != req.volume_id:
        return None
    return path


def in_use_message(req: Request, lv: LogicalVolume, busy: Sequence[str]) -> str:
    named = "; ".join(busy[:_NAMED])
    if len(busy) > _NAMED:
        named += f"; and {len(busy) - _NAMED} more"
    return (f"volume {req.volume_id} (LV {lv.vg}/{lv.name}) is in use, so nothing was "
            f"unmounted or removed: {named}. Stop what holds it, then delete again")
