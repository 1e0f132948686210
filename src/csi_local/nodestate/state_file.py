"""Node state: where each volume is staged and published, with counts.

LVM says what exists; this file says only what LVM cannot: staging paths and
publish targets (volumes/node_records.py's records). Beside it, one empty
file per mkfs under way (a formatting mark), so that a stage killed part-way
through its own mkfs may format again.
Writes are atomic (temp file, fsync, rename, fsync of the directory); a lock
file keeps a second process out. A missing entry means "not staged, not
published". No gRPC types here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import replace

from csi_local.errors import FormatTooNew
from csi_local.host.atomic_files import sync_directory, write_atomic
from csi_local.version import __version__
from csi_local.volumes.node_records import AccessType, Publish, Staging, VolumeRecord

log = logging.getLogger(__name__)

# The file's format (its "version" field, in every file since the first;
# docs/on-disk-format.md): raise it, and write down what changed, when a
# field changes in a way an older version would misread. A file of a higher
# one stops the plugin (parse) rather than being set aside and rebuilt.
VERSION = 1
STATE_FILE = "state.json"
LOCK_FILE = "state.lock"
FORMATTING_PREFIX = "formatting."
_MARK_KEY_RE = re.compile(r"[A-Za-z0-9-]{1,64}")  # an LV's ID (lv_uuid)


class StateLocked(Exception):
    """Another process holds the state directory."""


def _holder(lock_path: str) -> str:
    """" (pid N: command line)" of the process named in the lock file, if alive."""
    import psutil

    try:
        with open(lock_path, encoding="ascii") as f:
            pid = int(f.read().strip())
        cmd = " ".join(psutil.Process(pid).cmdline())
    except (OSError, ValueError, psutil.Error):
        return ""
    return f" (pid {pid}: {cmd[:200]})"


def _to_json(rec: VolumeRecord) -> dict[str, object]:
    out: dict[str, object] = {
        "publishes": {
            t: {"readonly": p.readonly, "access_mode": p.access_mode,
                **({"mount_flags": list(p.mount_flags)} if p.flags_known else {})}
            for t, p in sorted(rec.publishes.items())
        },
        "publish_count": rec.publish_count,
    }
    if rec.staging is not None:
        s = rec.staging
        out["staging"] = {
            "path": s.path,
            "access_type": str(s.access_type),
            "fs_type": s.fs_type,
            "mount_flags": list(s.mount_flags),
            "access_mode": s.access_mode,
            "flags_known": s.flags_known,
        }
    return out


def _from_json(volume_id: str, data: object) -> VolumeRecord:
    if not isinstance(data, dict):
        raise ValueError(f"record of {volume_id!r} is not a map")
    staging = None
    raw = data.get("staging")
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"staging of {volume_id!r} is not a map")
    if isinstance(raw, dict):
        staging = Staging(
            path=str(raw["path"]),
            access_type=AccessType(str(raw["access_type"])),
            fs_type=str(raw.get("fs_type", "")),
            mount_flags=tuple(str(f) for f in raw.get("mount_flags", [])),
            access_mode=int(raw.get("access_mode", 0)),
            flags_known=bool(raw.get("flags_known", True)),
        )
    pubs_raw = data.get("publishes", {})
    if not isinstance(pubs_raw, dict):
        raise ValueError("publishes is not a map")
    pubs = {}
    for t, p in pubs_raw.items():
        if not isinstance(p, dict):
            raise ValueError(f"publish {t!r} of {volume_id!r} is not a map")
        flags = p.get("mount_flags")
        if flags is not None and not isinstance(flags, list):
            raise ValueError(f"mount_flags of publish {t!r} is not a list")
        pubs[str(t)] = Publish(readonly=bool(p["readonly"]),
                               access_mode=int(p.get("access_mode", 0)),
                               mount_flags=tuple(str(f) for f in flags or ()),
                               flags_known=flags is not None)
    return VolumeRecord(volume_id, staging, pubs)


def parse(text: str, path: str = STATE_FILE) -> dict[str, VolumeRecord]:
    """Records from the file's text; ValueError for anything not of our shape
    (valid JSON of another shape included), so that it is set aside and rebuilt.
    FormatTooNew for a file of a newer format (a newer csi-local's records,
    which this version may misread, and must not replace): never set aside."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"state is a JSON {type(data).__name__}, not an object")
    found = data.get("version")
    if type(found) is int and found > VERSION:
        raise FormatTooNew(
            f"state file {path} is of format {found}, newer than format {VERSION}, the "
            f"newest this csi-local ({__version__}) reads: a newer csi-local wrote it. "
            "Not starting, and the file is left as it is: run that newer version, or "
            "see docs/on-disk-format.md for the way back")
    if type(found) is not int or found != VERSION:  # true and 1.0 are not 1 here
        raise ValueError(f"unsupported state version {data.get('version')!r}")
    vols = data.get("volumes", {})
    if not isinstance(vols, dict):
        raise ValueError("volumes is not a map")
    return {str(vid): _from_json(str(vid), rec) for vid, rec in vols.items()}


