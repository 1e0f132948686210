"""create and delete of the Nomad dynamic host volume plugin: a thin LV with a
file system, mounted at DHV_VOLUMES_DIR/<volume id>.

Locking matches the CSI plugin's, in the same directory and order: the
volume's own key ("volume:<lv name>") outside, "pool" inside, held around the
capacity check and lvcreate/lvextend. LV names ("dhv-<hash of the volume
ID>") and tags ("csi-local-dhv.*") are disjoint from the CSI plugin's, so
neither plugin lists, changes or removes the other's volumes.

Everything here is imported lazily by csi_local.dhv, off the fingerprint path.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterator, Sequence

from csi_local import mounts
from csi_local.dhv_spec import (
    FS_MIN_SIZE,
    KIND_VOLUME,
    TAG_FRESH,
    TAG_FS,
    TAG_GROW_FS,
    TAG_ID,
    TAG_KIND,
    DhvError,
    PluginConfig,
    Request,
    resize_target,
    size_for_new,
    volume_tags,
)
from csi_local.fs import Filesystems, wait_for_device
from csi_local.locks import Locks
from csi_local.lvm import LogicalVolume, Lvm, check_name, check_tag
from csi_local.runner import Result, Runner, ShRunner
from csi_local.volumes import pool_capacity

log = logging.getLogger("csi_local.dhv")

POOL_LOCK = "pool"  # the CSI plugin's key for capacity checks + lvcreate/lvextend
_RESERVE = 3.0  # seconds kept back to report a result before Nomad's deadline


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, reserve: float = _RESERVE) -> float:
        left = self.end - time.monotonic() - reserve
        if left <= 0:
            raise DhvError("ran out of time (Nomad allows create and delete 60 seconds)")
        return left


class DeadlineRunner:
    """A Runner whose commands never outlive the operation's deadline."""

    def __init__(self, inner: Runner, deadline: Deadline) -> None:
        self.inner = inner
        self.deadline = deadline

    def run(
        self,
        argv: Sequence[str],
        *,
        ok_codes: Sequence[int] = (0,),
        input: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        left = self.deadline.left()
        limit = left if timeout is None else min(timeout, left)
        return self.inner.run(argv, ok_codes=ok_codes, input=input, timeout=limit)


class Plugin:
    def __init__(self, config: PluginConfig, runner: Runner | None = None) -> None:
        self.config = config
        self.deadline = Deadline(config.timeout_seconds)
        inner = runner if runner is not None else ShRunner(timeout=config.timeout_seconds)
        self.runner = DeadlineRunner(inner, self.deadline)
        self.lvm = Lvm(self.runner, config.volume_group, config.thin_pool)
        self.fs = Filesystems(self.runner)
        self.locks = Locks(config.lock_dir)

    @contextlib.contextmanager
    def _hold(self, key: str) -> Iterator[None]:
        with self.locks.hold(key, timeout=self.deadline.left(reserve=2 * _RESERVE)):
            yield

    # create ------------------------------------------------------------------

    def create(self, req: Request) -> tuple[str, int]:
        """Make (or converge) the volume; returns (path, bytes)."""
        params = req.parameters
        if params is None:
            raise DhvError("create needs the volume's parameters")
        with self._hold(f"volume:{req.lv_name}"):
            lv = self.lvm.find(req.lv_name)
            created = False
            if lv is None:
                fs_type = params.fs_type or self.config.fs_type
                lv = self._new_lv(req, fs_type)
                created = True
                log.info("created LV %s/%s (%d bytes) for volume %s",
                         lv.vg, lv.name, lv.size, req.volume_id)
            else:
                _check_ours(lv, req)
                fs_type = lv.tag_value(TAG_FS) or ""
                if not fs_type:
                    raise DhvError(f"LV {lv.vg}/{lv.name} has no {TAG_FS} tag")
                if params.fs_type and params.fs_type != fs_type:
                    raise DhvError(
                        f"volume {req.volume_id} has a {fs_type} file system; changing "
                        f"fs_type to {params.fs_type} would need a reformat, which is refused"
                    )
            try:
                lv = self._converge(req, lv, fs_type, params.mount_options)
            except BaseException:
                if created:  # a first create that failed leaves nothing behind
                    self._rollback(req, lv)
                raise
            return req.path, lv.size

    def _new_lv(self, req: Request, fs_type: str) -> LogicalVolume:
        extent = self.lvm.volume_group().extent_size
        size = size_for_new(
            req.capacity_min, req.capacity_max, extent,
            default=self.config.default_size, minimum=FS_MIN_SIZE.get(fs_type, 0),
        )
        with self._hold(POOL_LOCK):
            cap = pool_capacity(self.lvm, self.config.overprovision_ratio)
            if size > cap.available:
                raise DhvError(
                    f"thin pool {self.lvm.vg}/{self.lvm.pool} has room for {cap.available} "
                    f"bytes, {size} requested (overprovision_ratio "
                    f"{self.config.overprovision_ratio})"
                )
            return self.lvm.create_thin(req.lv_name, size, volume_tags(req, fs_type))

    def _converge(self, req: Request, lv: LogicalVolume, fs_type: str,
                  mount_options: Sequence[str]) -> LogicalVolume:
        if not lv.active:
            lv = self.lvm.activate(lv)
        wait_for_device(lv.path, timeout=min(30.0, self.deadline.left()))
        self._format(lv, fs_type)
        lv = self._grow_lv(req, lv)
        self._mount(req, lv, fs_type, mount_options)
        if TAG_GROW_FS in lv.tags:
            self.fs.grow(lv.path, req.path, fs_type)
            self.lvm.delete_tags(lv.name, [TAG_GROW_FS])
            lv = self.lvm.get(lv.name)
            log.info("grew the %s file system of %s to %d bytes", fs_type, lv.name, lv.size)
        return lv

    def _format(self, lv: LogicalVolume, fs_type: str) -> None:
        """mkfs a never-formatted LV; never touch one that holds anything."""
        found, ambivalent = self.fs.probe(lv.path)
        if found is None and not ambivalent and TAG_FRESH in lv.tags:
            self.fs.mkfs(lv.path, fs_type)
            self.lvm.delete_tags(lv.name, [TAG_FRESH])
            return
        if found is None:
            what = "conflicting signatures" if ambivalent else "no file system"
            raise DhvError(
                f"LV {lv.vg}/{lv.name} has {what} although it was formatted before; "
                "refusing to format it again (inspect it with blkid/wipefs)"
            )
        if found != fs_type:
            raise DhvError(
                f"LV {lv.vg}/{lv.name} holds {found}, not {fs_type}; refusing to reformat"
            )
        if TAG_FRESH in lv.tags:  # formatted by a run that was killed before this step
            self.lvm.delete_tags(lv.name, [TAG_FRESH])

    def _grow_lv(self, req: Request, lv: LogicalVolume) -> LogicalVolume:
        growing = req.capacity_min > lv.size
        extent = self.lvm.volume_group().extent_size if growing else 1
        size = resize_target(lv.size, req.capacity_min, req.capacity_max, extent)
        if size <= lv.size:
            return lv
        with self._hold(POOL_LOCK):
            cap = pool_capacity(self.lvm, self.config.overprovision_ratio)
            if size - lv.size > cap.available:
                raise DhvError(
                    f"thin pool {self.lvm.vg}/{self.lvm.pool} has room for {cap.available} "
                    f"more bytes; growing volume {req.volume_id} by {size - lv.size} is "
                    "not possible"
                )
            self._add_tag(lv.name, TAG_GROW_FS)
            lv = self.lvm.extend(lv.name, size)
        log.info("extended LV %s to %d bytes", lv.name, lv.size)
        return lv

    def _add_tag(self, name: str, tag: str) -> None:
        self.runner.run(
            ["lvchange", "--addtag", check_tag(tag), f"{self.lvm.vg}/{check_name(name)}"]
        )

    def _mount(self, req: Request, lv: LogicalVolume, fs_type: str,
               options: Sequence[str]) -> None:
        os.makedirs(req.volumes_dir, mode=0o711, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(req.path, 0o755)
        major, minor = _device_numbers(lv)
        top = mounts.top_mount(req.path)
        if top is None:
            self.fs.mount(lv.path, req.path, fs_type, list(options))
            log.info("mounted %s at %s", lv.path, req.path)
        elif not mounts.mount_is_device(top, major, minor):
            raise DhvError(
                f"{req.path} is already a mount point of another device ({top.source}); "
                "refusing to mount over it"
            )

    def _rollback(self, req: Request, lv: LogicalVolume) -> None:
        """Best effort: undo this run's new LV, its mount and its directory."""
        try:
            major, minor = _device_numbers(lv)
            top = mounts.top_mount(req.path)
            if top is not None and mounts.mount_is_device(top, major, minor):
                self.runner.run(["umount", req.path])
            if not any(mounts.mount_is_device(m, major, minor) for m in mounts.read_mounts()):
                self.lvm.remove(lv.name)
            if not mounts.is_mount_point(req.path):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(req.path)
        except Exception as err:  # the original error is the one to report
            log.warning("could not undo the failed create of %s: %s", req.volume_id, err)

    # delete ------------------------------------------------------------------

    def delete(self, req: Request) -> None:
        """Unmount, lvremove and rmdir; a no-op for what is already gone."""
        with self._hold(f"volume:{req.lv_name}"):
            lv = self.lvm.find(req.lv_name)
            if lv is not None:
                _check_ours(lv, req)
            self._remove(req, lv)

    def _remove(self, req: Request, lv: LogicalVolume | None) -> None:
        targets = [req.path]
        created = _created_path(req)
        if created is not None:
            targets.append(created)
        if lv is not None:
            major, minor = _device_numbers(lv)
            for target in targets:
                self._umount_device(target, major, minor)
            left = [m.mount_point for m in mounts.read_mounts()
                    if mounts.mount_is_device(m, major, minor)]
            if left:
                raise DhvError(
                    f"LV {lv.vg}/{lv.name} is still mounted at {', '.join(left)} "
                    "(in use?); not removing it"
                )
            self.lvm.remove(lv.name)
            log.info("removed LV %s/%s", lv.vg, lv.name)
        elif mounts.is_mount_point(req.path):
            top = mounts.top_mount(req.path)
            raise DhvError(
                f"{req.path} is a mount point of {top.source if top else 'something'} that "
                "is not this volume's LV; leaving it alone"
            )
        for target in targets:
            if mounts.is_mount_point(target):
                continue
            try:
                os.rmdir(target)
            except FileNotFoundError:
                pass
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                log.warning("%s is not empty; left in place", target)

    def _umount_device(self, target: str, major: int, minor: int) -> None:
        for _ in range(16):
            top = mounts.top_mount(target)
            if top is None:
                return
            if not mounts.mount_is_device(top, major, minor):
                raise DhvError(
                    f"{target} is a mount point of another device ({top.source}); "
                    "leaving it alone"
                )
            self.runner.run(["umount", target])
        raise DhvError(f"{target} is still mounted after repeated umount")


def _check_ours(lv: LogicalVolume, req: Request) -> None:
    if lv.tag_value(TAG_KIND) != KIND_VOLUME or lv.tag_value(TAG_ID) != req.volume_id:
        raise DhvError(
            f"LV {lv.vg}/{lv.name} exists but is not host volume {req.volume_id} "
            "made by this plugin; leaving it alone"
        )


def _device_numbers(lv: LogicalVolume) -> tuple[int, int]:
    if lv.kernel_major >= 0 and lv.kernel_minor >= 0:
        return lv.kernel_major, lv.kernel_minor
    return mounts.device_numbers(lv.path)


def _created_path(req: Request) -> str | None:
    """DHV_CREATED_PATH when it names this volume's directory somewhere else
    (the volumes directory moved); never the volumes directory itself."""
    raw = req.created_path
    if not raw or "\0" in raw or not os.path.isabs(raw):
        return None
    path = os.path.normpath(raw)
    if path == req.path or os.path.basename(path) != req.volume_id:
        return None
    return path
