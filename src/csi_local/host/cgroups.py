"""The cgroup v2 hierarchy: which cgroups exist, and their `io.max` files
(docs/qos.md). Every cgroup file the plugin reads or writes goes through
here, so the fake host models the kernel's side of them.

Cgroups are named by their path below the hierarchy's root
(`kubepods.slice/kubepods-pod<uid>.slice`); the root is where the host's
cgroup2 file system is mounted (`/sys/fs/cgroup`, the DaemonSet's and the
Nomad job's bind of it).

`io.max` (Documentation/admin-guide/cgroup-v2.rst, "IO Interface Files"):
one line per device that has a limit, `MAJ:MIN rbps=N wbps=N riops=N
wiops=N`, `max` for none; a device with no limit at all has no line. A
write of `MAJ:MIN key=value...` changes the keys it names and leaves the
others; a write setting all four to `max` removes the line.
"""

from __future__ import annotations

import os
import re

from csi_local.errors import CgroupError

DEFAULT_ROOT = "/sys/fs/cgroup"
IO_MAX = "io.max"
_LINE_RE = re.compile(r"([0-9]+):([0-9]+)((?: [a-z]+=[0-9a-z]+)*)")

Device = tuple[int, int]


def parse_io_max(text: str) -> dict[Device, dict[str, str]]:
    """`io.max` as the kernel prints it: {(major, minor): {key: value}}."""
    out: dict[Device, dict[str, str]] = {}
    for line in text.splitlines():
        match = _LINE_RE.fullmatch(line.strip())
        if match is None:
            continue
        keys = dict(part.split("=", 1) for part in match.group(3).split())
        out[(int(match.group(1)), int(match.group(2)))] = keys
    return out


def _relative(cgroup: str) -> str:
    """A cgroup's path below the root, never leaving it."""
    parts = [p for p in cgroup.split("/") if p]
    if any(p in (".", "..") or "\x00" in p for p in parts):
        raise ValueError(f"not a cgroup path: {cgroup!r}")
    return "/".join(parts)


class Cgroups:
    """The host's cgroup v2 hierarchy under `root`."""

    def __init__(self, root: str = DEFAULT_ROOT) -> None:
        self.root = root

    def _path(self, cgroup: str, *file: str) -> str:
        return os.path.join(self.root, _relative(cgroup), *file)

    def unified(self) -> bool:
        """Whether the root is a cgroup v2 hierarchy (v1 has no
        cgroup.controllers at its root, and no io.max anywhere)."""
        return os.path.isfile(os.path.join(self.root, "cgroup.controllers"))

    def exists(self, cgroup: str) -> bool:
        return os.path.isdir(self._path(cgroup))

    def children(self, cgroup: str) -> list[str]:
        """The names of a cgroup's child cgroups; [] when it is not there."""
        try:
            with os.scandir(self._path(cgroup)) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            return []

    def io_max(self, cgroup: str) -> dict[Device, dict[str, str]] | None:
        """A cgroup's io.max; None when it has none (the io controller is not
        enabled for it, or the cgroup is gone)."""
        try:
            with open(self._path(cgroup, IO_MAX), encoding="ascii") as f:
                return parse_io_max(f.read())
        except (OSError, UnicodeDecodeError):
            return None

    def set_io_max(self, cgroup: str, device: Device, keys: str) -> None:
        """Write `MAJ:MIN keys` to a cgroup's io.max; CgroupError when the
        kernel refuses it or the cgroup is gone."""
        line = f"{device[0]}:{device[1]} {keys}\n"
        try:
            # No O_CREAT: a cgroup file that is not there is not made as a
            # plain file of a directory that only looked like a cgroup.
            fd = os.open(self._path(cgroup, IO_MAX), os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, line.encode("ascii"))
            finally:
                os.close(fd)
        except OSError as err:
            raise CgroupError(f"cannot write {line.strip()!r} to {cgroup}/{IO_MAX}: "
                              f"{err.strerror}") from None
