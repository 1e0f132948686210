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

from collections.abc import Iterable

from csi_local.errors import MountOptionError

SUPPORTED_FS = ("ext4", "xfs", "btrfs")
# mkfs refuses smaller devices: mkfs.xfs needs 300 MiB, mkfs.btrfs 114 MiB
# (btrfs-progs 6.2; rounded up for a margin). Volumes are made at least this big.
MIN_SIZE = {"xfs": 300 << 20, "btrfs": 128 << 20}


def min_size(fs_type: str) -> int:
    """The smallest volume `fs_type` can be made on (0: no limit that matters)."""
    return MIN_SIZE.get(fs_type, 0)


_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789=_-.:/+@")
FORBIDDEN = frozenset({
    "remount", "bind", "rbind", "move", "loop", "offset", "sizelimit",
    "shared", "rshared", "private", "rprivate", "slave", "rslave", "unbindable",
    "runbindable", "make-shared", "make-rshared", "make-private", "make-rprivate",
    "make-slave", "make-rslave", "make-unbindable", "make-runbindable",
})
_FORBIDDEN_PREFIXES = ("x-mount.",)


def check(flags: Iterable[str]) -> list[str]:
    """Each option of `flags` (a flag may itself hold several, comma-separated),
    in order; MountOptionError for any that is malformed or not allowed."""
    out: list[str] = []
    for flag in flags:
        parts = flag.split(",")
        for opt in parts:
            if not opt or not set(opt) <= _CHARS or opt.startswith("-"):
                raise MountOptionError(f"invalid mount option {opt!r} in {flag!r}")
            key = opt.split("=", 1)[0].lower()
            if key in FORBIDDEN or key.startswith(_FORBIDDEN_PREFIXES):
                raise MountOptionError(
                    f"mount option {opt!r} is not allowed: it would make mount do something "
                    "other than mount this volume"
                )
            out.append(opt)
    return out
