"""LVM's own shell, kept running, for the commands that change a VG.

An `lvcreate` started as a process pays for starting LVM each time: loading
its libraries, parsing its configuration, registering its commands. The same
thin LVs made in one running `lvm` shell took 763 ms each, against 1436 ms as
separate processes (test VM, software emulation). lvmdbusd drives LVM this
way too.

How a command's end and outcome are known: the shell runs with a command
profile of ours (PROFILE) that turns on LVM's command log report, in JSON, on
a pipe of its own (LVM_REPORT_FD). After each command the shell writes one
JSON document there. Its last row is the shell's status of that command with
LVM's return code; the rows before it are the messages the command would have
printed (print to stdout; warn, error and fatal to stderr). That document is
the only frame: Debian's lvm, built with libedit, prints no prompt when its
input is not a terminal. A document that does not end with the status of the
command just sent means the framing is lost: the shell is killed, never
trusted again for the next command.

What runs as a process instead (`line` says None):
- any command but lvcreate, lvremove, lvextend and lvchange; an lvcreate or
  lvremove without --yes (a question would read the next command as its
  answer); a command with --config (LVM refuses some settings in its shell);
- a command with an argument that the shell's word splitter would not pass
  through unchanged (lvm_split: blanks separate words, quotes only around a
  whole word, '#' at a word's start begins a comment), too many arguments, or
  a line too long;
- any command but lvcreate and lvextend while the shell is busy with another:
  commands on other VGs go on in parallel, as before. An lvcreate or lvextend
  (under its pool's lock, which the pool's other creates wait for) waits for
  the shell instead, up to SHELL_WAIT, first come, first served: a command
  that only tries the shell does not take it while one waits;
- everything, once the shell could not start (no profile directory that can
  be written, an lvm built without its shell).

A timeout kills the shell's process group, as it kills a process's, and the
next command starts a new shell. A shell found dead before a command is sent
is started again; one that dies during a command fails that command, as a
killed process would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from csi_local.errors import CommandError
from csi_local.host import stopwatch
from csi_local.host.atomic_files import write_atomic
from csi_local.host.locks import TurnLock
from csi_local.host.runner import ProcessRunner, resolve

log = logging.getLogger(__name__)

PROFILE_NAME = "csi-local-shell"
PROFILE_FILE = f"{PROFILE_NAME}.profile"  # in LVM's profile directory
# LVM's words when it could not read a VG at all (lvm2's toollib.c).
STALE_VG = "Cannot process volume group"
# ... and, before them, when the VG is simply not there: a new process says
# the same, so the shell's answer stands and the shell is kept.
_VG_NOT_FOUND = re.compile(r'Volume group "[^"]*" not found')


def stale_vg(code: int, stderr: str) -> bool:
    """Whether a command's failure may be the shell's outdated view of a VG's
    devices (see LvmShell.run), not LVM's answer: it could not read the VG,
    and not because there is no such VG."""
    return code != 0 and STALE_VG in stderr and not _VG_NOT_FOUND.search(stderr)
# Settings LVM allows in a command profile (CFG_PROFILABLE), read once when
# the shell starts. "all" keeps each command's own messages in its document.
PROFILE = """\
# Written by csi-local for the lvm shell it keeps running (LVM_COMMAND_PROFILE).
# It changes only how that shell reports: see csi_local/storage/lvm_shell.py.
log {
\treport_command_log=1
\tcommand_log_selection="all"
\tcommand_log_cols="log_seq_num,log_type,log_context,log_object_type,log_object_name,log_message,log_errno,log_ret_code"
\tcommand_log_sort="log_seq_num"
}
report {
\toutput_format="json"
}
"""

COMMANDS = frozenset({"lvcreate", "lvremove", "lvextend", "lvchange"})
# The commands that make or grow an LV run under their pool's lock, which every
# other create in the pool waits for: they wait for a busy shell (a command
# there took half a process's time, and a process's start competes for the
# CPU that the shell's command is using) rather than run as a process. The
# others take the shell only when it is free. Measured in a pod storm of 50:
# creates that ran as processes whenever deletes held the shell kept the pool's
# lock for seconds each, and the queue behind it made a create's p99 2.7 times
# a bare lvcreate's.
WAITS_FOR_SHELL = frozenset({"lvcreate", "lvextend"})
# How long such a command waits for the shell at most (a command there that
# hangs until its own timeout must not hold up every create that long).
SHELL_WAIT = 20.0
_ASKS_WITHOUT_YES = frozenset({"lvcreate", "lvremove"})
# lvm.c's MAX_ARGS is 64, the command's name included; a line this long was
# read whole in the VM test (tests/integration/test_lvm_shell.py).
MAX_ARGS = 63
MAX_LINE = 8192
# A shell is replaced after this many commands: whatever LVM keeps between
# commands (its caches, the log's message buffer) stays bounded.
MAX_COMMANDS = 1000
# LVM's ECMD_PROCESSED: the status row's return code for success.
_PROCESSED = 1
_STDERR_TYPES = frozenset({"warn", "error", "fatal"})


def line(argv: Sequence[str]) -> str | None:
    """The shell's input line for `argv` (name first, no path), or None when
    the command must run as a process."""
    if not argv or argv[0] not in COMMANDS or len(argv) > MAX_ARGS:
        return None
    if argv[0] in _ASKS_WITHOUT_YES and "--yes" not in argv and "-y" not in argv:
        return None
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        # Settings LVM refuses in its shell (CFG_DISALLOW_INTERACTIVE) would
        # fail there and not in a process.
        return None
    for arg in argv:
        if not arg or arg[0] == "#" or any(c in arg for c in "\"'\\") or \
                any(c.isspace() or not c.isprintable() for c in arg):
            return None
    text = " ".join(argv)
    return text if len(text) < MAX_LINE else None


def outcome(argv: Sequence[str], document: Mapping[str, Any]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the command `argv`, from its log document.

    The exit code is what `lvm` would have exited with (lvm_return_code: 0 for
    ECMD_PROCESSED, else LVM's code); the messages are indented as LVM prints
    them. ValueError: the document is not that command's (framing lost)."""
    rows = document.get("log")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"no log rows in {document!r:.200}")
    last = rows[-1]
    if (last.get("log_type"), last.get("log_context"), last.get("log_object_type"),
            last.get("log_object_name")) != ("status", "shell", "cmd", argv[0]):
        raise ValueError(f"the last row is not the status of {argv[0]}: {last!r:.200}")
    try:
        code = int(last.get("log_ret_code", ""))
    except ValueError:
        raise ValueError(f"no return code in {last!r:.200}") from None
    out = [f"  {r.get('log_message', '')}\n" for r in rows[:-1] if r.get("log_type") == "print"]
    err = [f"  {r.get('log_message', '')}\n" for r in rows[:-1]
           if r.get("log_type") in _STDERR_TYPES]
    return (0 if code == _PROCESSED else code or 5), "".join(out), "".join(err)


