"""How many key derivations may run at once in this process: as many as the
memory it may use holds beside the plugin itself, and no more than its CPUs.

Every cryptsetup command that derives a key from a passphrase (luksFormat,
open, open --test-passphrase, a resize that asks for the passphrase) holds
argon2id's memory for the whole derivation, a second or more
(host/crypt.py's LuksSettings). Stages at once each ran their own: four in a
256 MiB memory cgroup (the shipped limit) were OOM-killed three times.
Crypt takes a slot of the process's DerivationSlots around each such
command; the count comes from the memory limit of the process's own cgroup
(cgroup v2's memory.max, v1's memory.limit_in_bytes, the lowest on the way
up to the root), read once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# The measured figures these rest on (tests/integration/test_encryption.py,
# test_an_encrypted_stage_fits_the_shipped_memory_limits, in the test VM):
# one `cryptsetup open` with argon2id at 64 MiB peaks at about 70 MiB RSS
# (VmHWM); the plugin itself takes 41 MiB idle and up to 68 MiB with
# 5,000 volumes, its lvm shell 9 MiB to 58 MiB (README, Performance).
#
# One derivation's peak, with a little room.
DERIVATION_PEAK_BYTES = 72 << 20
# What the plugin, its lvm shell and a command beside them (mkfs) take on a
# large node; the rest of the limit is for derivations.
PLUGIN_RESERVE_BYTES = 128 << 20
# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages).
_V1_UNLIMITED = 1 << 60


def _limit_in(base: Path, cgroup_path: str, file: str) -> int | None:
    """The lowest limit in `file` from the cgroup at `cgroup_path` (under the
    hierarchy mounted at `base`) up to `base`: a container sees its own
    cgroup at `base` (a cgroup namespace), a host process its full path;
    a path missing here still reaches `base`'s own. None when no file holds
    a number ("max", absent: no limit)."""
    found: list[int] = []
    here = base / cgroup_path.strip("/")
    for directory in (here, *here.parents):
        try:
            text = (directory / file).read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) < _V1_UNLIMITED:
            found.append(int(text))
        if directory == base:
            break
    return min(found) if found else None


def memory_limit(root: str = "/") -> int | None:
    """The memory limit of this process's cgroup in bytes (cgroup v2's
    memory.max, else v1's memory.limit_in_bytes), the lowest on the way up;
    None when there is none or it cannot be read. `root`: where /proc and
    /sys are (a test's fake tree)."""
    try:
        lines = Path(root, "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # cgroup v2 (unified)
            limit = _limit_in(Path(root, "sys/fs/cgroup"), path, "memory.max")
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            limit = _limit_in(Path(root, "sys/fs/cgroup/memory"), path,
                              "memory.limit_in_bytes")
        else:
            continue
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def slot_count(limit: int | None, cpus: int) -> int:
    """How many derivations at once: what `limit` holds beside the plugin,
    at least one; no more than `cpus` (each derivation is one core's work
    for its whole time, and a luksFormat sharing a core fits fewer
    iterations into its one second); `cpus` when there is no limit."""
    if limit is None:
        return max(1, cpus)
    return max(1, min(cpus, (limit - PLUGIN_RESERVE_BYTES) // DERIVATION_PEAK_BYTES))


class DerivationSlots:
    """At most `count` key derivations at once: `with slots.hold(): ...`."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._semaphore = threading.BoundedSemaphore(count)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._semaphore:
            yield


_shared: DerivationSlots | None = None
_shared_lock = threading.Lock()


def shared() -> DerivationSlots:
    """The process's slots, sized at first use from its cgroup's memory
    limit and its CPUs."""
    global _shared
    with _shared_lock:
        if _shared is None:
            limit = memory_limit()
            cpus = len(os.sched_getaffinity(0))
            _shared = DerivationSlots(slot_count(limit, cpus))
            log.info("key derivations: at most %d at once (memory limit %s, %d CPUs)",
                     _shared.count, "none" if limit is None else f"{limit >> 20} MiB", cpus)
        return _shared
