"""The one freeze rule: every file system the plugins freeze themselves
(FIFREEZE) around a thin snapshot is frozen under it, whatever the path: a
group snapshot's members, and the mounted encrypted source of a single
snapshot, a clone or the host volume plugin's `snapshot create` (LVM's own
lockfs suspend freezes a file system on the thin LV, not one on dm-crypt
above it).

1. A journal names every file system to be frozen (mount point and device
   numbers) before the first FIFREEZE: one file per window in the journal
   directory, `freezes/` under the lock directory that the CSI plugin and the
   host volume plugin share (/run/lock/csi-local/freezes by default), written
   atomically. A frozen file system stays frozen when the process that froze
   it dies; the journal is how the next one finds it. /run does not outlive
   a reboot, and neither does a freeze.
2. The window is bounded (DEFAULT_FREEZE_LIMIT, the CSI plugin's
   --group-freeze-timeout): when the limit passes, a timer thaws everything
   at once, even while lvcreate still runs (it is left to finish: killing
   LVM while it holds an origin suspended would leave the origin suspended),
   and the caller fails with FreezeTimeout once lvcreate returns, removing
   what it made: a snapshot cut after the thaw is no instant.
3. Everything frozen is thawed when the window closes, also after a failure,
   and the journal goes; a thaw that fails keeps the journal, so the next
   start (or the next window of the same name) tries again.
4. Leftover journals are thawed by the CSI plugin's start-up and by every
   run of the host volume plugin (create, delete, snapshot). A window that is
   still open holds a lock (the lock directory's key "freeze:<name>") from
   before its journal is written until after it is removed, so neither
   plugin ever thaws the other's live window. A thaw of a file system that is
   not frozen is harmless (EINVAL, ignored); a path that shows another device
   now (unmounted since) is left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from csi_local.errors import CannotQuiesce, FreezeTimeout, LockBusy
from csi_local.host.atomic_files import write_atomic
from csi_local.host.kernel import Kernel
from csi_local.host.locks import Locks
from csi_local.volumes.lock_keys import freeze_key

# Seconds a window may keep file systems frozen (--group-freeze-timeout):
# lvcreate takes well under a second per snapshot on real hardware.
DEFAULT_FREEZE_LIMIT = 10.0
JOURNAL_DIR = "freezes"  # under the lock directory
LIMIT_FLAG = "--group-freeze-timeout"

log = logging.getLogger(__name__)

# What a journal names: a mount point and the device numbers of the file
# system frozen there.
Target = tuple[str, tuple[int, int]]
# Told a leftover journal's entry after its thaw (the group layer deletes an
# unfinished group's members); None: the entry's extra fields are not this
# caller's to finish, so the journal is kept for the one they are.
Finisher = Callable[[Mapping[str, object]], None]


class FreezeWindow:
    """File systems frozen for at most `limit` seconds from the first freeze: a
    timer thaws them all when the limit passes, whatever the caller is doing
    then; check() says whether it did. Thread-safe between the caller and the
    timer: each frozen path is thawed exactly once."""

    def __init__(self, host: Kernel, limit: float, what: str, targets: Sequence[Target] = (),
                 limit_name: str = LIMIT_FLAG) -> None:
        self.host = host
        self.limit = limit
        self.what = what
        self.targets = list(targets)
        self.limit_name = limit_name
        self._lock = threading.Lock()
        self._frozen: list[str] = []
        self._timer: threading.Timer | None = None
        self._over = False  # thawed: by the timer (expired) or by close()
        self.expired = False
        self.stuck: list[str] = []  # frozen paths a thaw failed on
        self.started = self.ended = 0.0

    @property
    def seconds(self) -> float:
        """First freeze to last thaw; 0 when nothing was frozen."""
        return self.ended - self.started if self._timer is not None else 0.0

    def freeze_all(self) -> None:
        """Freeze every target, in order (the journal names them all)."""
        if self.targets:
            log.debug("%s: freezing %s for at most %g s", self.what,
                      ", ".join(p for p, _ in self.targets), self.limit)
        for path, _ in self.targets:
            self.freeze(path)

    def freeze(self, path: str) -> None:
        """FIFREEZE `path`; CannotQuiesce when the kernel refuses, FreezeTimeout
        when the limit passed meanwhile (the path is thawed again then)."""
        if self._timer is None:
            self.started = time.monotonic()
            self._timer = threading.Timer(self.limit, self._expire)
            self._timer.daemon = True
            self._timer.start()
        try:
            self.host.freeze(path)
        except OSError as err:
            raise CannotQuiesce(
                f"cannot freeze the file system at {path}: {err.strerror or err} "
                "(frozen by someone else, or a file system that cannot freeze)") from err
        with self._lock:
            if self._over:  # the timer thawed the others while this one froze
                self.stuck += thaw(self.host, [path], self.what)
            else:
                self._frozen.append(path)
        self.check()

    def check(self) -> None:
        """FreezeTimeout if the limit has passed: the timer thawed everything."""
        if self.expired:
            raise FreezeTimeout(
                f"{self.what}: the file systems were frozen for its limit of {self.limit:g} s "
                f"({self.limit_name}) before the snapshot was cut (LVM waited for its VG "
                "lock or a slow device): they were thawed and nothing is kept; retry")

    def _expire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.expired = True
            log.error("%s: writes held for the limit of %g s; thawing %s", self.what,
                      self.limit, ", ".join(self._frozen) or "nothing")
            self._thaw_all()

    def _thaw_all(self) -> None:
        self._over = True
        self.stuck += thaw(self.host, self._frozen, self.what)
        self.ended = time.monotonic()

    def close(self) -> list[str]:
        """Thaw what is still frozen (the timer's thaw is not repeated); the
        paths that could not be thawed. Closing again changes nothing."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if not self._over:
                self._thaw_all()
        return self.stuck


def thaw(host: Kernel, paths: Sequence[str], what: str) -> list[str]:
    """Thaw each path, the last frozen first; the ones that could not be thawed."""
    stuck = []
    for path in reversed(paths):
        try:
            host.thaw(path)
        except OSError as err:  # never hide the caller's own error; say it loudly
            log.error("could not thaw %s after %s: %s", path, what, err)
            stuck.append(path)
    return stuck


class Freezes:
    """Freeze windows and their journals, in `locks`' directory."""

    def __init__(self, host: Kernel, locks: Locks, limit: float = DEFAULT_FREEZE_LIMIT,
                 limit_name: str = LIMIT_FLAG) -> None:
        self.host = host
        self.locks = locks
        self.limit = limit  # seconds a window may keep its file systems frozen
        self.limit_name = limit_name  # how the limit is set, for messages
        self.directory = os.path.join(locks.directory, JOURNAL_DIR)

    def journal_path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    @contextlib.contextmanager
    def window(self, name: str, targets: Sequence[Target], what: str,
               extra: Mapping[str, object] | None = None, finish: Finisher | None = None,
               timeout: float | None = None) -> Iterator[FreezeWindow]:
        """A window named `name` (unique among open ones: a journal file name)
        over `targets`; the caller freezes them (freeze_all) and checks the
        window after each snapshot. On exit everything is thawed and the
        journal goes (kept when a thaw failed). `extra` is stored in the
        journal for `finish`, which a start-up calls on a leftover one.

        A journal this name kept after a failed thaw is settled first: thawed
        and dropped (`finish` called), or CannotQuiesce with it kept."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        path = self.journal_path(name)
        with self.locks.hold(freeze_key(name), timeout=timeout):
            if os.path.exists(path):
                stuck = self._recover(path, finish)
                if stuck:
                    raise CannotQuiesce(
                        f"file system(s) {', '.join(stuck)} frozen by an earlier attempt at "
                        f"{what} still cannot be thawed (run fsfreeze --unfreeze on them); "
                        "it is not made again until they are")
            write_atomic(path, json.dumps({
                **(extra or {}), "what": what,
                "frozen": [[p, major, minor] for p, (major, minor) in targets]}))
            window = FreezeWindow(self.host, self.limit, what, targets, self.limit_name)
            try:
                yield window
            finally:
                stuck = window.close()
                if stuck:
                    log.error("file system(s) %s stay frozen; the next start thaws them "
                              "(or run fsfreeze --unfreeze)", ", ".join(stuck))
                else:
                    os.unlink(path)

    # after a crash ---------------------------------------------------------

    def recover(self, finish: Finisher | None = None, *, also: Sequence[str] = ()) -> None:
        """Thaw what every leftover journal names (a window whose process died)
        and drop it; a window still open elsewhere (its lock held) is left
        alone. `also`: journal files elsewhere (an older version's)."""
        try:
            names = sorted(n for n in os.listdir(self.directory) if ".tmp." not in n)
        except FileNotFoundError:
            names = []
        for name in names:
            try:
                with self.locks.hold(freeze_key(name), timeout=0):
                    if os.path.exists(self.journal_path(name)):
                        self._recover(self.journal_path(name), finish)
            except LockBusy:
                continue  # open: its own process thaws it
        for path in also:
            self._recover(path, finish)

    def _recover(self, path: str, finish: Finisher | None) -> list[str]:
        """Thaw what the journal at `path` names (only where that device is
        still mounted), then hand its entry to `finish`. The journal goes
        unless a thaw failed; the mount points that could not be thawed."""
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
            frozen = [(str(p), int(ma), int(mi)) for p, ma, mi in entry["frozen"]]
            what = str(entry.get("what", path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            log.error("unreadable freeze journal %s (%s); removing it", path, err)
            os.unlink(path)
            return []
        stuck = []
        for mount_point, major, minor in frozen:
            # Only the file system that was frozen: the path may now show
            # another one (unmounted since), which is not ours to thaw.
            if not self.host.device_mounted_at(mount_point, major, minor):
                continue
            try:
                if self.host.thaw(mount_point):
                    log.warning("thawed %s, left frozen by %s, which did not finish",
                                mount_point, what)
            except OSError as err:
                log.warning("could not thaw %s (%s): %s", mount_point, what, err)
                stuck.append(mount_point)
        if stuck:  # kept: the next start or window of this name tries again
            return stuck
        if finish is not None:
            finish(entry)
        elif set(entry) - {"what", "frozen"}:
            # Another caller's to finish (an unfinished group's members): kept
            # for it, with nothing left to thaw.
            write_atomic(path, json.dumps({**entry, "frozen": []}))
            return []
        os.unlink(path)
        return []