def ensure_profile(directory: str) -> None:
    """PROFILE as `directory`/csi-local-shell.profile, written (atomically) only
    when missing or different. OSError when it cannot be."""
    path = os.path.join(directory, PROFILE_FILE)
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        if f.read() == PROFILE:
            return
    os.makedirs(directory, mode=0o755, exist_ok=True)
    write_atomic(path, PROFILE, mode=0o644)
    log.info("wrote the lvm shell's command profile %s", path)


class _Lost(Exception):
    """The shell died, hung or lost its framing during a command."""

    def __init__(self, why: str, stdout: str = "", stderr: str = "",
                 timed_out: bool = False, unsent: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out
        self.unsent = unsent  # the shell was gone before it could read the command


class _Shell:
    """One running `lvm` process and its three pipes."""

    def __init__(self, exe: str, env: Mapping[str, str]) -> None:
        report_r, report_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={**env, "LVM_REPORT_FD": str(report_w),
                     "LVM_COMMAND_PROFILE": PROFILE_NAME,
                     # LVM stops a process that logged a million lines; a
                     # shell that runs for months may.
                     "LVM_LOG_FILE_MAX_LINES": "0"},
                pass_fds=(report_w,), close_fds=True, bufsize=0, process_group=0)
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)
        self.report = report_r
        self.commands = 0
        self.selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for fd, what in ((report_r, "report"), (self.proc.stdout.fileno(), "stdout"),
                         (self.proc.stderr.fileno(), "stderr")):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, what)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exchange(self, text: str, name: str, deadline: float) -> tuple[dict[str, Any], str, str]:
        """Send one command line; its log document and any raw output."""
        assert self.proc.stdin is not None
        self.commands += 1
        data = memoryview(f"{text}\n".encode())
        try:
            while data:
                data = data[self.proc.stdin.write(data) or 0:]
        except (BrokenPipeError, ValueError):
            raise _Lost("the shell had exited", unsent=True) from None
        bufs: dict[str, bytearray] = {"report": bytearray(), "stdout": bytearray(),
                                      "stderr": bytearray()}

        def raw() -> tuple[str, str]:
            return (bufs["stdout"].decode("utf-8", "replace"),
                    bufs["stderr"].decode("utf-8", "replace"))

        decoder = json.JSONDecoder()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Lost(f"{name} timed out", *raw(), timed_out=True)
            events = self.selector.select(remaining)
            eof = False
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if chunk:
                    bufs[key.data] += chunk
                elif key.data == "report":
                    eof = True
                else:
                    self.selector.unregister(key.fd)
            text_so_far = bufs["report"].decode("utf-8", "replace").strip()
            if text_so_far:
                try:
                    doc, end = decoder.raw_decode(text_so_far)
                except json.JSONDecodeError:
                    doc = None
                if doc is not None:
                    if text_so_far[end:].strip() or not isinstance(doc, dict):
                        raise _Lost(f"unexpected report output: {text_so_far:.200}", *raw())
                    # What the command wrote to stdout or stderr came before.
                    for key, _ in self.selector.select(0):
                        if key.data != "report":
                            bufs[key.data] += os.read(key.fd, 65536)
                    return doc, *raw()
            if eof:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(1)
                out, err = raw()
                raise _Lost(f"the lvm shell exited ({self.proc.returncode}) during {name}",
                            out, err)

    def close(self, kill: bool) -> None:
        if kill and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # EOF: a shell between commands exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.selector.close()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        os.close(self.report)


