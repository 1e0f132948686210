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
import glob
import logging
import os
import stat
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

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
from csi_local.lvm import LogicalVolume, Lvm
from csi_local.runner import Result, Runner, ShRunner
from csi_local.volumes import require_room

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
        with self._hold(POOL_LOCK):
            report = self.lvm.report()  # the extent size and the pool's room in one call
            size = size_for_new(
                req.capacity_min, req.capacity_max, report.extent_size,
                default=self.config.default_size, minimum=FS_MIN_SIZE.get(fs_type, 0),
            )
            require_room(report, self.lvm, self.config.overprovision_ratio, size)
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
        """mkfs a never-formatted LV; never touch one that holds anything (the
        rule is the CSI plugin's: Filesystems.ensure_filesystem)."""
        self.fs.ensure_filesystem(lv.path, fs_type, fresh=TAG_FRESH in lv.tags,
                                  name=f"{lv.vg}/{lv.name}")
        if TAG_FRESH in lv.tags:  # formatted now, or by a run killed before this step
            self.lvm.delete_tags(lv.name, [TAG_FRESH])

    def _grow_lv(self, req: Request, lv: LogicalVolume) -> LogicalVolume:
        if req.capacity_min <= lv.size:  # nothing to grow; a shrink is still refused
            resize_target(lv.size, req.capacity_min, req.capacity_max, 1)
            return lv
        with self._hold(POOL_LOCK):
            report = self.lvm.report()
            size = resize_target(lv.size, req.capacity_min, req.capacity_max,
                                 report.extent_size)
            require_room(report, self.lvm, self.config.overprovision_ratio, size - lv.size)
            self.lvm.add_tags(lv.name, [TAG_GROW_FS])
            lv = self.lvm.extend(lv.name, size)
        log.info("extended LV %s to %d bytes", lv.name, lv.size)
        return lv

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
            # Before any umount: unmounting a volume that something still
            # holds cannot end in lvremove, and would leave Nomad a registered
            # volume whose directory is an empty one on the root file system.
            users = self._users(major, minor, targets)
            if users.holders:
                raise DhvError(_in_use_message(req, lv, users.holders))
            unmounted: list[mounts.Mount] = []
            try:
                for target in targets:
                    unmounted += self._umount_device(target, major, minor)
                left = [m.mount_point for m in mounts.read_mounts()
                        if mounts.mount_is_device(m, major, minor)]
                if left:
                    raise DhvError(
                        f"LV {lv.vg}/{lv.name} is still mounted at {', '.join(left)} "
                        "(in use?); not removing it"
                    )
                self.lvm.remove(lv.name)
            except Exception as err:
                if not unmounted:
                    raise
                # A holder no scan can see (a mount namespace without
                # processes, a kernel user): put the volume back where Nomad
                # expects it rather than leave an empty directory there.
                raise DhvError(self._mount_again(lv, unmounted, err, users)) from err
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

    def _users(self, major: int, minor: int, targets: Sequence[str]) -> VolumeUsers:
        users = volume_users(major, minor, targets)
        for delay in _SETTLE:
            if not users.holders:
                break
            time.sleep(delay)
            users = volume_users(major, minor, targets)
        return users

    def _umount_device(self, target: str, major: int, minor: int) -> list[mounts.Mount]:
        """Unmount this LV from `target`; returns the mounts taken down, top first."""
        done: list[mounts.Mount] = []
        for _ in range(16):
            top = mounts.top_mount(target)
            if top is None:
                return done
            if not mounts.mount_is_device(top, major, minor):
                raise DhvError(
                    f"{target} is a mount point of another device ({top.source}); "
                    "leaving it alone"
                )
            self.runner.run(["umount", target])
            done.append(top)
        raise DhvError(f"{target} is still mounted after repeated umount")

    def _mount_again(self, lv: LogicalVolume, unmounted: Sequence[mounts.Mount],
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
                self.fs.mount(lv.path, mount.mount_point, mount.fs_type, flags)
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


# in-use check ----------------------------------------------------------------------

# Per-mount flags carried over when delete mounts a volume again. Its file
# system options (mount_options) are not part of a delete request; when a
# holder made lvremove fail, the superblock it keeps alive still has them.
_VFS_FLAGS = frozenset({"ro", "rw", "nosuid", "nodev", "noexec", "noatime", "nodiratime",
                        "relatime", "strictatime", "nosymfollow"})
_NAMED = 8  # holders named in one error message; the rest are counted
# Pauses before looking again when something holds a volume: udev's probes
# (blkid after a change event on the LV) open the device for a moment, and
# only holders that stay count.
_SETTLE = (0.2, 0.5)
_SHOWN = 3  # files or processes named per holder


@dataclass(frozen=True)
class VolumeUsers:
    holders: tuple[str, ...]  # what keeps the file system busy, one description each
    pinned: tuple[str, ...]  # nsfs files pinning mount namespaces that no process is in


@dataclass(frozen=True)
class _NsMount:
    """A mountinfo line with the propagation fields that mounts.Mount leaves out."""

    mount: mounts.Mount
    shared: int | None  # its peer group ("shared:N")
    master: int | None  # the peer group it receives mounts and umounts from ("master:N")


def volume_users(major: int, minor: int, targets: Sequence[str], *,
                 proc: str = "/proc", sysfs: str = "/sys") -> VolumeUsers:
    """What holds the file system on block device major:minor, apart from its
    mounts at `targets`, which delete is about to take down.

    Anything found means lvremove would fail after the umount (or the umount
    itself would): processes in any mount namespace with their working or
    root directory, an open or mapped file, or the device itself on it;
    other mounts of it in this namespace and mounts inside it; its mounts in
    other mount namespaces (Nomad hands a host volume to a task's container
    by a bind mount there), except copies that umount propagation takes down
    with ours; block devices stacked on it and loop devices over it.
    """
    dev = os.makedev(major, minor)
    me = _readlink(f"{proc}/self")
    own_ns = _readlink(f"{proc}/self/ns/mnt") or ""
    holders: list[str] = []
    namespaces: dict[str, list[str]] = {}
    for pid in _pids(proc):
        base = f"{proc}/{pid}"
        ns = _readlink(f"{base}/ns/mnt")
        if ns is None:  # exited while we looked
            continue
        namespaces.setdefault(ns, []).append(pid)
        if pid != me:
            uses = _process_uses(base, major, minor, dev)
            if uses:
                holders.append(f"{_describe(proc, [pid])} holds it: {', '.join(uses)}")
    own = _parse_ns_mounts(_read(f"{proc}/self/mountinfo") or "")
    tables = {own_ns: own}
    for ns, pids in namespaces.items():
        if ns == own_ns:
            continue
        # Any process of the namespace shows its table; the first may just have exited.
        text = next((t for t in (_read(f"{proc}/{p}/mountinfo") for p in pids) if t), None)
        if text is not None:
            tables[ns] = _parse_ns_mounts(text)
    holders += _mount_holders(tables, own_ns, namespaces, targets, major, minor, proc)
    holders += _device_holders(sysfs, major, minor, dev)
    pinned = tuple(m.mount.mount_point for m in own.values()
                   if m.mount.fs_type == "nsfs" and m.mount.root.startswith("mnt:[")
                   and m.mount.root not in namespaces)
    return VolumeUsers(tuple(holders), pinned)


def _in_use_message(req: Request, lv: LogicalVolume, holders: Sequence[str]) -> str:
    named = "; ".join(holders[:_NAMED])
    if len(holders) > _NAMED:
        named += f"; and {len(holders) - _NAMED} more"
    return (f"volume {req.volume_id} (LV {lv.vg}/{lv.name}) is in use, so nothing was "
            f"unmounted or removed: {named}. Stop what holds it, then delete again")


def _parse_ns_mounts(text: str) -> dict[int, _NsMount]:
    table: dict[int, _NsMount] = {}
    for line in text.splitlines():
        parsed = mounts.parse_mountinfo(line)
        if not parsed:
            continue
        groups: dict[str, int] = {}
        for field in line.partition(" - ")[0].split()[6:]:  # the optional fields
            key, _, value = field.partition(":")
            if key in ("shared", "master") and value.isdigit():
                groups[key] = int(value)
        table[parsed[0].mount_id] = _NsMount(parsed[0], groups.get("shared"),
                                             groups.get("master"))
    return table


def _mount_holders(tables: dict[str, dict[int, _NsMount]], own_ns: str,
                   namespaces: dict[str, list[str]], targets: Sequence[str],
                   major: int, minor: int, proc: str) -> list[str]:
    own = tables[own_ns]
    wanted = {os.path.normpath(t) for t in targets}
    ours = [m for m in own.values()
            if m.mount.mount_point in wanted and mounts.mount_is_device(m.mount, major, minor)]
    ours_ids = {m.mount.mount_id for m in ours}
    receivers = _receivers(tables.values())
    holders: list[str] = []
    inside: dict[int, str] = {}
    for target in ours:
        prefix = target.mount.mount_point.rstrip("/") + "/"
        for m in own.values():
            if m.mount.mount_point.startswith(prefix):
                inside[m.mount.mount_id] = m.mount.mount_point
    holders += [f"{point} is mounted inside it" for point in dict.fromkeys(inside.values())]
    for m in own.values():
        if (m.mount.mount_id not in ours_ids and m.mount.mount_id not in inside
                and mounts.mount_is_device(m.mount, major, minor)
                and not _is_copy(m, own, ours, own, receivers)):
            holders.append(f"it is also mounted at {m.mount.mount_point}")
    for ns, table in tables.items():
        if ns == own_ns:
            continue
        points = [m.mount.mount_point for m in table.values()
                  if mounts.mount_is_device(m.mount, major, minor)
                  and not _is_copy(m, table, ours, own, receivers)]
        if points:
            holders.append(f"it is mounted at {', '.join(dict.fromkeys(points))} in the mount "
                           f"namespace of {_describe(proc, namespaces[ns])}")
    return holders


def _receivers(tables: Collection[dict[int, _NsMount]]) -> dict[int, set[int]]:
    """Peer group -> every peer group that receives mount events from it
    (itself included), through slaves that are shared in turn."""
    edges: dict[int, set[int]] = {}
    for table in tables:
        for m in table.values():
            if m.master is not None and m.shared is not None:
                edges.setdefault(m.master, set()).add(m.shared)
    closure: dict[int, set[int]] = {}
    for start in {g for table in tables for m in table.values()
                  for g in (m.shared, m.master) if g is not None}:
        seen, todo = {start}, [start]
        while todo:
            for nxt in edges.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        closure[start] = seen
    return closure


def _is_copy(m: _NsMount, table: dict[int, _NsMount], ours: Sequence[_NsMount],
             own: dict[int, _NsMount], receivers: dict[int, set[int]]) -> bool:
    """Whether unmounting `ours` takes `m` down too, as the kernel's umount
    propagation does: `m` sits on a mount that receives mount events from the
    parent of one of ours, at the same place in that parent's file system,
    and has nothing mounted on top of it. Such copies appear in every mount
    namespace that is a slave of this one (systemd's sandboxed services)."""
    if any(c.mount.parent_id == m.mount.mount_id for c in table.values()):
        return False
    parent = table.get(m.mount.parent_id)
    if parent is None:
        return False
    for target in ours:
        tparent = own.get(target.mount.parent_id)
        if tparent is None or tparent.shared is None:
            continue  # a private parent propagates nothing
        reach = receivers.get(tparent.shared, {tparent.shared})
        if not ((parent.shared is not None and parent.shared in reach)
                or (parent.master is not None and parent.master in reach)):
            continue
        if ((parent.mount.major, parent.mount.minor)
                == (tparent.mount.major, tparent.mount.minor)
                and m.mount.root == target.mount.root
                and _dentry(m.mount, parent.mount) == _dentry(target.mount, tparent.mount)):
            return True
    return False


def _dentry(m: mounts.Mount, parent: mounts.Mount) -> str:
    """Where `m` is mounted, as a path inside its parent's file system."""
    rel = os.path.relpath(m.mount_point, parent.mount_point)
    return os.path.normpath(os.path.join(parent.root, rel))


def _process_uses(base: str, major: int, minor: int, dev: int) -> list[str]:
    uses: list[str] = []
    for link, what in (("cwd", "working directory"), ("root", "root directory")):
        st = _stat(f"{base}/{link}")
        if st is not None and st.st_dev == dev:
            uses.append(f"{what} {_readlink(f'{base}/{link}') or '?'}")
    opened: list[str] = []
    try:
        fds = sorted(int(n) for n in os.listdir(f"{base}/fd") if n.isdigit())
    except OSError:
        fds = []
    for fd in fds:
        st = _stat(f"{base}/fd/{fd}")
        if st is not None and (st.st_dev == dev
                               or (stat.S_ISBLK(st.st_mode) and st.st_rdev == dev)):
            opened.append(_readlink(f"{base}/fd/{fd}") or f"descriptor {fd}")
    uses += _some("open file", opened)
    # Mapped files stay in use after their descriptor is closed (a program
    # run from the volume, a shared library, an mmap'ed database).
    mapped: list[str] = []
    for line in (_read(f"{base}/maps") or "").splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[4] == "0":
            continue
        hi, _, lo = parts[3].partition(":")
        try:
            if (int(hi, 16), int(lo, 16)) == (major, minor) and parts[5] not in opened:
                mapped.append(parts[5])
        except ValueError:
            continue
    uses += _some("mapped file", list(dict.fromkeys(mapped)))
    return uses


def _device_holders(sysfs: str, major: int, minor: int, dev: int) -> list[str]:
    try:
        stacked = sorted(os.listdir(f"{sysfs}/dev/block/{major}:{minor}/holders"))
    except OSError:
        stacked = []
    found = [f"block device {name} is stacked on it" for name in stacked]
    for path in sorted(glob.glob(f"{sysfs}/block/loop*/loop/backing_file")):
        backing = (_read(path) or "").strip().removesuffix(" (deleted)")
        st = _stat(backing) if backing else None
        if st is not None and (st.st_dev == dev
                               or (stat.S_ISBLK(st.st_mode) and st.st_rdev == dev)):
            found.append(f"loop device /dev/{path.split('/')[-3]} is backed by {backing}")
    return found


def _some(label: str, items: Sequence[str]) -> list[str]:
    if not items:
        return []
    text = f"{label}{'s' if len(items) > 1 else ''} {', '.join(items[:_SHOWN])}"
    if len(items) > _SHOWN:
        text += f" and {len(items) - _SHOWN} more"
    return [text]


def _describe(proc: str, pids: Sequence[str]) -> str:
    """E.g. 'process 12 (sleep) in cgroup /nomad.slice/...': the cgroup names the
    Nomad allocation or container the processes belong to."""
    shown = ", ".join(f"{pid} ({(_read(f'{proc}/{pid}/comm') or '?').strip()})"
                      for pid in pids[:_SHOWN])
    text = f"process {shown}" if len(pids) == 1 else f"processes {shown}"
    if len(pids) > _SHOWN:
        text += f" and {len(pids) - _SHOWN} more"
    cgroup = _cgroup(_read(f"{proc}/{pids[0]}/cgroup") or "")
    return f"{text} in cgroup {cgroup}" if cgroup else text


def _cgroup(text: str) -> str:
    """The unified (v2) or systemd (v1) cgroup path of /proc/PID/cgroup; "" for the root."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hierarchy == "0" and not controllers) or controllers == "name=systemd":
            return "" if path == "/" else path
    return ""


def _pids(proc: str) -> list[str]:
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    return [str(n) for n in sorted(int(name) for name in names if name.isdigit())]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:  # the process exited, or the kernel refuses (EACCES, EINVAL)
        return None


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None
