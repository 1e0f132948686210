"""The one place that starts processes.

Every command runs with LC_ALL=C (so output parses the same everywhere), no
shell, and a timeout that kills the child. Failures raise CommandError with
argv, exit code, stdout and stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import sh

from csi_local.errors import CommandError

log = logging.getLogger(__name__)

# Where tools live on Debian; used when PATH is empty (Nomad runs host volume
# plugins with no environment at all).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    def run(
        self,
        argv: Sequence[str],
        *,
        ok_codes: Sequence[int] = (0,),
        input: str | None = None,
        timeout: float | None = None,
    ) -> Result: ...


def resolve(tool: str) -> str:
    """Absolute path of a tool, searching PATH and then the system directories."""
    if os.path.isabs(tool):
        return tool
    path = os.environ.get("PATH") or ""
    found = shutil.which(tool, path=f"{path}:{SYSTEM_PATH}" if path else SYSTEM_PATH)
    if found is None:
        raise CommandError([tool], 127, "", f"{tool}: command not found")
    return found


class ShRunner:
    """Runs commands through `sh` with a fixed environment and a timeout.

    `observe(tool, seconds, ok)`, when given, hears of every command (tool: the
    basename of argv[0]; ok: False for an exit code not in ok_codes, a timeout,
    or a tool not found); the metrics use it. It never fails a command.
    """

    def __init__(self, timeout: float = 120.0, extra_env: Mapping[str, str] | None = None,
                 observe: Callable[[str, float, bool], None] | None = None) -> None:
        self.timeout = timeout
        self.observe = observe
        env = {"LC_ALL": "C", "LANG": "C", "PATH": SYSTEM_PATH}
        # LVM warns about leaked descriptors (gRPC keeps some); that is noise.
        env["LVM_SUPPRESS_FD_WARNINGS"] = "1"
        if extra_env:
            env.update(extra_env)
        self.env = env

    def run(
        self,
        argv: Sequence[str],
        *,
        ok_codes: Sequence[int] = (0,),
        input: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        if not argv:
            raise ValueError("empty argv")
        if self.observe is None:
            return self._run(argv, ok_codes, input, timeout)
        started = time.monotonic()
        ok = False
        try:
            result = self._run(argv, ok_codes, input, timeout)
            ok = True
            return result
        finally:
            try:
                self.observe(os.path.basename(str(argv[0])), time.monotonic() - started, ok)
            except Exception:  # metrics must never fail a command
                log.exception("command observer failed")

    def _run(self, argv: Sequence[str], ok_codes: Sequence[int], input: str | None,
             timeout: float | None) -> Result:
        exe = resolve(argv[0])
        args = [str(a) for a in argv[1:]]
        limit = self.timeout if timeout is None else timeout
        started = time.monotonic()
        # The timeout is a timer of our own that kills the child, not sh's
        # `_timeout`: sh polls for its timeout every 100 ms, which added 100 ms
        # to every command, however quick (measured: /bin/true 110 ms with
        # `_timeout`, 11 ms with this timer).
        cmd = sh.Command(exe).bake(
            _env=self.env,
            _ok_code=list(range(256)),
            _return_cmd=True,
            _encoding="utf-8",
            _decode_errors="replace",
            _in=input,
            _tty_out=False,
            _bg=True,
            _bg_exc=False,
        )
        full = (exe, *args)
        proc = cmd(*args)
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            with contextlib.suppress(ProcessLookupError):
                proc.process.signal(signal.SIGKILL)

        timer = threading.Timer(limit, kill)
        timer.daemon = True
        timer.start()
        try:
            proc.wait()
        except sh.SignalException as exc:
            if fired.is_set():
                raise CommandError(
                    full, -9, "", f"timed out after {limit:.0f}s", timed_out=True
                ) from exc
            raise CommandError(full, exc.exit_code, _text(exc.stdout), _text(exc.stderr)) \
                from exc
        finally:
            timer.cancel()
        stdout, stderr = _text(proc.stdout), _text(proc.stderr)
        result = Result(full, proc.exit_code, stdout, stderr)
        log.debug(
            "ran %s -> %d in %.2fs", " ".join(full), proc.exit_code, time.monotonic() - started
        )
        if proc.exit_code not in ok_codes:
            raise CommandError(full, proc.exit_code, stdout, stderr)
        return result


def _text(out: str | bytes) -> str:
    return out if isinstance(out, str) else out.decode("utf-8", "replace")
