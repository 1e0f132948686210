"""The lab the benchmarks and the integration tests both build on: loop-backed
VGs with a thin pool, and a csi-local server process on one.

One home for both. The tests' fixtures (tests/integration/conftest.py) import
it; it imports nothing from tests/ and needs no pytest, so `python -m
benchmarks` runs from a fresh clone. Each side keeps its own scratch directory
and VG names (`make_vg`'s `scratch` and `prefix`). The bench's `Lab` undoes
everything it made in `Lab.close`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.host import mounts

SCRATCH = Path("/run/csi-local-bench")
ENV = {"LC_ALL": "C", "LVM_SUPPRESS_FD_WARNINGS": "1"}


class CommandFailed(RuntimeError, AssertionError):
    """A command of the lab exited non-zero. An AssertionError too: in a test
    it fails as an assert does (tests that gather failed checks catch those)."""


def run(*argv: str, check: bool = True, input: str | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                          env={**os.environ, **ENV}, input=input, timeout=timeout,
                          stdin=subprocess.DEVNULL if input is None else None)
    if check and proc.returncode != 0:
        raise CommandFailed(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def copy_ranges(source: str, target: str, ranges: Iterable[tuple[int, int]]) -> None:
    """Copy the (offset, length) byte ranges of device `source` onto the same
    offsets of `target`, as a backup tool applies a changed-block delta."""
    src, dst = os.open(source, os.O_RDONLY), os.open(target, os.O_WRONLY)
    try:
        for offset, length in ranges:
            os.pwrite(dst, os.pread(src, length, offset), offset)
        os.fsync(dst)
    finally:
        os.close(src)
        os.close(dst)


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds `fn(*args, **kwargs)` took."""
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


@dataclass
class LoopVG:
    """A VG on a sparse file under /run (tmpfs in the VM), with one thin pool."""

    name: str
    pool: str
    image: Path
    loop: str
    size: int

    def lv_names(self) -> list[str]:
        out = run("lvs", "--noheadings", "-o", "lv_name", self.name).stdout
        return sorted(x.strip() for x in out.split() if x.strip() and x.strip() != self.pool)

    def clean(self) -> None:
        """Remove every LV but the pool (mounts must be gone first). A device
        stacked on one of them (a dm-crypt mapping a failed test left open) is
        unmounted and removed first: else the lvremove fails, and so would
        every later test's clean-up of this VG."""
        names = self.lv_names()
        if names:
            for lv in names:
                release_holders(dm_device(self.name, lv))
            run("lvremove", "--yes", "--select", f"lv_name!={self.pool}", self.name)

    def destroy(self) -> None:
        # --force removes the LVs too (a thousand take a while under emulation).
        run("vgremove", "--yes", "--force", self.name, check=False, timeout=3600)
        run("pvremove", "--yes", self.loop, check=False)
        run("losetup", "--detach", self.loop, check=False)
        self.image.unlink(missing_ok=True)


def dm_device(vg: str, lv: str) -> str:
    """The kernel's name (dm-N) of an active LV, or "" when it is not active."""
    path = f"/dev/mapper/{vg.replace('-', '--')}-{lv.replace('-', '--')}"
    return os.path.basename(os.path.realpath(path)) if os.path.exists(path) else ""


def release_holders(device: str) -> None:
    """Unmount and remove the device-mapper devices stacked on `device` (dm-N),
    deepest first: what a test that failed half-way can leave open."""
    if not device:
        return
    holders = Path(f"/sys/class/block/{device}/holders")
    for holder in sorted(holders.iterdir()) if holders.is_dir() else []:
        release_holders(holder.name)
        name_file = holder / "dm" / "name"
        if not name_file.exists():
            continue
        name = name_file.read_text().strip()
        major, minor = (int(x) for x in (holder / "dev").read_text().split(":"))
        for m in sorted(mounts.read_mounts(), key=lambda m: len(m.mount_point), reverse=True):
            if (m.major, m.minor) == (major, minor) or m.source == f"/dev/mapper/{name}":
                run("fsfreeze", "--unfreeze", m.mount_point, check=False)
                run("umount", "-l", m.mount_point, check=False)
        run("dmsetup", "remove", "--retry", name, check=False)


