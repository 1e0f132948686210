"""A volume's users: what keeps its file system busy (processes, other
mounts in any mount namespace, stacked block devices and loop devices).
"Hold" is the locks' word (host/locks.py); the kernel's own "holders"
directory in /sys is one of the places looked at here.

The host volume plugin asks before it unmounts anything on delete: an
unmount that cannot end in lvremove would leave Nomad a registered volume
whose directory is an empty one on the root file system. Read-only: it
looks at /proc and /sys and runs nothing.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from csi_local.host import mounts

_SHOWN = 3  # files or processes named per user


@dataclass(frozen=True)
class VolumeUsers:
    busy: tuple[str, ...]  # what keeps the file system busy, one description each
    pinned: tuple[str, ...]  # nsfs files pinning mount namespaces that no process is in


@dataclass(frozen=True)
class _NsMount:
    """A mountinfo line with the propagation fields that mounts.Mount leaves out."""

    mount: mounts.Mount
    shared: int | None  # its peer group ("shared:N")
    master: int | None  # the peer group it receives mounts and umounts from ("master:N")


def volume_users(major: int, minor: int, targets: Sequence[str], *,
                 proc: str = "/proc", sysfs: str = "/sys") -> VolumeUsers:
    """What uses the file system on block device major:minor, apart from its
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
    busy: list[str] = []
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
                busy.append(f"{_describe(proc, [pid])} holds it: {', '.join(uses)}")
    own = _parse_ns_mounts(_read(f"{proc}/self/mountinfo") or "")
    tables = {own_ns: own}
    for ns, pids in namespaces.items():
        if ns == own_ns:
            continue
        # Any process of the namespace shows its table; the first may just have exited.
        text = next((t for t in (_read(f"{proc}/{p}/mountinfo") for p in pids) if t), None)
        if text is not None:
            tables[ns] = _parse_ns_mounts(text)
    busy += _mount_users(tables, own_ns, namespaces, targets, major, minor, proc)
    busy += _device_users(sysfs, major, minor, dev)
    pinned = tuple(m.mount.mount_point for m in own.values()
                   if m.mount.fs_type == "nsfs" and m.mount.root.startswith("mnt:[")
                   and m.mount.root not in namespaces)
    return VolumeUsers(tuple(busy), pinned)


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


def _mount_users(tables: dict[str, dict[int, _NsMount]], own_ns: str,
                 namespaces: dict[str, list[str]], targets: Sequence[str],
                 major: int, minor: int, proc: str) -> list[str]:
    own = tables[own_ns]
    wanted = {os.path.normpath(t) for t in targets}
    ours = [m for m in own.values()
            if m.mount.mount_point in wanted and mounts.mount_is_device(m.mount, major, minor)]
    ours_ids = {m.mount.mount_id for m in ours}
    receivers = _receivers(tables.values())
    found: list[str] = []
    inside: dict[int, str] = {}
    for target in ours:
        prefix = target.mount.mount_point.rstrip("/") + "/"
        for m in own.values():
            if m.mount.mount_point.startswith(prefix):
                inside[m.mount.mount_id] = m.mount.mount_point
    found += [f"{point} is mounted inside it" for point in dict.fromkeys(inside.values())]
    for m in own.values():
        if (m.mount.mount_id not in ours_ids and m.mount.mount_id not in inside
                and mounts.mount_is_device(m.mount, major, minor)
                and not _is_copy(m, own, ours, own, receivers)):
            found.append(f"it is also mounted at {m.mount.mount_point}")
    for ns, table in tables.items():
        if ns == own_ns:
            continue
        points = [m.mount.mount_point for m in table.values()
                  if mounts.mount_is_device(m.mount, major, minor)
                  and not _is_copy(m, table, ours, own, receivers)]
        if points:
            found.append(f"it is mounted at {', '.join(dict.fromkeys(points))} in the mount "
                           f"namespace of {_describe(proc, namespaces[ns])}")
    return found


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


def _device_users(sysfs: str, major: int, minor: int, dev: int) -> list[str]:
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
