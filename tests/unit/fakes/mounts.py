"""The fake mount table: mount(8) and umount(8) as the plugin runs them,
bind mounts of directories and device nodes, remounts, FIFREEZE/FITHAW and
the file system tools that work on a mounted file system (resize2fs & co.)."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from csi_local.host import filesystem_rules as fsrules
from csi_local.host import kernel as host_mod
from csi_local.host import mounts
from csi_local.host.kernel import Kernel
from csi_local.host.mounts import Mount
from csi_local.host.runner import Result
from tests.unit.fakes.common import (
    _VFS_FLAGS,
    _WRONG_FS,
    DEVTMPFS,
    DM_MAJOR,
    HOST_FS,
    _Fail,
    _one,
    _options,
)
from tests.unit.fakes.devices import FakeLoop, _Dev

if TYPE_CHECKING:
    from tests.unit.fakes.lvm import FakeLv


@dataclass
class _Rec:
    mount: Mount
    dev_node: str | None  # the device whose file system this mount shows (None: a node bind)


class FakeMounts(Kernel):
    """The mount table (a FakeHost part)."""

    _table: list[_Rec]  # the mount table, in mount order
    _next_mount_id: int
    _next_anon: int  # the next anonymous device minor (btrfs)
    # File systems frozen with FIFREEZE, by device numbers. The kernel of
    # Debian 12 (6.1) cannot nest LVM's lockfs suspend of a thin origin in
    # such a freeze; newer ones can (`nested_freeze`).
    frozen: set[tuple[int, int]]
    nested_freeze: bool

    if TYPE_CHECKING:  # what it uses of the other parts (fakehost.FakeHost has all)
        calls: list[tuple[str, ...]]
        loops: dict[int, FakeLoop]

        def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
                input: str | bytes | None = None, timeout: float | None = None) -> Result: ...
        def lv(self, name: str, vg: str | None = None) -> FakeLv: ...
        def _device(self, path: str) -> _Dev | None: ...
        def _need_device(self, path: str, rc: int, message: str) -> _Dev: ...

    def remount_fs_read_only(self, name: str, vg: str | None = None) -> None:
        """What the kernel does on I/O errors with errors=remount-ro: the LV's file
        system turns read-only at its superblock, so every mount of it (binds
        too) shows "ro" in its super options; per-mount options stay."""
        node = f"/dev/dm-{self.lv(name, vg).minor}"
        for rec in self._table:
            if rec.dev_node == node:
                sup = (rec.mount.super_options - {"rw"}) | {"ro"}
                rec.mount = dataclasses.replace(rec.mount, super_options=sup)

    def add_mount(self, mount_point: str, *, fs_type: str = "tmpfs", source: str = "tmpfs",
                  major: int = 0, minor: int = 60, options: Iterable[str] = ("rw",)) -> Mount:
        """A mount the plugin did not make (something else's, at a path it uses)."""
        return self._add(mount_point, (major, minor), "/", fs_type, source,
                         frozenset(options), frozenset({"rw"}), None)

    def mounts(self) -> list[Mount]:
        return [r.mount for r in self._table]

    def mounts_at_path(self, path: str) -> list[Mount]:
        return mounts.mounts_at(path, self.mounts())

    def mount_filesystem(self, device: str, target: str, fs_type: str,
                         options: Sequence[str]) -> bool:
        if host_mod.mount_call(options) is None:
            return False  # the caller runs mount(8)
        argv = ["mount", "-t", fs_type, *(["-o", ",".join(options)] if options else [])]
        self.run([*argv, device, target])
        return True

    def bind_mount(self, source: str, target: str) -> None:
        self.run(["mount", "--bind", source, target])

    def remount_bind(self, target: str, options: Sequence[str], *,
                     readonly: bool = False) -> None:
        # mount(8)'s last option wins: "ro" last is the real host's `readonly`.
        ro = ["ro"] if readonly else []
        self.run(["mount", "-o", ",".join(["remount", "bind", *options, *ro]), target])

    def unmount(self, target: str) -> None:
        self.run(["umount", target])

    def _follow(self, path: str) -> str:
        """The device node a path shows: itself, or the node bound onto it."""
        path = os.path.normpath(path)
        top = self.top_mount(path)
        node = mounts.mount_node(top) if top is not None else None
        return node or path

    def _is_open(self, dev_node: str) -> bool:
        return (any(r.dev_node == dev_node for r in self._table)
                or any(loop.backing == dev_node for loop in self.loops.values()))

    def _mounted(self, path: str, fs: str, argv: Sequence[str]) -> _Dev:
        """The device of the `fs` file system mounted at `path` (xfs_growfs, btrfs)."""
        top = self.top_mount(path)
        rec = next((r for r in self._table if r.mount == top), None)
        dev = self._device(rec.dev_node) if rec and rec.dev_node else None
        if top is None or top.fs_type != fs or dev is None:
            raise _Fail(1, f"{argv[0]}: {path} is not a mounted {fs} filesystem\n")
        return dev

    def _grow(self, argv: Sequence[str]) -> str:
        if argv[0] == "resize2fs" and len(argv) == 2:
            dev = self._need_device(argv[1], 1, "resize2fs: No such file or directory while "
                                                "trying to open {d}")
            if dev.content.fs != "ext4":
                raise _Fail(1, "resize2fs: Bad magic number in super-block while trying to "
                               f"open {argv[1]}\n")
        elif argv[0] == "xfs_growfs" and len(argv) == 2:
            dev = self._mounted(argv[1], "xfs", argv)
        elif argv[1:4] == ("filesystem", "resize", "max") and len(argv) == 5:
            dev = self._mounted(argv[4], "btrfs", argv)
        else:
            raise AssertionError(f"FakeHost does not simulate {argv!r}")
        dev.content.fs_size = dev.size
        return ""

    def filesystem_size(self, device: str, mount_point: str, fs_type: str) -> int | None:
        """The bytes the file system on `device` spans, as mkfs and the grow
        tools left it."""
        dev = self._device(self._follow(device))
        if dev is None or dev.content.fs != fs_type:
            return None
        return dev.content.fs_size

    def freeze(self, mount_point: str) -> None:
        """FIFREEZE, recorded in `calls` as ("FIFREEZE", path)."""
        self.calls.append(("FIFREEZE", mount_point))
        top = self.top_mount(mount_point)
        if top is None or top.fs_type not in ("ext4", "xfs", "btrfs"):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        if (top.major, top.minor) in self.frozen:
            raise OSError(errno.EBUSY, "Device or resource busy")
        self.frozen.add((top.major, top.minor))

    def thaw(self, mount_point: str) -> bool:
        self.calls.append(("FITHAW", mount_point))
        top = self.top_mount(mount_point)
        if top is None or (top.major, top.minor) not in self.frozen:
            return False
        self.frozen.discard((top.major, top.minor))
        return True

    def _sync(self, argv: Sequence[str]) -> str:
        _, pos = _options(argv, (), {"--file-system"})
        if not os.path.exists(_one(pos, argv)[0]):
            raise _Fail(1, f"sync: error opening '{pos[0]}': No such file or directory\n")
        return ""

    def _add(self, target: str, numbers: tuple[int, int], root: str, fs_type: str, source: str,
             options: frozenset[str], super_options: frozenset[str],
             dev_node: str | None) -> Mount:
        self._next_mount_id += 1
        m = Mount(self._next_mount_id, 1, *numbers, root, os.path.realpath(target), options,
                  fs_type, source, super_options)
        self._table.append(_Rec(m, dev_node))
        return m

    def _mount(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"-t", "-o"}, {"--bind"})
        # mount(8) splits outside quotes, and drops SELinux's context options
        # where SELinux is disabled (as here): libmount's "SELinux garbage".
        flags = [o for v in opts.get("-o", []) for o in fsrules.split(v)
                 if o.split("=", 1)[0] not in fsrules.SELINUX_OPTIONS]
        if "--bind" in opts and not flags and "-t" not in opts:
            return self._bind(*_one(pos, argv, 2))
        if flags[:2] == ["remount", "bind"] and "-t" not in opts:
            return self._remount(_one(pos, argv)[0], flags[2:])
        if "-t" in opts and "remount" not in flags and "bind" not in flags:
            device, target = _one(pos, argv, 2)
            return self._mount_fs(opts["-t"][-1], flags, device, target)
        raise AssertionError(f"FakeHost does not simulate {argv!r}")

    def _mount_fs(self, fs: str, flags: list[str], device: str, target: str) -> str:
        if fs not in ("ext4", "xfs", "btrfs"):
            raise _Fail(32, f"mount: {target}: unknown filesystem type '{fs}'.\n")
        if not os.path.isdir(target):
            raise _Fail(32, f"mount: {target}: mount point does not exist.\n")
        dev = self._need_device(device, 32, f"mount: {target}: special device {{d}} does not "
                                            "exist.")
        c, wrong = dev.content, _WRONG_FS.format(t=target, d=device) + "\n"
        if c.fs != fs or c.ambivalent or c.unreadable:
            raise _Fail(32, wrong)
        others = [r for r in self._table if r.dev_node and r.dev_node != dev.node
                  and r.mount.fs_type == fs and (d := self._device(r.dev_node)) is not None
                  and d.content.uuid == c.uuid]
        if others and (fs == "btrfs" or (fs == "xfs" and "nouuid" not in flags)):
            raise _Fail(32, wrong)  # the kernel: a duplicate UUID is mounted already
        warning = ""
        ro = "ro" in flags
        if dev.readonly and not ro:
            ro, warning = True, f"mount: {target}: WARNING: source write-protected, mounted " \
                                "read-only.\n"
        vfs = {f for f in flags if f in _VFS_FLAGS} - {"ro", "rw"}
        if not vfs & {"noatime", "strictatime", "relatime"}:
            vfs.add("relatime")
        mode = "ro" if ro else "rw"
        numbers = dev.numbers
        if fs == "btrfs":  # btrfs shows an anonymous device, shared by its mounts
            same = [r.mount for r in self._table if r.dev_node == dev.node]
            if same:
                numbers = (same[0].major, same[0].minor)
            else:
                self._next_anon += 1
                numbers = (0, self._next_anon)
        sup = {f for f in flags if f not in _VFS_FLAGS and f != "defaults"}
        self._add(target, numbers, "/", fs, dev.source, frozenset({mode, *vfs}),
                  frozenset({mode, *sup}), dev.node)
        return warning

    def _bind(self, source: str, target: str) -> str:
        if not os.path.lexists(target):
            raise _Fail(32, f"mount: {target}: mount point does not exist.\n")
        if source.startswith("/dev/"):
            node = self._follow(source)
            numbers = self.device_numbers(node)
            if numbers is None:
                raise _Fail(32, f"mount: {target}: special device {source} does not exist.\n")
            if os.path.isdir(target):
                raise _Fail(32, f"mount: {target}: mount(2) system call failed: Not a "
                                "directory.\n")
            if numbers[0] == DM_MAJOR:
                node = f"/dev/dm-{numbers[1]}"  # /dev/VG/LV is a symlink to it
            self._add(target, DEVTMPFS, "/" + os.path.basename(node), "devtmpfs", "udev",
                      frozenset({"rw", "nosuid", "relatime"}), frozenset({"rw", "mode=755"}),
                      None)
            return ""
        if not os.path.exists(source):
            raise _Fail(32, f"mount: {target}: special device {source} does not exist.\n")
        if os.path.isdir(source) != os.path.isdir(target):
            raise _Fail(32, f"mount: {target}: mount(2) system call failed: Not a directory.\n")
        src = os.path.realpath(source)
        under = [r for r in self._table if src == r.mount.mount_point
                 or src.startswith(r.mount.mount_point.rstrip("/") + "/")]
        if not under:
            self._add(target, HOST_FS, src, "tmpfs", "tmpfs", frozenset({"rw", "relatime"}),
                      frozenset({"rw"}), None)
            return ""
        longest = max(len(r.mount.mount_point) for r in under)
        rec = [r for r in under if len(r.mount.mount_point) == longest][-1]  # the top one
        m = rec.mount
        rel = os.path.relpath(src, m.mount_point)
        root = m.root if rel == "." else os.path.join(m.root, rel)
        self._add(target, (m.major, m.minor), root, m.fs_type, m.source, m.options,
                  m.super_options, rec.dev_node)
        return ""

    def _remount(self, target: str, flags: list[str]) -> str:
        top = self.top_mount(target)
        if top is None:
            raise _Fail(32, f"mount: {target}: mount point not mounted or bad option.\n")
        opts = set(top.options)
        for f in (f for f in flags if f in _VFS_FLAGS):
            if f in ("ro", "rw"):
                opts -= {"ro", "rw"}
            opts.add(f)
        rec = next(r for r in self._table if r.mount == top)
        rec.mount = dataclasses.replace(top, options=frozenset(opts))
        return ""

    def _umount(self, argv: Sequence[str]) -> str:
        _, pos = _options(argv, ())
        target = os.path.realpath(_one(pos, argv)[0])
        top = self.top_mount(target)
        if top is None:
            raise _Fail(32, f"umount: {target}: not mounted.\n")
        i = next(i for i, r in enumerate(self._table) if r.mount == top)
        if any(r.mount.mount_point.startswith(target.rstrip("/") + "/")
               for r in self._table[i + 1:]):
            raise _Fail(32, f"umount: {target}: target is busy.\n")
        del self._table[i]
        return ""
