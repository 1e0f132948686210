"""Shared by the tests of the Nomad dynamic host volume plugin: the plugin
installed in a scratch plugin directory on the session's pool, and run the way
Nomad's client runs it (the executable, `$1` the operation, an environment
holding nothing but the DHV_* variables), or the way an operator runs its
`snapshot` command (an empty environment).

A test module takes the `dhv` fixture by importing `dhv_fixture` (registered
under the name `dhv`, so test arguments named `dhv` shadow nothing)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from csi_local.dhv.request import lv_name_for
from csi_local.host import mounts
from csi_local.storage.lvm import LV_FIELDS, LogicalVolume, parse_lvs
from tests.integration.conftest import SCRATCH, LoopVG, run, unmount_under

MIB = 1 << 20
# `csi-local-dhv install`, through this interpreter (the console script's own #!)
INSTALL = [sys.executable, "-c", "import sys; from csi_local.dhv import main; sys.exit(main())",
           "install"]


@dataclass
class Result:
    rc: int
    out: dict[str, Any]
    stdout: str
    stderr: str
    seconds: float


@dataclass
class Dhv:
    vg: LoopVG
    workdir: Path

    @property
    def plugin_dir(self) -> Path:
        return self.workdir / "plugins"

    @property
    def volumes_dir(self) -> Path:
        return self.workdir / "volumes"

    @property
    def lock_dir(self) -> Path:
        return self.workdir / "locks"

    @property
    def exe(self) -> str:
        return str(self.plugin_dir / "csi-local-dhv")

    def install(self, lock_dir: Path | None = None, classes_file: Path | None = None) -> None:
        """`csi-local-dhv install` on the session's pool, or with `classes_file`
        (--config) on the device classes that file names."""
        where = (["--config", str(classes_file)] if classes_file is not None
                 else ["--volume-group", self.vg.name, "--thin-pool", self.vg.pool])
        proc = subprocess.run(
            [*INSTALL, "--plugin-dir", str(self.plugin_dir), *where,
             "--lock-dir", str(lock_dir or self.lock_dir),
             # the test VM (qemu without KVM) is far slower than Nomad's 60 s assumes
             "--timeout-seconds", "600"],
            capture_output=True, text=True, check=False, env={},
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["plugin"] == self.exe

    def env(self, op: str, volume_id: str, *, cap_min: int = 0, cap_max: int = 0,
            params: dict[str, str] | None = None, name: str = "scratch",
            namespace: str = "default") -> dict[str, str]:
        """The variables Nomad's client sets (client/hostvolumemanager), nothing else."""
        env = {
            "DHV_OPERATION": op,
            "DHV_VOLUMES_DIR": str(self.volumes_dir),
            "DHV_PLUGIN_DIR": str(self.plugin_dir),
            "DHV_NODE_POOL": "default",
            "DHV_NAMESPACE": namespace,
            "DHV_VOLUME_NAME": name,
            "DHV_VOLUME_ID": volume_id,
            "DHV_NODE_ID": "5c1f2c8e-5a43-43a1-9c1b-1f2ad1b0c0de",
            "DHV_PARAMETERS": json.dumps(params) if params else "null",
        }
        if op == "create":
            env["DHV_CAPACITY_MIN_BYTES"] = str(cap_min)
            env["DHV_CAPACITY_MAX_BYTES"] = str(cap_max)
        else:
            env["DHV_CREATED_PATH"] = self.path(volume_id)
        return env

    def popen(self, op: str, volume_id: str, **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([self.exe, op], env=self.env(op, volume_id, **kw),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def call(self, op: str, volume_id: str, **kw: Any) -> Result:
        started = time.monotonic()
        proc = subprocess.run([self.exe, op], env=self.env(op, volume_id, **kw),
                              capture_output=True, text=True, check=False, timeout=120)
        return _result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)

    def snapshot_run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`csi-local-dhv snapshot ARGS...` as an operator runs it: the executable in
        the plugin directory, which it finds its configuration beside, and an
        empty environment."""
        return subprocess.run([self.exe, "snapshot", *args], env={}, capture_output=True,
                              text=True, check=False, timeout=300)

    def snapshot(self, *args: str) -> Result:
        """`snapshot ARGS...` that answers one JSON object (create, delete, list --json)."""
        started = time.monotonic()
        proc = self.snapshot_run(*args)
        return _result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)

    def path(self, volume_id: str) -> str:
        return str(self.volumes_dir / volume_id)

    def lvs(self) -> list[LogicalVolume]:
        """The LVs of the session's VG but its pool (those of any other class's
        VG: `all_lvs(that VG)`)."""
        return [lv for lv in all_lvs(self.vg) if lv.name != self.vg.pool]

    def lv(self, volume_id: str) -> LogicalVolume | None:
        return next((lv for lv in self.lvs() if lv.name == lv_name_for(volume_id)), None)


def all_lvs(vg: LoopVG) -> list[LogicalVolume]:
    out = run("lvs", "--reportformat", "json", "--units", "b", "--nosuffix",
              "-o", LV_FIELDS, vg.name).stdout
    return parse_lvs(out)


def _result(rc: int, stdout: str, stderr: str, seconds: float) -> Result:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be one JSON object, got {stdout!r} (stderr {stderr!r})"
    return Result(rc, json.loads(lines[0]), stdout, stderr, seconds)


def ok(res: Result) -> dict[str, Any]:
    assert res.rc == 0, f"exit {res.rc}: {res.stdout} {res.stderr}"
    return res.out


def failed(res: Result, *fragments: str) -> str:
    assert res.rc != 0, f"expected a failure, got {res.stdout}"
    message = res.out["error"]
    assert isinstance(message, str)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture(name="dhv")
def dhv_fixture(vg: LoopVG) -> Iterator[Dhv]:
    """The plugin installed in a scratch plugin directory, on the session VG's pool."""
    workdir = SCRATCH / f"dhv-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    d = Dhv(vg=vg, workdir=workdir)
    d.install()
    yield d
    unmount_under(workdir)
    shutil.rmtree(workdir, ignore_errors=True)


def new_id() -> str:
    return str(uuid.uuid4())


def mounted_device(path: str) -> mounts.Mount | None:
    return mounts.top_mount(path)
