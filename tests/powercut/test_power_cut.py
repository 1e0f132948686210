"""A power cut under an encrypted volume, on a real disk across two boots.

Two runs of the test VM (scripts/vm-run) on one disk image, attached as a
virtio disk (CSI_LOCAL_VM_DISK): the first stages and publishes an
encrypted volume, writes, and cuts the power (sysrq b: no sync, no unmount);
the second boots fresh on the same disk, where nothing is open or mounted,
and stages the volume again as kubelet does after a reboot. The guest's
side is tests/powercut/guest.py. Two VM boots: run it alone."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def vm(disk: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    """The guest's POWERCUT lines, and everything it printed."""
    env = {**os.environ, "CSI_LOCAL_VM_DISK": str(disk)}
    proc = subprocess.run([str(REPO / "scripts" / "vm-run"), "--", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False, timeout=1800)
    text = proc.stdout + proc.stderr
    lines = [json.loads(line.split("POWERCUT ", 1)[1]) for line in text.splitlines()
             if "POWERCUT {" in line]
    return lines, text


@pytest.mark.heavy_host
def test_an_encrypted_volume_survives_a_power_cut_and_restages() -> None:
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "compileall", "-q",
                    "src", "tests/powercut"], cwd=REPO, check=True)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        disk = Path(scratch) / "disk.img"
        with open(disk, "wb") as f:
            f.truncate(1 << 30)
        python = str(REPO / ".venv" / "bin" / "python")
        first, text = vm(disk, python, "-m", "tests.powercut.guest", "before")
        assert [x["step"] for x in first] == ["before"], text[-6000:]
        vid = first[0]["vid"]
        assert first[0]["staged"] == f"/dev/mapper/csi-local-luks-{vid}"
        second, text = vm(disk, python, "-m", "tests.powercut.guest", "after", vid)
        steps = {x["step"]: x for x in second}
        assert "after" in steps and "closed" in steps, text[-6000:]
        got = steps["after"]
        assert got["refused"] == "UNAUTHENTICATED"
        assert got["staged"] == f"/dev/mapper/csi-local-luks-{vid}"
        assert got["synced"], "data fsync'ed before the power cut is gone"
        assert not got["plaintext_on_lv"] and not got["log_has_key"]
        assert steps["closed"]["mapper_left"] == []
