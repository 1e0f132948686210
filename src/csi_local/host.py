"""What the kernel shows the node service: the mount table, device nodes and
loop devices, behind one object.

The node service, the file-system layer, state recovery and the host volume
plugin ask these questions through a `Host`, never through /proc or /dev
directly, so a unit test can hand them a fake host (a mount table and devices
in memory) and run every branch of NodeStageVolume in milliseconds. The real
proof stays the integration suite in the VM.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from csi_local import mounts
from csi_local.errors import DeviceMissing
from csi_local.mounts import Mount

# linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
_FIFREEZE = 0xC0045877
_FITHAW = 0xC0045878


class Host:
    """The real kernel, read through /proc/self/mountinfo, /dev and /sys."""

    # The primitives: a fake host overrides these eight and nothing else.

    def mounts(self) -> list[Mount]:
        """The mount table of this process's mount namespace, in mount order."""
        return mounts.read_mounts()

    def device_numbers(self, path: str) -> tuple[int, int] | None:
        """major:minor of the block device node at `path` (None: no such node)."""
        try:
            return mounts.device_numbers(path)
        except OSError:
            return None

    def loop_backing(self, node: str) -> str | None:
        """The backing file of a loop device node such as /dev/loop3, if attached."""
        return mounts.loop_backing(node)

    def device_size(self, path: str) -> int:
        """Bytes of the block device at `path`."""
        with open(path, "rb") as f:
            return f.seek(0, os.SEEK_END)

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
        return mounts.mounts_at(path, self.mounts() if table is None else table)

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
