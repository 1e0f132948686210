"""The fake block devices: what blkid finds on an LV or a loop device, the
file system tools that write it (wipefs, mkfs, btrfstune), loop devices
(losetup), and the kernel's view of a device node."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from csi_local.errors import DeviceMissing
from csi_local.host.kernel import Kernel
from tests.unit.fakes.common import (
    _MIN_FS,
    DM_MAJOR,
    LOOP_MAJOR,
    _Fail,
    _one,
    _options,
)

if TYPE_CHECKING:
    from tests.unit.fakes.crypt import Luks
    from tests.unit.fakes.lvm import FakeLv


@dataclass
class Content:
    """What blkid would find on a device. fs None: blank."""

    fs: str | None = None
    uuid: str = ""
    fs_size: int = 0  # bytes the file system spans (grows only with resize2fs & co.)
    ambivalent: bool = False  # stray/conflicting signatures: blkid exits 8
    unreadable: bool = False  # reads fail: blkid finds nothing, read_error says why
    written: bool = False  # something wrote to it (a thin volume then maps blocks)
    luks: Luks | None = None  # a LUKS2 header (fakes/crypt.py): its key and data area

    @property
    def holds_data(self) -> bool:
        return self.written or self.fs is not None or self.ambivalent


@dataclass
class FakeLoop:
    backing: str  # as /sys/block/loopN/loop/backing_file shows it
    readonly: bool
    content: Content = field(default_factory=Content)  # used when backed by a plain file


@dataclass
class _Dev:
    """A block device as a command sees it, resolved from any of its paths."""

    node: str  # /dev/dm-N or /dev/loopN
    numbers: tuple[int, int]
    source: str  # what mountinfo shows as the source
    size: int
    content: Content
    readonly: bool


class FakeDevices(Kernel):
    """Block devices, their content and loop devices (a FakeHost part)."""

    loops: dict[int, FakeLoop]  # attached loop devices, by number
    _loop_nodes: set[int]  # loop nodes ever made (they outlive detach)
    _uuids: int

    if TYPE_CHECKING:  # what it uses of the other parts (fakehost.FakeHost has all)
        def lv(self, name: str, vg: str | None = None) -> FakeLv: ...
        def _active_lv(self, path: str) -> FakeLv | None: ...
        @staticmethod
        def _mapper(lv: FakeLv) -> str: ...
        def _follow(self, path: str) -> str: ...
        def _is_open(self, dev_node: str) -> bool: ...
        def _mapper_device(self, path: str) -> _Dev | None: ...

    def set_content(self, name: str, fs: str | None = None, *, ambivalent: bool = False,
                    unreadable: bool = False, uuid: str | None = None,
                    fs_size: int | None = None, vg: str | None = None) -> Content:
        """Replace what the LV's device holds (fs None: blank)."""
        lv = self.lv(name, vg)
        lv.content = Content(fs, uuid or (self._uuid() if fs else ""),
                             lv.size if fs_size is None else fs_size, ambivalent, unreadable)
        return lv.content

    def device_numbers(self, path: str) -> tuple[int, int] | None:
        """major:minor of a device node, also through a node bound onto `path`
        (stat follows the bind). None for anything that is not a block device."""
        node = self._follow(path)
        dev = self._device(node)
        if dev is not None:
            return dev.numbers
        m = re.fullmatch(r"/dev/loop(\d+)", node)
        if m and int(m.group(1)) in self._loop_nodes:
            return LOOP_MAJOR, int(m.group(1))
        return None

    def loop_backing(self, node: str) -> str | None:
        m = re.fullmatch(r"/dev/loop(\d+)", os.path.normpath(node))
        loop = self.loops.get(int(m.group(1))) if m else None
        return loop.backing if loop else None

    def device_size(self, path: str) -> int:
        dev = self._device(self._follow(path))
        if dev is None:
            raise FileNotFoundError(path)
        return dev.size

    def read_error(self, path: str, length: int = 1 << 20) -> str | None:
        dev = self._device(self._follow(path))
        if dev is None:
            return "No such file or directory"
        return "Input/output error" if dev.content.unreadable else None

    def wait_for_device(self, path: str, timeout: float = 30.0) -> None:
        if self.device_numbers(path) is None:
            raise DeviceMissing(f"device {path} did not appear within {timeout:.0f}s")

    def _uuid(self) -> str:
        self._uuids += 1
        return f"{self._uuids:08x}-0000-4000-8000-000000000000"

    def _device(self, path: str) -> _Dev | None:
        lv = self._active_lv(path)
        if lv is not None:
            return _Dev(f"/dev/dm-{lv.minor}", (DM_MAJOR, lv.minor), self._mapper(lv), lv.size,
                        lv.content, False)
        crypt = self._mapper_device(path)
        if crypt is not None:
            return crypt
        m = re.fullmatch(r"/dev/loop(\d+)", path)
        if m is None or (loop := self.loops.get(int(m.group(1)))) is None:
            return None
        if loop.backing.startswith("/dev/"):
            under = self._device(loop.backing)
            size, content = (under.size, under.content) if under else (0, loop.content)
        else:
            size, content = os.path.getsize(loop.backing), loop.content
        return _Dev(path, (LOOP_MAJOR, int(m.group(1))), path, size, content, loop.readonly)

    def _need_device(self, path: str, rc: int, message: str) -> _Dev:
        dev = self._device(self._follow(path))
        if dev is None:
            raise _Fail(rc, message.format(d=path) + "\n")
        return dev

    def _blkid(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"-o"}, {"-p"})
        assert "-p" in opts and opts.get("-o") == ["export"], f"FakeHost: {argv!r}"
        (path,) = _one(pos, argv)
        dev = self._need_device(path, 2, "error: {d}: No such file or directory")
        c = dev.content
        if c.unreadable or (c.fs is None and not c.ambivalent):
            raise _Fail(2, "")
        if c.ambivalent:
            raise _Fail(8, "")
        return f"DEVNAME={path}\nUUID={c.uuid}\nBLOCK_SIZE=4096\nTYPE={c.fs}\nUSAGE=filesystem\n"

    def _writable(self, path: str, tool: str) -> _Dev:
        """A device a tool may write: present, readable, not in use."""
        dev = self._need_device(path, 1, tool + ": cannot open {d}: No such file or directory")
        if dev.content.unreadable or dev.readonly:
            why = "Read-only file system" if dev.readonly else "Input/output error"
            raise _Fail(1, f"{tool}: {path}: {why}\n")
        if self._is_open(dev.node):
            raise _Fail(1, f"{tool}: {path} is mounted or in use; will not make a filesystem "
                           "here!\n")
        return dev

    def _wipefs(self, argv: Sequence[str]) -> str:
        _, pos = _options(argv, (), {"--all"})
        dev = self._writable(_one(pos, argv)[0], "wipefs")
        dev.content.fs, dev.content.ambivalent, dev.content.uuid = None, False, ""
        dev.content.written = True  # zeros over the signatures: blocks mapped all the same
        return ""

    def _mkfs(self, argv: Sequence[str]) -> str:
        fs = argv[0].removeprefix("mkfs.")
        path = argv[-1]
        dev = self._writable(path, argv[0])
        c = dev.content
        forced = "-F" in argv if fs == "ext4" else "-f" in argv
        if (c.fs or c.ambivalent) and not forced:
            raise _Fail(1, f"{argv[0]}: {path} appears to contain an existing filesystem "
                           f"({c.fs or 'unknown'}).\n")
        if dev.size < _MIN_FS.get(fs, 0):
            raise _Fail(1, f"{argv[0]}: {path} is too small to make a usable filesystem\n")
        c.fs, c.ambivalent, c.uuid, c.fs_size = fs, False, self._uuid(), dev.size
        c.written = True
        return ""

    def _btrfstune(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, (), {"-f", "-m"})
        assert "-m" in opts, f"FakeHost: {argv!r}"
        dev = self._writable(_one(pos, argv)[0], "btrfstune")
        if dev.content.fs != "btrfs":
            raise _Fail(1, f"ERROR: {pos[0]} is not a btrfs filesystem\n")
        dev.content.uuid = self._uuid()
        return ""

    def _losetup(self, argv: Sequence[str]) -> str:
        opts, pos = _options(argv, {"--detach", "--associated"},
                             {"--find", "--show", "--read-only", "--direct-io=on"})
        if "--detach" in opts:
            node = opts["--detach"][-1]
            m = re.fullmatch(r"/dev/loop(\d+)", node)
            if not m or self.loops.pop(int(m.group(1)), None) is None:
                raise _Fail(1, f"losetup: {node}: detach failed: No such device or address\n")
            return ""
        if "--associated" in opts:
            path = os.path.realpath(opts["--associated"][-1])
            return "".join(f"/dev/loop{n}: [0]:0 ({lo.backing})\n"
                           for n, lo in sorted(self.loops.items()) if lo.backing == path)
        assert "--find" in opts and "--show" in opts, f"FakeHost: {argv!r}"
        (path,) = _one(pos, argv)
        if path.startswith("/dev/"):
            backing = self._need_device(path, 1, "losetup: {d}: failed to set up loop device: "
                                                  "No such file or directory").node
        elif os.path.exists(path):
            backing = os.path.realpath(path)
        else:
            raise _Fail(1, f"losetup: {path}: failed to set up loop device: No such file or "
                           "directory\n")
        n = min(set(range(len(self.loops) + 1)) - set(self.loops))
        self.loops[n] = FakeLoop(backing, "--read-only" in opts)
        self._loop_nodes.add(n)
        return f"/dev/loop{n}\n"
