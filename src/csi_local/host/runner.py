"""The one place that starts processes.

Every command runs with LC_ALL=C (so output parses the same everywhere), no
shell, and a timeout that kills the child. Failures raise CommandError with
argv, exit code, stdout and stderr.

Processes start through the standard library's subprocess, which forks and
execs in C (vfork where it can); one watchdog thread kills a command's
process group at its timeout. The `sh` library did the same job with four
helper threads and a polling loop per command: 50-70 ms more per command
under emulation than subprocess, and 1.2 s of import at start-up (measured
in the test VM, see the README's performance section). Each command runs in
a process group of its own: a timeout kills what it started too, and a
signal to the plugin's group does not cut an LVM command short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

from csi_local.errors import CommandError
from csi_local.host import stopwatch

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


def _decoded(data: bytes) -> str:
    """A binary pipe's output as a text-mode pipe gives it: UTF-8, with
    replacement characters, universal newlines."""
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


class Output(Protocol):
    """A command's standard output as it comes, for `Runner.stream`."""

    def read(self, size: int = -1, /) -> bytes: ...


class Runner(Protocol):
    def run(
        self,
        argv: Sequence[str],
        *,
        ok_codes: Sequence[int] = (0,),
        input: str | bytes | None = None,
        timeout: float | None = None,
    ) -> Result: ...

    def stream(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
    ) -> contextlib.AbstractContextManager[Output]:
        """The command's standard output, read as it is written, for output
        too large to hold (a thin pool's mappings). CommandError when the
        command fails (an exit code other than 0, a timeout), on entry or at
        the block's end; no child outlives the block."""
        ...


_resolved: dict[tuple[str, str], str] = {}
_resolved_lock = threading.Lock()


def resolve(tool: str) -> str:
    """Absolute path of a tool, searching PATH and then the system directories.

    A found path is remembered for this PATH (a search stats every directory,
    a few ms under emulation); `forget` drops it when the tool has gone."""
    if os.path.isabs(tool):
        return tool
    path = os.environ.get("PATH") or ""
    search = f"{path}:{SYSTEM_PATH}" if path else SYSTEM_PATH
    with _resolved_lock:
        found = _resolved.get((tool, search))
    if found is not None:
        return found
    found = shutil.which(tool, path=search)
    if found is None:
        raise CommandError([tool], 127, "", f"{tool}: command not found")
    with _resolved_lock:
        _resolved[(tool, search)] = found
    return found


def forget(exe: str) -> None:
    """Stop remembering `exe` as where a tool lives (it was not there)."""
    with _resolved_lock:
        for key in [k for k, v in _resolved.items() if v == exe]:
            del _resolved[key]


@dataclass(eq=False)
class _Deadline:
    proc: subprocess.Popen[Any]
    at: float  # time.monotonic()
    fired: bool = False