def make_vg(size: int, *, scratch: Path, prefix: str, pool_percent: int = 80,
            errorwhenfull: bool = True, metadatasize: str | None = None,
            dataalignment: str | None = None, pool_metadata: int | None = None,
            chunk_size: str | None = None) -> LoopVG:
    """A VG named `prefix` and a random suffix, on a sparse file of `size`
    bytes in `scratch`, with a thin pool "pool" of `pool_percent` of it.

    `metadatasize`: the PV's metadata area (pvcreate --metadatasize; None:
    LVM's default). pvcreate grows the area up to where the data starts,
    aligned to `dataalignment` (LVM's default: 1 MiB). `pool_metadata`: the
    thin pool's metadata LV in bytes (None: LVM's choice). `chunk_size`: the
    thin pool's (lvcreate --chunksize; None: LVM's choice). A failure part-way
    removes what was made."""
    scratch.mkdir(parents=True, exist_ok=True)
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    image = scratch / f"{name}.img"
    with open(image, "wb") as f:
        f.truncate(size)
    loop = run("losetup", "--find", "--show", str(image)).stdout.strip()
    vg = LoopVG(name=name, pool="pool", image=image, loop=loop, size=size)
    try:
        if metadatasize is not None:
            align = ["--dataalignment", dataalignment] if dataalignment else []
            run("pvcreate", "--yes", "--metadatasize", metadatasize, *align, loop)
        run("vgcreate", "--yes", name, loop)
        meta = ["--poolmetadatasize", f"{pool_metadata}b"] if pool_metadata else []
        if chunk_size is not None:
            meta += ["--chunksize", chunk_size]
        run("lvcreate", "--yes", "--type", "thin-pool", "--extents", f"{pool_percent}%VG",
            *meta, "--name", "pool", name)
        # A full pool fails writes at once instead of queueing them for a minute.
        run("lvchange", "--errorwhenfull", "y" if errorwhenfull else "n", f"{name}/pool")
    except BaseException:
        vg.destroy()
        raise
    return vg


def unmount_under(root: Path) -> None:
    prefix = str(root) + "/"
    for _ in range(5):
        stale = [m.mount_point for m in mounts.read_mounts()
                 if m.mount_point.startswith(prefix)]
        if not stale:
            return
        for point in sorted(stale, key=len, reverse=True):
            run("umount", "-l", point, check=False)


# Short reconnect backoff: the first Probe after start must not wait out gRPC's
# default one-second (and growing) backoff after the socket was not there yet.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50),
                   ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 200),
                   ("grpc.max_receive_message_length", 64 << 20)]


def _joiner(cgroup: Path) -> Callable[[], None]:
    """What the child runs between fork and exec: it moves itself into
    `cgroup` ("0" names the writer), so the plugin's memory is charged there
    from its start. (Joining after the start would leave what it had charged
    so far behind: cgroup v2 does not move charges.) Only system calls on
    values made before the fork."""
    path = os.fsencode(cgroup / "cgroup.procs")

    def join() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    return join


