"""The sanity conformance suite (``python -m sanity``) against csi-local itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

# Upstream csi-sanity is the spec's own check: the README's command runs it
# whatever the VM budget (tests/harness/vm.py, `core`).
pytestmark = [pytest.mark.integration, pytest.mark.core]

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "src"), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _mounts_under(path: Path) -> list[str]:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == real or p.startswith(real + "/")]


@pytest.mark.report
@pytest.mark.parametrize("access_type", ["mount", "block"])
def test_sanity_against_csi_local(access_type: str, plugin: Any) -> None:
    """The whole suite with mount volumes; then, with block volumes, the tests whose
    outcome depends on the access type (``-m access_type``): the rest would send the
    same requests again."""
    work = Path(plugin.workdir) / f"sanity-{access_type}"
    staging, mount = work / "staging", work / "mount"
    junit = work / "junit.xml"
    work.mkdir(parents=True, exist_ok=True)
    # IO limits (docs/qos.md) are the mutable parameters: the ModifyVolume specs run.
    mutable = work / "mutable.yaml"
    mutable.write_text('writeBps: "100Mi"\nreadIops: "1000"\n')
    cmd = [
        sys.executable, "-m", "sanity",
        "--endpoint", plugin.endpoint,
        "--access-type", access_type,
        "--volume-size", "64M", "--expand-size", "128M",
        "--staging-dir", str(staging), "--mount-dir", str(mount),
        "--junit-xml", str(junit),
        "--volume-mutable-parameters", str(mutable),
    ]
    if access_type == "block":
        cmd += ["-m", "access_type"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=2400, check=False)
    seconds = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    summary = output[output.find("CSI sanity summary") - 40:] if "CSI sanity summary" in output \
        else output[-6000:]
    print(f"\nsanity --access-type {access_type} against csi-local: rc={proc.returncode} "
          f"in {seconds:.1f}s\n{summary}")
    assert junit.exists(), f"no JUnit XML written:\n{output[-6000:]}"
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    failing = [c.get("name") for c in cases
               if c.find("failure") is not None or c.find("error") is not None]
    assert proc.returncode == 0, f"sanity failed against csi-local: {failing}\n{output[-20000:]}"
    assert not failing
    modify = [c for c in cases if "test_modify" in (c.get("classname") or "")]
    assert len(modify) >= 8 and not [c.get("name") for c in modify
                                     if c.find("skipped") is not None], \
        "the ModifyVolume specs must run, not skip"
    least = 80 if access_type == "mount" else 20
    assert len(cases) >= least, f"only {len(cases)} sanity test cases ran"
    leftovers = _mounts_under(staging) + _mounts_under(mount)
    assert not leftovers, f"mounts left behind: {leftovers}"