class LvmShell:
    """Runs eligible LVM commands in one `lvm` shell kept running.

    `run` returns None when the command is not for the shell or the shell is
    busy or unusable: the caller then runs a process. `exe` finds lvm (called
    at each start); `profile_dir` finds LVM's profile directory."""

    def __init__(self, env: Mapping[str, str], exe: Callable[[], str],
                 profile_dir: Callable[[], str]) -> None:
        self._env = dict(env)
        self._exe = exe
        self._profile_dir = profile_dir
        # First come, first served: an lvcreate that waits for the shell is
        # not passed over by the commands that only try it (a removal, a tag
        # change), each of which a plain lock's release may let in first.
        self._lock = TurnLock()
        self._shell: _Shell | None = None
        self.disabled: str | None = None  # why the shell is not used
        self.ran = 0  # commands it ran to their end
        self.started = 0  # shells started

    def start(self) -> bool:
        """Start the shell now (it starts at first use otherwise); False when
        it cannot be used."""
        with self._lock:
            return self._ensure(time.monotonic() + 60.0) is not None

    def run(self, argv: Sequence[str], full: Sequence[str],
            timeout: float) -> tuple[int, str, str] | None:
        """(exit code, stdout, stderr) of `argv` run in the shell, or None.

        `argv` has the bare command name, `full` the resolved one (for the
        error). CommandError when the command timed out or the shell died
        while running it."""
        text = line(argv)
        if text is None or self.disabled is not None:
            return None
        started = time.monotonic()
        if argv[0] in WAITS_FOR_SHELL:
            taken = self._lock.acquire(timeout=max(0.0, min(timeout, SHELL_WAIT)))
            stopwatch.note(f"{argv[0]} shell wait", time.monotonic() - started)
        else:
            taken = self._lock.try_acquire()
        if not taken:
            return None
        try:
            try:
                with stopwatch.phase(f"{argv[0]} in shell"):
                    found = self._exchange(text, argv[0], started + timeout)
            except _Lost as lost:
                self._drop(kill=True)
                note = f"timed out after {timeout:.0f}s" if lost.timed_out else lost.why
                raise CommandError(full, -9 if lost.timed_out else -1, lost.stdout,
                                   _joined(lost.stderr, note), timed_out=lost.timed_out) from None
            if found is None:
                return None
            doc, out, err = found
            try:
                code, msg_out, msg_err = outcome(argv, doc)
            except ValueError as lost:
                self._drop(kill=True)
                log.error("lvm shell: %s; the shell was killed", lost)
                raise CommandError(full, -1, out, _joined(err, f"lvm shell: {lost}")) from None
            self.ran += 1
            if stale_vg(code, err + msg_err):
                # The shell keeps what it learnt of the VG's devices between
                # commands: after another process took a missing PV out of
                # the VG (vgreduce --removemissing), it refuses the VG until
                # the PV is back. LVM processed nothing: a new process, which
                # scans afresh, runs it; the next command gets a new shell.
                log.warning("lvm shell: %s refused VG (%s); run as a process, and the "
                            "shell restarted", argv[0], msg_err.strip())
                self._drop(kill=False)
                return None
            if self._shell is not None and self._shell.commands >= MAX_COMMANDS:
                self._drop(kill=False)
            return code, out + msg_out, err + msg_err
        finally:
            self._lock.release()

    def _exchange(self, text: str, name: str,
                  deadline: float) -> tuple[dict[str, Any], str, str] | None:
        """The command's log document and raw output; None when there is no
        shell to run it. Held: self._lock."""
        for attempt in (1, 2):
            shell = self._ensure(deadline)
            if shell is None:
                return None
            try:
                return shell.exchange(text, name, deadline)
            except _Lost as lost:
                if not lost.unsent or attempt == 2:
                    raise
                # It had died between commands, unseen: the command never
                # reached it, and goes to a new shell.
                log.warning("the lvm shell had exited; starting another")
                self._drop(kill=True)
        return None

    def close(self) -> None:
        """Let the shell exit, for good: a start still on its way (the plugin
        starts the shell in a background thread) must not leave a shell running
        after the plugin closed."""
        with self._lock:
            self.disabled = "closed"
            self._drop(kill=False)

    @property
    def pid(self) -> int | None:
        """The running shell's process id."""
        shell = self._shell
        return shell.proc.pid if shell is not None and shell.alive() else None

    def _drop(self, kill: bool) -> None:
        if self._shell is not None:
            shell, self._shell = self._shell, None
            shell.close(kill)

    def _ensure(self, deadline: float) -> _Shell | None:
        """The running shell, started (and checked with `version`) if need be.
        Held: self._lock."""
        if self.disabled is not None:
            return None
        if self._shell is not None:
            if self._shell.alive():
                return self._shell
            log.warning("the lvm shell had exited (%s); starting another",
                        self._shell.proc.returncode)
            self._drop(kill=False)
        starting = time.monotonic()
        try:
            ensure_profile(self._profile_dir())
            shell = _Shell(self._exe(), self._env)
        except (OSError, CommandError) as err:
            return self._disable(f"cannot start it: {err}")
        try:
            doc, _out, err_text = shell.exchange("version", "version", deadline)
            stopwatch.note("lvm shell start", time.monotonic() - starting)
            code, _o, msgs = outcome(["version"], doc)
        except (_Lost, ValueError) as lost:
            shell.close(kill=True)
            detail = lost.stderr.strip() if isinstance(lost, _Lost) else ""
            return self._disable(f"it did not start: {lost}{': ' if detail else ''}{detail}")
        if code != 0:
            shell.close(kill=True)
            return self._disable(f"its check failed: {(err_text + msgs).strip()}")
        self._shell = shell
        self.started += 1
        log.info("lvm shell started (pid %d)", shell.proc.pid)
        return shell

    def _disable(self, why: str) -> _Shell | None:
        """No shell from now on (returns None, for `_ensure`)."""
        self.disabled = why
        log.warning("lvm shell off, LVM commands run as processes: %s", why)
        return None


def _joined(text: str, note: str) -> str:
    if not text or text.endswith("\n"):
        return f"{text}{note}"
    return f"{text}\n{note}"


def use_lvm_shell(runner: ProcessRunner, profile_dir: Callable[[], str]) -> LvmShell:
    """Attach an lvm shell to `runner`: from now on it runs what the shell can
    take. `profile_dir` says where LVM reads command profiles
    (storage.lvm_config.profile_dir). Wired in at plugin assembly."""
    shell = LvmShell(runner.env, lambda: resolve("lvm"), profile_dir)
    runner.attach_shell(shell)
    return shell