@dataclass
class PluginProcess:
    """A `csi-local serve` process and stubs for its three services. The
    defaults are the tests' (debug log); the bench's `Lab.plugin` starts it
    at the default log level, as a deployment runs it."""

    vg: LoopVG
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    node_id: str = "node-1"
    # Device classes from this file (--config) instead of the VG's pool by flags.
    config_file: Path | None = None
    log_level: str | None = "debug"  # None: the plugin's default
    python_args: list[str] = field(default_factory=list)  # e.g. ["-m", "cProfile", ...]
    # Another interpreter (an earlier version's venv) instead of this one's.
    python: str | None = None
    # A cgroup v2 directory the process joins before it runs the plugin: what
    # it and its children use is then charged there from their first page.
    cgroup: Path | None = None
    # Added to the process's environment (a PATH with a test's command shims first).
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / "csi.sock")

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"

    @property
    def log_path(self) -> Path:
        return self.workdir / "plugin.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        return [
            self.python or sys.executable, *self.python_args, "-m", "csi_local", "serve",
            "--endpoint", self.endpoint, "--node-id", self.node_id,
            *(["--config", str(self.config_file)] if self.config_file is not None
              else ["--volume-group", self.vg.name, "--thin-pool", self.vg.pool]),
            "--state-dir", str(self.state_dir), "--lock-dir", str(self.workdir / "locks"),
            *(["--log-level", self.log_level] if self.log_level is not None else []),
            *self.extra_args,
        ]

    def start(self, timeout: float = 300) -> float:
        """Start the server; seconds from the process start to its first
        successful Probe (emulated CPUs start Python and grpc slowly)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env} if self.env else None,
                                     preexec_fn=None if self.cgroup is None
                                     else _joiner(self.cgroup))
        log.close()
        deadline = time.monotonic() + timeout
        # Wait for a listening socket first, then one Probe that waits for the channel.
        while not _listening(self.socket):
            self._check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"plugin did not listen within {timeout:.0f}s")
            time.sleep(0.01)
        self.channel = grpc.insecure_channel(self.endpoint, options=CHANNEL_OPTIONS)
        while True:
            try:
                self.identity.Probe(pb.ProbeRequest(), timeout=60, wait_for_ready=True)
                return time.perf_counter() - t0
            except grpc.RpcError:
                self._check_running()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _check_running(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"plugin exited {self.proc.returncode}:\n{self.log()[-20000:]}")

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close_channel()

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_channel()
        return None if self.proc is None else self.proc.returncode

    def restart(self, kill: bool = True) -> None:
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def own_starts(self, wanted: int, timeout: float = 60) -> list[float]:
        """The plugin's own start (after Python and its imports), as each start
        logged it: waits until `wanted` starts have (the line follows Probe's
        first answer)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [float(m) for m in _OWN_START.findall(self.log())]
            if len(got) >= wanted or time.monotonic() > deadline:
                return got

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        assert self.channel is not None
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        assert self.channel is not None
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        assert self.channel is not None
        return csi_pb2_grpc.NodeStub(self.channel)

    def path(self, *parts: str) -> str:
        """A fresh path under the work directory (parent made, path itself not)."""
        p = self.workdir.joinpath("paths", *parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return str(p)


_OWN_START = re.compile(r"own start: ([0-9.]+)s")


def _listening(path: str) -> bool:
    if not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Lab:
    """One VG, one work directory, the plugin processes started on them: all
    removed by `close()`, whatever state a failed run left them in."""

    def __init__(self, vg_size: int, pool_metadata: int | None = None) -> None:
        self.workdir = SCRATCH / f"w-{uuid.uuid4().hex[:8]}"
        self.workdir.mkdir(parents=True)
        self.vg: LoopVG | None = None
        self.plugins: list[PluginProcess] = []
        try:
            # Room in the PV's metadata area for a thousand tagged LVs (LVM writes a new
            # copy of the VG's text beside the old one; the default 1 MiB is too small).
            self.vg = make_vg(vg_size, scratch=SCRATCH, prefix="csibench", metadatasize="16m",
                              pool_metadata=pool_metadata)
        except BaseException:
            self.close()
            raise

    def plugin(self, *extra_args: str) -> PluginProcess:
        assert self.vg is not None
        p = PluginProcess(self.vg, self.workdir / "plugin", list(extra_args),
                          node_id="bench-node", log_level=None)
        self.plugins.append(p)
        return p

    def path(self, *parts: str) -> str:
        """A fresh directory under the work directory (made)."""
        p = self.workdir.joinpath("paths", *parts)
        p.mkdir(parents=True, exist_ok=True)
        return str(p)

    def close(self) -> None:
        for p in self.plugins:
            try:
                p.stop()
            except Exception as err:  # keep cleaning up
                print(f"bench: stopping the plugin: {err}", file=sys.stderr)
        unmount_under(self.workdir)
        if self.vg is not None:
            self.vg.destroy()
            self.vg = None
        shutil.rmtree(self.workdir, ignore_errors=True)
        try:
            SCRATCH.rmdir()  # only when no other run uses it
        except OSError:
            pass
