"""What doctor reads the machine through, and what each check answers.

A Check is "ok", "warn" (printed, the exit code stays 0) or "FAIL" (exit
code 1), a message, and for every miss how to fix it. The System is the
machine: a root directory for /proc, /sys, /dev and the configured paths, a
runner for LVM, a Kernel for what is read of the kernel and the PVs without a
process, a tool lookup and the environment, so that unit tests drive every
check with a directory tree, a fake host and canned replies, without
processes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from csi_local.errors import CommandError
from csi_local.host.kernel import Kernel
from csi_local.host.runner import ProcessRunner, Runner, resolve

OK, WARN, FAIL = "ok", "warn", "FAIL"

# Markers of a container runtime (Docker, Podman) and of a CO's task environment.
_CONTAINER_FILES = ("/.dockerenv", "/run/.containerenv")
_CONTAINER_ENV = ("KUBERNETES_SERVICE_HOST", "NOMAD_ALLOC_ID", "container")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    message: str
    fix: str = ""


def _lvm_system_dir_runner(system_dir: str) -> Runner:
    return ProcessRunner(timeout=30.0, extra_env={"LVM_SYSTEM_DIR": system_dir})


def _which(tool: str) -> str | None:
    try:
        return resolve(tool)
    except CommandError:
        return None


class System:
    """The machine as doctor reads it. `root` prefixes every path (/proc,
    /sys, /dev, the state and lock directories, the socket), `root_uid` is
    the owner directories must have."""

    def __init__(self, runner: Runner, root: str = "/", *, root_uid: int = 0,
                 which: Callable[[str], str | None] = _which,
                 env: Mapping[str, str] | None = None,
                 lvm_runner: Callable[[str], Runner] | None = None,
                 clock: Callable[[], datetime] | None = None,
                 host: Kernel | None = None) -> None:
        self.runner = runner
        self.host = host if host is not None else Kernel()
        self.now = clock or (lambda: datetime.now(UTC))
        self.root = root
        self.root_uid = root_uid
        self.which = which
        self.env = os.environ if env is None else env
        self._lvm_runner = lvm_runner or _lvm_system_dir_runner

    def lvm_runner(self, system_dir: str) -> Runner:
        """A runner whose LVM commands read their configuration from
        `system_dir` (a path as this machine sees it) instead of /etc/lvm:
        LVM_SYSTEM_DIR, LVM's own way to point at another configuration."""
        return self._lvm_runner(self.path(system_dir))

    def path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def read(self, path: str) -> str | None:
        try:
            with open(self.path(path), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def read_bytes(self, path: str) -> bytes:
        """The file's bytes; OSError as open(2) fails."""
        with open(self.path(path), "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.path(path))

    def lstat(self, path: str) -> os.stat_result | None:
        try:
            return os.lstat(self.path(path))
        except OSError:
            return None

    def writable(self, path: str) -> bool:
        return os.access(self.path(path), os.W_OK | os.X_OK)

    def connect(self, path: str, timeout: float = 2.0) -> str | None:
        """None when something accepts a connection on the unix socket, else why not."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(self.path(path))
            except OSError as err:
                return err.strerror or str(err)
        return None

    def processes(self) -> set[str]:
        """Command names (comm) of the processes this namespace shows."""
        names: set[str] = set()
        try:
            pids = [p for p in os.listdir(self.path("/proc")) if p.isdigit()]
        except OSError:
            return names
        for pid in pids:
            comm = self.read(f"/proc/{pid}/comm")
            if comm:
                names.add(comm.strip())
        return names

    def in_container(self) -> bool:
        return (any(self.exists(p) for p in _CONTAINER_FILES)
                or any(k in self.env for k in _CONTAINER_ENV))
