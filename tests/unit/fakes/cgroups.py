"""The fake cgroup v2 hierarchy: which cgroups exist and their io.max, as the
kernel keeps them (Documentation/admin-guide/cgroup-v2.rst, "io.max"): a
write names a device and some of its four keys and changes only those; a
value is a whole number above 0 or "max"; a device whose keys are all "max"
has no line; a cgroup without the io controller has no io.max at all, and a
write to a cgroup that is gone fails with ENOENT."""

from __future__ import annotations

import errno
import os

from csi_local.errors import CgroupError
from csi_local.host.cgroups import Cgroups, Device
from csi_local.volumes import qos


class FakeCgroups(Cgroups):
    def init_cgroups(self) -> None:
        self.root = "/sys/fs/cgroup"
        self.cgroup_v2 = True
        # cgroup path -> its io.max ({device: {key: value}}), None: no io controller
        self.cgroup_io: dict[str, dict[Device, dict[str, str]] | None] = {}
        self.cgroup_writes: list[tuple[str, Device, str]] = []

    def add_cgroup(self, path: str, *, io: bool = True) -> str:
        """The cgroup `path` and its parents, with the io controller (or not)."""
        parts = path.split("/")
        for i in range(1, len(parts)):
            self.cgroup_io.setdefault("/".join(parts[:i]), {})
        self.cgroup_io[path] = {} if io else None
        return path

    def remove_cgroup(self, path: str) -> None:
        for name in [p for p in self.cgroup_io if p == path or p.startswith(path + "/")]:
            del self.cgroup_io[name]

    def unified(self) -> bool:
        return self.cgroup_v2

    def exists(self, cgroup: str) -> bool:
        return self.cgroup_v2 and cgroup in self.cgroup_io

    def children(self, cgroup: str) -> list[str]:
        prefix = cgroup + "/"
        return sorted(p[len(prefix):] for p in self.cgroup_io
                      if p.startswith(prefix) and "/" not in p[len(prefix):])

    def io_max(self, cgroup: str) -> dict[Device, dict[str, str]] | None:
        found = self.cgroup_io.get(cgroup) if self.cgroup_v2 else None
        return None if found is None else {d: dict(k) for d, k in found.items()}

    def set_io_max(self, cgroup: str, device: Device, keys: str) -> None:
        self.cgroup_writes.append((cgroup, device, keys))
        if cgroup not in self.cgroup_io or not self.cgroup_v2:
            raise CgroupError(f"cannot write to {cgroup}/io.max: {os.strerror(errno.ENOENT)}")
        table = self.cgroup_io[cgroup]
        if table is None:
            raise CgroupError(f"cannot write to {cgroup}/io.max: {os.strerror(errno.ENOENT)}")
        line = dict(table.get(device, {k: qos.UNLIMITED for k in qos.KEYS}))
        for part in keys.split():
            key, _, value = part.partition("=")
            if key not in qos.KEYS or not (value == qos.UNLIMITED
                                          or (value.isdigit() and int(value) > 0)):
                raise CgroupError(f"cannot write to {cgroup}/io.max: "
                                  f"{os.strerror(errno.EINVAL)}")
            line[key] = value
        if all(v == qos.UNLIMITED for v in line.values()):
            table.pop(device, None)
        else:
            table[device] = line
