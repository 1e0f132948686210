"""The bench's own loop-backed VG with a thin pool, and a csi-local server
process on it. A standalone equivalent of tests/integration/conftest.py's
helpers (no pytest needed); everything made here is undone by `Lab.close`."""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from csi_local._gen import csi_pb2 as pb
from csi_local._gen import csi_pb2_grpc
from csi_local.host import mounts

SCRATCH = Path("/run/csi-local-bench")
ENV = {"LC_ALL": "C", "LVM_SUPPRESS_FD_WARNINGS": "1"}


class CommandFailed(RuntimeError):
    pass


def run(*argv: str, check: bool = True, input: str | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                          env={**os.environ, **ENV}, input=input, timeout=timeout,
                          stdin=subprocess.DEVNULL if input is None else None)
    if check and proc.returncode != 0:
        raise CommandFailed(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


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

    def destroy(self) -> None:
        # --force removes the LVs too (a thousand take a while under emulation).
        run("vgremove", "--yes", "--force", self.name, check=False, timeout=3600)
        run("pvremove", "--yes", self.loop, check=False)
        run("losetup", "--detach", self.loop, check=False)
        self.image.unlink(missing_ok=True)


def make_vg(size: int, pool_percent: int = 80, pool_metadata: int | None = None) -> LoopVG:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    name = f"csibench{uuid.uuid4().hex[:8]}"
    image = SCRATCH / f"{name}.img"
    with open(image, "wb") as f:
        f.truncate(size)
    loop = run("losetup", "--find", "--show", str(image)).stdout.strip()
    vg = LoopVG(name=name, pool="pool", image=image, loop=loop)
    try:
        # Room in the PV's metadata area for a thousand tagged LVs (LVM writes a new
        # copy of the VG's text beside the old one; the default 1 MiB is too small).
        run("pvcreate", "--yes", "--metadatasize", "16m", loop)
        run("vgcreate", "--yes", name, loop)
        meta = ["--poolmetadatasize", f"{pool_metadata}b"] if pool_metadata else []
        run("lvcreate", "--yes", "--type", "thin-pool", "--extents", f"{pool_percent}%VG",
            *meta, "--name", "pool", name)
        # A full pool fails writes at once instead of queueing them (as the plugin's
        # own demo backing and the integration tests set it).
        run("lvchange", "--errorwhenfull", "y", f"{name}/pool")
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


@dataclass
class Plugin:
    """A `csi-local serve` process (as tests/integration's PluginProcess starts
    it, at the default log level) and stubs for its three services."""

    vg: LoopVG
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    python_args: list[str] = field(default_factory=list)  # e.g. ["-m", "cProfile", ...]
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / "csi.sock")

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "plugin.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        return [
            sys.executable, *self.python_args, "-m", "csi_local", "serve",
            "--endpoint", self.endpoint, "--node-id", "bench-node",
            "--volume-group", self.vg.name, "--thin-pool", self.vg.pool,
            "--state-dir", str(self.workdir / "state"),
            "--lock-dir", str(self.workdir / "locks"), *self.extra_args,
        ]

    def start(self, timeout: float = 300) -> float:
        """Start the server; seconds from the process start to its first
        successful Probe."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        # Wait for a listening socket first, then one Probe that waits for the channel.
        while not _listening(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"plugin exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"plugin did not listen within {timeout:.0f}s")
            time.sleep(0.01)
        self.channel = grpc.insecure_channel(self.endpoint, options=CHANNEL_OPTIONS)
        while True:
            try:
                self.identity.Probe(pb.ProbeRequest(), timeout=60, wait_for_ready=True)
                return time.perf_counter() - t0
            except grpc.RpcError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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
        self.plugins: list[Plugin] = []
        try:
            self.vg = make_vg(vg_size, pool_metadata=pool_metadata)
        except BaseException:
            self.close()
            raise

    def plugin(self, *extra_args: str) -> Plugin:
        assert self.vg is not None
        p = Plugin(self.vg, self.workdir / "plugin", list(extra_args))
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