def render_line(record: VolumeRecord) -> str:
    """One volume's line of the file. Compact JSON, so that json's C encoder
    does it (indent= falls back to the pure-Python encoder, which made
    rendering the whole file the largest cost of a publish)."""
    return f"{json.dumps(record.volume_id)}: {json.dumps(_to_json(record), sort_keys=True)}"


def render(records: dict[str, VolumeRecord],
           lines: dict[str, str] | None = None) -> str:
    """The file's text: one volume a line, sorted. `lines` holds lines already
    rendered, and gets the ones rendered now (the store keeps it, so that one
    change renders one line)."""
    known = {} if lines is None else lines
    for vid, r in records.items():
        if vid not in known and not r.empty:
            known[vid] = render_line(r)
    body = ",\n".join(known[vid] for vid, r in sorted(records.items()) if not r.empty)
    head = f'{{"version": {VERSION}, "volumes": {{'
    return f"{head}\n{body}\n}}}}\n" if body else f"{head}}}}}\n"


class StateStore:
    """The state file of one node, held exclusively by one process."""

    def __init__(
        self,
        directory: str,
        rebuild: Callable[[], dict[str, VolumeRecord]] | None = None,
        reconcile: Callable[[dict[str, VolumeRecord]], dict[str, VolumeRecord]] | None = None,
    ) -> None:
        self.directory = directory
        self.path = os.path.join(directory, STATE_FILE)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(
            os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StateLocked(
                f"state directory {directory} is in use by another process"
                f"{_holder(os.path.join(directory, LOCK_FILE))}"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        self._mutex = threading.RLock()
        try:
            self._records = self._load(rebuild, reconcile)
        except BaseException:  # FormatTooNew: the process ends; the directory is free
            self.close()
            raise
        self._lines: dict[str, str] = {}  # rendered lines, filled as records change
        self._remove_stale_temps()

    def _load(
        self,
        rebuild: Callable[[], dict[str, VolumeRecord]] | None,
        reconcile: Callable[[dict[str, VolumeRecord]], dict[str, VolumeRecord]] | None,
    ) -> dict[str, VolumeRecord]:
        try:
            with open(self.path, encoding="utf-8") as f:
                records = parse(f.read(), self.path)
        except FileNotFoundError:
            reason = "missing"
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            reason = f"corrupt ({err})"
            os.replace(self.path, self.path + ".corrupt")
        else:
            return self._reconciled(records, reconcile)
        if rebuild is None:
            return {}
        records = rebuild()
        log.warning(
            "state file %s was %s; rebuilt %d volume record(s) from mountinfo and LVM",
            self.path, reason, len(records),
        )
        write_atomic(self.path, render(records))
        return records

    def _reconciled(
        self,
        records: dict[str, VolumeRecord],
        reconcile: Callable[[dict[str, VolumeRecord]], dict[str, VolumeRecord]] | None,
    ) -> dict[str, VolumeRecord]:
        if reconcile is None:
            return records
        kept = reconcile(records)
        if kept != records:
            dropped = sorted(vid for vid in records if kept.get(vid) != records[vid])
            log.warning(
                "state file %s named stagings or publishes that are no longer mounted "
                "(a reboot?); dropped them for %d volume(s): %s",
                self.path, len(dropped), ", ".join(dropped),
            )
            write_atomic(self.path, render(kept))
        return kept

    def _remove_stale_temps(self) -> None:
        prefix = STATE_FILE + ".tmp."
        for name in os.listdir(self.directory):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))

    def close(self) -> None:
        """Release the directory's lock; a second call does nothing (the
        descriptor's number may belong to another file by then)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def get(self, volume_id: str) -> VolumeRecord:
        """The record, or an empty one: missing means not staged, not published."""
        with self._mutex:
            return self._records.get(volume_id) or VolumeRecord(volume_id)

    def where_used(self, volume_id: str) -> str | None:
        """Where the volume is staged or published on this node (its staging
        path, else its targets); None when nowhere."""
        rec = self.get(volume_id)
        if rec.empty:
            return None
        return rec.staging.path if rec.staging else ", ".join(rec.publishes)

    def all(self) -> dict[str, VolumeRecord]:
        with self._mutex:
            return dict(self._records)

    def put(self, record: VolumeRecord) -> None:
        with self._mutex:
            records = dict(self._records)
            lines = dict(self._lines)
            lines.pop(record.volume_id, None)
            if record.empty:
                records.pop(record.volume_id, None)
            else:
                records[record.volume_id] = record
                lines[record.volume_id] = render_line(record)
            write_atomic(self.path, render(records, lines))
            self._records, self._lines = records, lines

    def set_staging(self, volume_id: str, staging: Staging | None) -> None:
        with self._mutex:
            self.put(replace(self.get(volume_id), staging=staging))

    def add_publish(self, volume_id: str, target: str, publish: Publish) -> None:
        with self._mutex:
            rec = self.get(volume_id)
            self.put(replace(rec, publishes={**rec.publishes, target: publish}))

    def remove_publish(self, volume_id: str, target: str) -> None:
        with self._mutex:
            rec = self.get(volume_id)
            pubs = {t: p for t, p in rec.publishes.items() if t != target}
            self.put(replace(rec, publishes=pubs))

    # Formatting marks. The plugin formats only a volume that holds no data at
    # all (its thin device maps no block), but its own mkfs maps blocks as it
    # writes: killed part-way, it would leave a volume that nothing may format
    # again. The mark, written (durably) before the mkfs and removed after it,
    # tells a retry that the blocks are that mkfs's own. It is keyed by the
    # LV's ID, which LVM never gives to another LV, so a mark left behind can
    # never make a later volume of the same name formattable.

    def _mark_path(self, lv_uuid: str) -> str:
        if not _MARK_KEY_RE.fullmatch(lv_uuid):
            raise ValueError(f"invalid LV ID {lv_uuid!r}")
        return os.path.join(self.directory, FORMATTING_PREFIX + lv_uuid)

    def mark_formatting(self, lv_uuid: str) -> None:
        """Record, durably, that a mkfs of the LV with ID `lv_uuid` is about to start."""
        fd = os.open(self._mark_path(lv_uuid),
                     os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        sync_directory(self.directory)

    def formatting(self, lv_uuid: str) -> bool:
        """Whether a mkfs of that LV started and was not seen to finish."""
        return os.path.exists(self._mark_path(lv_uuid))

    def clear_formatting(self, lv_uuid: str) -> None:
        """The mkfs finished (or the volume is handed out raw): the mark goes, durably."""
        try:
            os.unlink(self._mark_path(lv_uuid))
        except FileNotFoundError:
            return
        sync_directory(self.directory)