class _Watchdog:
    """Kills each child that outlives its timeout: one thread for all of them.

    Waiting with a timeout makes subprocess poll the child with sleeps (up to
    50 ms apart), and a timer thread per command costs a thread start (several
    ms under emulation). Instead the runner waits without a timeout, and this
    thread, started at the first command, sleeps until the next deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: set[_Deadline] = set()
        self._thread: threading.Thread | None = None

    def watch(self, proc: subprocess.Popen[Any], limit: float) -> _Deadline:
        deadline = _Deadline(proc, time.monotonic() + limit)
        with self._cond:
            self._due.add(deadline)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="command-timeouts",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return deadline

    def release(self, deadline: _Deadline) -> None:
        with self._cond:
            self._due.discard(deadline)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for d in [d for d in self._due if d.at <= now]:
                    self._due.discard(d)
                    d.fired = True
                    _kill(d.proc)
                nearest = min((d.at for d in self._due), default=None)
                self._cond.wait(None if nearest is None else nearest - now)


_WATCHDOG = _Watchdog()


def _kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL to the child's process group: the child and whatever it started
    (lvm runs thin_check, for one) that would otherwise hold its pipes open,
    and keep the runner reading them, long after the child is gone."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


class ResidentShell(Protocol):
    """An interpreter kept running that takes some commands without a process
    start (storage.lvm_shell.LvmShell is the one there is). The runner knows
    only this much of it: the shell is built in storage/ and attached at
    plugin assembly, so this module stays below LVM."""

    def start(self) -> bool: ...

    def run(self, argv: Sequence[str], full: Sequence[str],
            timeout: float) -> tuple[int, str, str] | None: ...

    def close(self) -> None: ...


class ProcessRunner:
    """Runs commands with a fixed environment, no shell and a timeout.

    `observe(tool, seconds, ok)`, when given, hears of every command (tool: the
    basename of argv[0]; ok: False for an exit code not in ok_codes, a timeout,
    or a tool not found); the metrics use it. It never fails a command.

    With a shell attached (`attach_shell`; storage.lvm_shell.use_lvm_shell
    attaches an `lvm` shell), the commands the shell can take run in it: same
    argv, same exit codes and messages, same timeout, no process start.
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
        self.shell: ResidentShell | None = None

    def attach_shell(self, shell: ResidentShell) -> None:
        """Run what `shell` can take in it from now on."""
        self.shell = shell

    def start_shell(self) -> None:
        """Start the attached shell in the background, so that the first
        command does not wait for it."""
        shell = self.shell
        if shell is not None:
            threading.Thread(target=shell.start, name="shell-start", daemon=True).start()

    def close(self) -> None:
        """Let the attached shell exit."""
        if self.shell is not None:
            self.shell.close()

    def run(
        self,
        argv: Sequence[str],
        *,
        ok_codes: Sequence[int] = (0,),
        input: str | bytes | None = None,
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
            self._observed(argv, started, ok)

    def _observed(self, argv: Sequence[str], started: float, ok: bool) -> None:
        if self.observe is None:
            return
        try:
            self.observe(os.path.basename(str(argv[0])), time.monotonic() - started, ok)
        except Exception:  # metrics must never fail a command
            log.exception("command observer failed")

    @contextlib.contextmanager
    def stream(self, argv: Sequence[str], *, timeout: float | None = None
               ) -> Iterator[Output]:
        """The command's standard output as a binary file, read as the command
        writes it: what `run` would hold whole, for output too large to hold.

        The same environment, no shell and the same timeout as `run` (the
        watchdog kills the command's group, and the reader then sees the end
        of its output). Standard error goes to an anonymous memory file, read
        once the command has ended: no second pipe that could fill while the
        caller reads the first. At the block's end the rest of the output is
        read and dropped and the command waited for; CommandError (with its
        standard error) for an exit code other than 0 or a timeout. When the
        block fails, a command whose output was not read to its end is killed
        (the reader gave up: it may be blocked writing), and one that ended
        its output is waited for: if it failed, that failure is raised (the
        cause: a truncated document is only its symptom), else the block's
        error. Either way no child outlives the block."""
        if not argv:
            raise ValueError("empty argv")
        started = time.monotonic()
        ok = False
        try:
            with self._stream(argv, timeout) as out:
                yield out
            ok = True
        finally:
            self._observed(argv, started, ok)

    @contextlib.contextmanager
    def _stream(self, argv: Sequence[str], timeout: float | None) -> Iterator[Output]:
        exe = resolve(argv[0])
        full = (exe, *(str(a) for a in argv[1:]))
        limit = self.timeout if timeout is None else timeout
        started = time.monotonic()
        err_fd = os.memfd_create("stderr", os.MFD_CLOEXEC)
        try:
            try:
                proc = subprocess.Popen(
                    full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_fd,
                    env=self.env, close_fds=True, process_group=0, bufsize=0)
            except OSError as err:
                raise _not_started(exe, full, err) from None
            assert proc.stdout is not None
            out = _Output(proc.stdout)
            deadline = _WATCHDOG.watch(proc, limit)
            try:
                try:
                    yield out
                except Exception as err:
                    if out.ended:  # the command is done writing: its verdict first
                        proc.wait()
                        failure = _stream_failure(full, proc, deadline, err_fd, limit)
                        if failure is not None:
                            raise failure from err
                    raise
                out.drain()
                proc.wait()
            finally:
                # Whatever left the block (the reader gave up on the output, an
                # interrupt, a generator closed): the child does not outlive it.
                _kill(proc)
                proc.wait()
                _WATCHDOG.release(deadline)
                proc.stdout.close()
            log.debug("streamed %s -> %d in %.2fs", " ".join(full), proc.returncode,
                      time.monotonic() - started)
            failure = _stream_failure(full, proc, deadline, err_fd, limit)
            if failure is not None:
                raise failure
        finally:
            os.close(err_fd)

    def _run(self, argv: Sequence[str], ok_codes: Sequence[int], input: str | bytes | None,
             timeout: float | None) -> Result:
        exe = resolve(argv[0])
        full = (exe, *(str(a) for a in argv[1:]))
        limit = self.timeout if timeout is None else timeout
        started = time.monotonic()
        if self.shell is not None and input is None:
            done = self.shell.run([str(a) for a in argv], full, limit)
            if done is not None:
                code, stdout, stderr = done
                log.debug("ran %s in the shell -> %d in %.2fs", " ".join(full), code,
                          time.monotonic() - started)
                if code not in ok_codes:
                    raise CommandError(full, code, stdout, stderr)
                return Result(full, code, stdout, stderr)
        # Bytes on standard input (a key, byte for byte) go through a pipe in
        # binary mode, and the output is decoded as text mode would.
        binary = isinstance(input, bytes)
        text: dict[str, str] = {} if binary else {"encoding": "utf-8", "errors": "replace"}
        spawned = time.monotonic()  # after any wait for a busy shell (noted there)
        try:
            proc = subprocess.Popen(
                full, stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                close_fds=True, process_group=0,  # its own group, killed whole at the timeout
                **text)  # type: ignore[call-overload]
        except OSError as err:
            raise _not_started(exe, full, err) from None
        deadline = _WATCHDOG.watch(proc, limit)
        try:
            stdout, stderr = proc.communicate(input)
        except BaseException:
            # Interrupted (KeyboardInterrupt in a CLI): no child is left running.
            _kill(proc)
            proc.wait()
            raise
        finally:
            _WATCHDOG.release(deadline)
        if binary:
            stdout, stderr = _decoded(stdout), _decoded(stderr)
        stopwatch.note(f"{os.path.basename(exe)} process", time.monotonic() - spawned)
        if deadline.fired:
            raise _timed_out(full, stdout, stderr, limit)
        code = proc.returncode
        log.debug("ran %s -> %d in %.2fs", " ".join(full), code, time.monotonic() - started)
        if code not in ok_codes:
            raise CommandError(full, code, stdout, stderr)
        return Result(full, code, stdout, stderr)


# The tail of a streamed command's standard error kept for its CommandError.
STDERR_KEPT = 64 * 1024


class _Output:
    """A child's standard output pipe (unbuffered: a read returns what has
    been written so far), which notes its end."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._pipe = pipe
        self.ended = False

    def read(self, size: int = -1, /) -> bytes:
        data = self._pipe.read(size)
        if not data and size != 0:
            self.ended = True
        return data or b""

    def drain(self) -> None:
        while self.read(1 << 16):
            pass


def _stream_failure(full: tuple[str, ...], proc: subprocess.Popen[Any], deadline: _Deadline,
                    err_fd: int, limit: float) -> CommandError | None:
    """The CommandError of a streamed command that has ended, or None."""
    if not deadline.fired and proc.returncode == 0:
        return None
    size = os.fstat(err_fd).st_size
    start = max(0, size - STDERR_KEPT)
    stderr = _decoded(os.pread(err_fd, STDERR_KEPT, start))
    if deadline.fired:
        return _timed_out(full, "", stderr, limit)
    return CommandError(full, proc.returncode, "", stderr)


def _not_started(exe: str, full: tuple[str, ...], err: OSError) -> CommandError:
    """Removed since it was found, or not executable: as a shell says it."""
    forget(exe)
    code = 127 if isinstance(err, FileNotFoundError) else 126
    return CommandError(full, code, "", f"{exe}: {err.strerror or err}")


def _timed_out(full: tuple[str, ...], stdout: str, stderr: str, limit: float) -> CommandError:
    note = f"timed out after {limit:.0f}s"
    return CommandError(full, -9, stdout, f"{stderr}{note}" if not stderr or
                        stderr.endswith("\n") else f"{stderr}\n{note}", timed_out=True)
