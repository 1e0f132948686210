"""File-system rules shared by the CSI plugin and the Nomad host volume plugin:
the file systems they make, the smallest volume each can be made on, and
which mount options a request may pass (CSI mount_flags and the host volume
plugin's mount_options alike).

Options reach mount(8) as one `-o` list (or, when host.mount_call knows each
of them, the one mount(2) call that mount(8) would make). Some options are
not options of the file system but turn `mount DEV DIR` into another
operation (remount, bind, move), make mount(8) set up devices or directories
of its own (loop, X-mount.mkdir), or change mount propagation; none of those
may come from a request. No processes or heavy imports here: the host volume plugin's
fingerprint path imports it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable

from csi_local.errors import MountOptionError

SUPPORTED_FS = ("ext4", "xfs", "btrfs")
# mkfs refuses smaller devices: mkfs.xfs needs 300 MiB, mkfs.btrfs 114 MiB
# (btrfs-progs 6.2; rounded up for a margin). mkfs.ext4 (e2fsprogs 1.47) makes
# one down to about 200 KiB, but below 2 MiB without a journal ("Filesystem
# too small for a journal", a warning only): 2 MiB is the smallest ext4 that
# is one. Volumes are made at least this big.
MIN_SIZE = {"ext4": 2 << 20, "xfs": 300 << 20, "btrfs": 128 << 20}


def min_size(fs_type: str) -> int:
    """The smallest volume `fs_type` can be made on (0: no limit that matters)."""
    return MIN_SIZE.get(fs_type, 0)


def mkfs_available(fs_type: str) -> bool:
    """Whether this node has the mkfs of `fs_type` (in the system's own
    directories: a PATH of the caller's never chooses the program)."""
    return shutil.which(f"mkfs.{fs_type}", path="/usr/sbin:/usr/bin:/sbin:/bin") is not None


def filesystem_problem(fs_type: str) -> str | None:
    """Why volumes of `fs_type` cannot be made here (not one this plugin
    makes, or its mkfs missing on this node), or None."""
    if fs_type not in SUPPORTED_FS:
        return f"fs type {fs_type!r} is not supported (use one of {', '.join(SUPPORTED_FS)})"
    if not mkfs_available(fs_type):
        return f"fs type {fs_type!r} is not supported on this node: mkfs.{fs_type} is missing"
    return None


_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789=_-.:/+@")
# SELinux's mount options (kubelet passes `context="..."` when the CSIDriver has
# seLinuxMount). Their value is a security context, whose MLS/MCS range holds
# commas (s0:c10,c20): quoted, as mount(8) (libmount) and the kernel take it,
# so that the commas do not split the option list.
SELINUX_OPTIONS = frozenset({"context", "fscontext", "defcontext", "rootcontext"})
_CONTEXT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:,")
FORBIDDEN = frozenset({
    "remount", "bind", "rbind", "move", "loop", "offset", "sizelimit",
    "shared", "rshared", "private", "rprivate", "slave", "rslave", "unbindable",
    "runbindable", "make-shared", "make-rshared", "make-private", "make-rprivate",
    "make-slave", "make-rslave", "make-unbindable", "make-runbindable",
})
_FORBIDDEN_PREFIXES = ("x-mount.",)


def split(flag: str) -> list[str]:
    """The options of one comma-separated list, as libmount splits it: a comma
    inside double quotes belongs to the option (`context="u:r:t:s0:c1,c2"`).
    The quotes stay: mount(8) passes them on, and the kernel strips them."""
    parts: list[str] = []
    start, quoted = 0, False
    for i, ch in enumerate(flag):
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append(flag[start:i])
            start = i + 1
    parts.append(flag[start:])
    return parts


def _valid(opt: str) -> bool:
    if not opt or opt.startswith("-"):
        return False
    if set(opt) <= _CHARS:
        return True
    # Quotes (and commas) only around a whole SELinux context: key="value".
    key, eq, value = opt.partition("=")
    return (eq == "=" and key.lower() in SELINUX_OPTIONS and len(value) > 2
            and value[0] == value[-1] == '"' and set(value[1:-1]) <= _CONTEXT_CHARS
            and not value[1:-1].startswith(","))


def check(flags: Iterable[str]) -> list[str]:
    """Each option of `flags` (a flag may itself hold several, comma-separated),
    in order; MountOptionError for any that is malformed or not allowed."""
    out: list[str] = []
    for flag in flags:
        for opt in split(flag):
            if not _valid(opt):
                raise MountOptionError(f"invalid mount option {opt!r} in {flag!r}")
            key = opt.split("=", 1)[0].lower()
            if key in FORBIDDEN or key.startswith(_FORBIDDEN_PREFIXES):
                raise MountOptionError(
                    f"mount option {opt!r} is not allowed: it would make mount do something "
                    "other than mount this volume"
                )
            out.append(opt)
    return out

