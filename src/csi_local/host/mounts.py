"""The mount table, read from /proc/self/mountinfo.

stat()-based mount-point checks lie on overlays and with bind mounts of files;
mountinfo is the kernel's own answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        return field  # nearly every field: no work per character
    out = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class Mount:
    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    options: frozenset[str]
    fs_type: str
    source: str
    super_options: frozenset[str]

    @property
    def read_only(self) -> bool:
        return "ro" in self.options

    @property
    def fs_read_only(self) -> bool:
        return "ro" in self.super_options


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        left, _, right = line.partition(" - ")
        fields = left.split()
        rfields = right.split()
        major, _, minor = fields[2].partition(":")
        mounts.append(
            Mount(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                major=int(major),
                minor=int(minor),
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=frozenset(fields[5].split(",")),
                fs_type=rfields[0] if rfields else "",
                source=_unescape(rfields[1]) if len(rfields) > 1 else "",
                super_options=frozenset(rfields[2].split(",")) if len(rfields) > 2 else frozenset(),
            )
        )
    return mounts


def read_mounts(path: str = MOUNTINFO) -> list[Mount]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())


def mounts_at(path: str, mounts: list[Mount] | None = None) -> list[Mount]:
    """Mounts whose mount point is `path` (normalised), oldest first."""
    target = os.path.normpath(path)
    if mounts is None:
        return read_mounts_at(target)
    return [m for m in mounts if m.mount_point == target]


def _escape(field: str) -> str:
    """A path as mountinfo writes it (the kernel's mangle: \\ooo for space,
    tab, newline and backslash)."""
    for ch in "\\ \t\n":
        field = field.replace(ch, f"\\{ord(ch):03o}")
    return field


def read_mounts_at(path: str, source: str = MOUNTINFO) -> list[Mount]:
    """mounts_at(path) of the live table, parsing only the lines that name
    `path`: a node's table holds hundreds of mounts, and stage, publish and
    their undoing each ask about one path."""
    target = os.path.normpath(path)
    needle = f" {_escape(target)} "
    with open(source, encoding="utf-8", errors="surrogateescape") as f:
        text = f.read()
    if needle not in text:
        return []
    lines = "\n".join(line for line in text.splitlines() if needle in line)
    return [m for m in parse_mountinfo(lines) if m.mount_point == target]


def is_mount_point(path: str) -> bool:
    return bool(mounts_at(path))


def top_mount(path: str) -> Mount | None:
    """The mount visible at `path` (the last one stacked there)."""
    found = mounts_at(path)
    return found[-1] if found else None


def device_numbers(device: str) -> tuple[int, int]:
    st = os.stat(device)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def loop_backing(node: str) -> str | None:
    """The backing file of a loop device node such as /dev/loop3, if attached."""
    name = os.path.basename(node)
    if not name.startswith("loop"):
        return None
    try:
        with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def mount_node(mount: Mount) -> str | None:
    """For a device node bind-mounted onto a file, the node's path under /dev."""
    if mount.fs_type == "devtmpfs" and mount.root.startswith("/"):
        return "/dev" + mount.root
    return None


def mount_is_device(
    mount: Mount, major: int, minor: int, *,
    numbers: Callable[[str], tuple[int, int]] | None = None,
    backing: Callable[[str], str | None] | None = None,
) -> bool:
    """True when `mount` shows the block device major:minor: as a file system
    mounted from it, as the device node bind-mounted onto a file, or as a
    (read-only) loop device over that node bind-mounted onto a file.

    `numbers` and `backing` answer for device nodes and loop devices (OSError
    from `numbers` when there is no such node); a fake host passes its own.
    """
    numbers = numbers or device_numbers
    backing = backing or loop_backing
    if (mount.major, mount.minor) == (major, minor):
        return True
    if mount.major == 0 and mount.source.startswith("/dev/"):
        # btrfs shows an anonymous device number (0:N) in mountinfo; its source
        # names the device it was mounted from.
        try:
            return numbers(mount.source) == (major, minor)
        except OSError:
            return False
    node = mount_node(mount)
    if node is None:
        return False
    try:
        if numbers(node) == (major, minor):
            return True
        file = backing(node)
        return file is not None and numbers(file) == (major, minor)
    except OSError:
        return False
