"""Shared by the tests of the Nomad dynamic host volume plugin: the plugin
installed in a scratch plugin directory on the session's pool, and run the way
Nomad's client runs it (the executable, `$1` the operation, an environment
holding nothing but the DHV_* variables), or the way an operator runs its
`snapshot` command (an empty environment).

How a request is built and its reply read is tests/dhvharness.py's, shared
with the unit tests; this module runs it: the executable, on real LVM.

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
from tests.dhvharness import Nomad, Result, failed, ok, reply
from tests.integration.conftest import SCRATCH, LoopVG, run, unmount_under

__all__ = ["MIB", "Dhv", "Result", "all_lvs", "dhv_fixture", "failed", "mounted_device",
           "new_id", "ok", "reply"]

MIB = 1 << 20
# `csi-local-dhv install`, through this interpreter (the console script's own #!)
INSTALL = [sys.executable, "-c", "import sys; from csi_local.dhv import main; sys.exit(main())",
           "install"]


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
             "--timeout-seconds", "600", "--caller-deadline-seconds", "3600"],
            capture_output=True, text=True, check=False, env={},
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["plugin"] == self.exe

    @property
    def nomad(self) -> Nomad:
        return Nomad(str(self.volumes_dir), str(self.plugin_dir))

    def env(self, op: str, volume_id: str, **kw: Any) -> dict[str, str]:
        """The variables Nomad's client sets (client/hostvolumemanager), nothing else."""
        return self.nomad.env(op, volume_id, **kw)

    def popen(self, op: str, volume_id: str, **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([self.exe, op], env=self.env(op, volume_id, **kw),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def call(self, op: str, volume_id: str, **kw: Any) -> Result:
        started = time.monotonic()
        proc = subprocess.run([self.exe, op], env=self.env(op, volume_id, **kw),
                              capture_output=True, text=True, check=False, timeout=120)
        return reply(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)

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
        return reply(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)

    def path(self, volume_id: str) -> str:
        return self.nomad.path(volume_id)

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
