"""How the tests of the Nomad dynamic host volume plugin call it, the way
Nomad's client does: a request is `$1` the operation and an environment of
DHV_* variables (client/hostvolumemanager), and the reply is one JSON object
on stdout. Shared by the unit tests (the plugin's `main` in this process, on a
fake host) and the integration tests (the installed executable, on real LVM
in the VM): what differs between them is only what runs the request."""

from __future__ import annotations

import io
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from csi_local import dhv
from csi_local.dhv.request import Request, parse_request

NODE_ID = "5c1f2c8e-5a43-43a1-9c1b-1f2ad1b0c0de"


@dataclass(frozen=True)
class Nomad:
    """The directories Nomad's client names to the plugin, and the requests it
    makes there."""

    volumes_dir: str
    plugin_dir: str

    def path(self, volume_id: str) -> str:
        """Where the volume is mounted (DHV_CREATED_PATH)."""
        return os.path.join(self.volumes_dir, volume_id)

    def env(self, op: str, volume_id: str, *, cap_min: int = 0, cap_max: int = 0,
            params: dict[str, str] | None = None, name: str = "scratch",
            namespace: str = "default") -> dict[str, str]:
        """The variables Nomad's client sets for `op`, nothing else."""
        env = {
            "DHV_OPERATION": op,
            "DHV_VOLUMES_DIR": self.volumes_dir,
            "DHV_PLUGIN_DIR": self.plugin_dir,
            "DHV_NODE_POOL": "default",
            "DHV_NAMESPACE": namespace,
            "DHV_VOLUME_NAME": name,
            "DHV_VOLUME_ID": volume_id,
            "DHV_NODE_ID": NODE_ID,
            "DHV_PARAMETERS": json.dumps(params) if params else "null",
        }
        if op == "create":
            env["DHV_CAPACITY_MIN_BYTES"] = str(cap_min)
            env["DHV_CAPACITY_MAX_BYTES"] = str(cap_max)
        else:
            env["DHV_CREATED_PATH"] = self.path(volume_id)
        return env

    def request(self, op: str, volume_id: str, **kw: Any) -> Request:
        """The request the plugin reads from that environment."""
        return parse_request(op, self.env(op, volume_id, **kw))


@dataclass
class Result:
    rc: int
    out: dict[str, Any]  # the reply: one JSON object
    stdout: str
    stderr: str
    seconds: float


def reply(rc: int, stdout: str, stderr: str, seconds: float = 0.0) -> Result:
    """A run's result, its stdout read as Nomad reads it: one JSON object."""
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


def run_main(argv: list[str], monkeypatch: pytest.MonkeyPatch,
             env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the plugin's `main` run in this process as
    its executable runs: `argv`, an environment of `env` alone."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(os, "environ", dict(env or {}))
    monkeypatch.setattr(dhv, "_setup_logging", lambda: None)  # leave the root logger alone
    try:
        rc = dhv.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        rc = int(exc.code or 0)
    return rc, out.getvalue(), err.getvalue()


def run(nomad: Nomad, op: str, volume_id: str, monkeypatch: pytest.MonkeyPatch,
        **kw: Any) -> Result:
    """A request run by the plugin's `main` in this process, as Nomad's client
    runs the executable in its plugin directory: its reply."""
    argv = [os.path.join(nomad.plugin_dir, "csi-local-dhv"), op]
    rc, out, err = run_main(argv, monkeypatch, nomad.env(op, volume_id, **kw))
    return reply(rc, out, err)
