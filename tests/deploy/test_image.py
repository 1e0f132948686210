"""THE IMAGE TEST: builds the csi-local container image with
scripts/build-image (debootstrap base + podman build) and runs it with
`buildah run --isolation chroot`: the CLI answers, a server starts and its
Identity Probe answers through `csi-local probe`.

Runs on the host, as root. With CI=true, missing podman/buildah/debootstrap
is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from csi_local.version import __version__
from tests.deploy._deploy import REPO, container, generated_config_map, one
from tests.deploy.conftest import require_as_root

pytestmark = [pytest.mark.image, pytest.mark.heavy_host]

TAG = os.environ.get("CSI_LOCAL_TEST_IMAGE", "localhost/csi-local:test")
STORAGE = ["--storage-driver", os.environ.get("PODMAN_STORAGE_DRIVER", "vfs")]
BUILD_BUDGET_S = 8 * 60


def _require_tools() -> None:
    require_as_root(("podman", "buildah", "debootstrap"),
                    "debootstrap and chroot isolation need root", "image test cannot run",
                    " (apt-get install podman buildah debootstrap)")


def _run(args: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert r.returncode == 0, (
            f"{' '.join(args)} -> {r.returncode}\n--- stdout\n{r.stdout[-4000:]}"
            f"\n--- stderr\n{r.stderr[-4000:]}")
    return r


@dataclass(frozen=True)
class Build:
    seconds: float
    log: str


@pytest.fixture(scope="module")
def build() -> Build:
    _require_tools()
    start = time.monotonic()
    r = _run([str(REPO / "scripts" / "build-image"), "-t", TAG], timeout=BUILD_BUDGET_S * 2)
    elapsed = time.monotonic() - start
    print(r.stdout[-1500:])
    return Build(seconds=elapsed, log=r.stdout)


@pytest.fixture(scope="module")
def ctr(build: Build) -> Iterator[str]:
    name = _run(["buildah", *STORAGE, "from", "--pull-never", TAG], timeout=300).stdout.strip()
    try:
        yield name
    finally:
        _run(["buildah", *STORAGE, "rm", name], timeout=300, check=False)


def run_in(ctr: str, *cmd: str, timeout: float = 120,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["buildah", *STORAGE, "run", "--isolation", "chroot", ctr, "--", *cmd],
                timeout=timeout, check=check)


def test_build_within_budget(build: Build) -> None:
    assert build.seconds < BUILD_BUDGET_S, f"build took {build.seconds:.0f}s"
    assert "==> timings:" in build.log


def test_image_config() -> None:
    _require_tools()
    r = _run(["podman", *STORAGE, "image", "inspect", TAG], timeout=120)
    info = json.loads(r.stdout)[0]
    cfg = info["Config"]
    assert cfg["Entrypoint"] == ["csi-local", "serve"]
    assert any(e.startswith("PATH=/opt/csi-local/bin:") for e in cfg["Env"])
    # small: runtime tools only. 193 MiB before the dependencies were
    # hash-locked and sanity/ left out (192.6 MiB after); cryptsetup-bin and
    # its libraries, for LUKS2 (docs/encryption.md), brought it to 194.1 MiB.
    assert info["Size"] <= 196 * 1024 * 1024, info["Size"]


def test_version(ctr: str) -> None:
    r = run_in(ctr, "csi-local", "--version")
    assert r.stdout.strip() == f"csi-local {__version__}"


def test_runtime_tools_present_and_build_tools_absent(ctr: str) -> None:
    for cmd in (["lvm", "version"], ["thin_check", "-V"], ["mkfs.ext4", "-V"],
                ["resize2fs", "-P", "/dev/null"], ["mkfs.xfs", "-V"], ["xfs_growfs", "-V"],
                ["mkfs.btrfs", "--version"], ["losetup", "--version"], ["findmnt", "-V"],
                ["blkid", "-V"]):
        r = run_in(ctr, *cmd, check=False)
        assert r.returncode != 127 and "not found" not in r.stderr, (cmd, r.stderr)
    # multi-stage: the venv is there, the builder's tooling is not
    r = run_in(ctr, "sh", "-c",
               "test -x /opt/csi-local/bin/python3 && ! test -e /opt/csi-local/bin/pip"
               " && ! dpkg -s python3-venv >/dev/null 2>&1 && ! test -d /src"
               " && test -z \"$(ls /var/lib/apt/lists | grep -v -e '^lock$' -e '^partial$')\"")
    assert r.returncode == 0


def test_container_lvm_conf(ctr: str) -> None:
    r = run_in(ctr, "lvmconfig", "--validate")
    assert "valid" in r.stdout + r.stderr
    expected = {
        "activation/udev_sync": "0", "activation/udev_rules": "0",
        "activation/monitoring": "0", "devices/obtain_device_list_from_udev": "0",
        "global/locking_dir": '"/run/lock/lvm"', "global/use_lvmpolld": "0",
    }
    r = run_in(ctr, "lvmconfig", *expected)
    got = dict(line.split("=", 1) for line in r.stdout.split())
    assert got == {k.split("/")[1]: v for k, v in expected.items()}


def test_serve_help_lists_env(ctr: str) -> None:
    r = run_in(ctr, "csi-local", "serve", "--help")
    for name in ("CSI_ENDPOINT", "NODE_ID", "CSI_LOCAL_VOLUME_GROUP", "CSI_LOCAL_THIN_POOL",
                 "CSI_LOCAL_NODE_EXPANSION_ONLY"):
        assert name in r.stdout


# Start the server with the settings given as NAME=VALUE arguments (its
# environment), on a socket, state and lock directory of its own; wait until
# `csi-local probe` gets an answer, stop the server.
SERVE_AND_PROBE = r"""
set -u
d=$(mktemp -d)
env "$@" csi-local serve --endpoint "unix://$d/csi.sock" \
    --state-dir "$d/state" --lock-dir "$d/lock" >"$d/serve.log" 2>&1 &
pid=$!
rc=1
for _ in $(seq 1 60); do
    if [ -S "$d/csi.sock" ] && out=$(csi-local probe --endpoint "unix://$d/csi.sock"); then
        echo "PROBE $out"; rc=0; break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
done
kill -TERM "$pid" 2>/dev/null
for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
kill -KILL "$pid" 2>/dev/null
echo "--- serve log"; cat "$d/serve.log"
rm -rf "$d"
exit $rc
"""


MISSING_VG = "csilocal_image_test_missing"


def serve_and_probe(ctr: str, env: dict[str, str]) -> tuple[dict[str, object], str]:
    """Probe's answer and the server's log."""
    r = run_in(ctr, "sh", "-c", SERVE_AND_PROBE, "sh",
               *(f"{k}={v}" for k, v in env.items()), timeout=180, check=False)
    assert r.returncode == 0, f"probe never answered:\n{r.stdout}\n{r.stderr}"
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE ")), r.stdout.split("--- serve log", 1)[1]


def test_server_answers_probe(ctr: str) -> None:
    answer, log = serve_and_probe(ctr, {"NODE_ID": "image-test",
                                        "CSI_LOCAL_VOLUME_GROUP": MISSING_VG,
                                        "CSI_LOCAL_THIN_POOL": "pool"})
    # The RPC answered, and LVM inside the image ran and reported the volume
    # group missing (rather than hanging on udev or locks). A node without
    # the volume group is ready, with nothing to serve: not ready would make
    # the liveness probe restart the plugin forever.
    assert f"volume group {MISSING_VG} not found on this node" in log, log
    assert answer["ready"] is True, answer


def _manifest_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the manifests give it, on this machine."""
    config = generated_config_map()["data"]
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:
            env[e["name"]] = config[e["valueFrom"]["configMapKeyRef"]["key"]]
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", e
            env[e["name"]] = "image-test"
    return env


def test_resizer_copy_is_ready_without_a_volume_group(ctr: str) -> None:
    """The plugin beside csi-resizer, started as resizer.yaml starts it
    (--node-expansion-only, no volume group): csi-resizer waits for Probe to
    say ready before it serves the health endpoint its liveness probe asks."""
    env = _manifest_env(container(one("Deployment", "csi-local-resizer"), "csi-local"))
    assert env["CSI_LOCAL_NODE_EXPANSION_ONLY"] == "true"
    env["CSI_LOCAL_VOLUME_GROUP"] = MISSING_VG  # whatever this machine has
    answer, log = serve_and_probe(ctr, env)
    assert answer["ready"] is True, (answer, log)


def test_the_image_ships_no_conformance_suite(ctr: str) -> None:
    """sanity/ is a test tool run from the host, no part of the plugin."""
    r = run_in(ctr, "/opt/csi-local/bin/python3", "-c",
               "import importlib.util as u; print(u.find_spec('sanity') is None)")
    assert r.stdout.strip() == "True", r.stdout


def test_oci_labels_of_the_built_image(build: Build) -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    r = _run(["podman", *STORAGE, "image", "inspect", "--format", "{{json .Labels}}", TAG],
             timeout=120)
    labels = json.loads(r.stdout)
    assert labels["org.opencontainers.image.version"] == __version__  # pyproject reads it
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    assert "org.opencontainers.image.source" in labels


def test_nothing_in_the_image_loads_a_kernel_module(ctr: str) -> None:
    """The deployments mount no /lib/modules: nothing in the image could use
    it (no modprobe or insmod for LVM to call; the host loads dm_thin_pool,
    and doctor reads /proc/modules)."""
    r = run_in(ctr, "sh", "-c", "for t in modprobe insmod kmod; do command -v $t; done; "
               "ls /lib/modules 2>&1 || true", check=False)
    assert not any(line.endswith(("/modprobe", "/insmod", "/kmod"))
                   for line in r.stdout.splitlines()), r.stdout
    assert "No such file or directory" in r.stdout or not r.stdout.strip(), r.stdout


# What the node DaemonSet (and the Nomad job) mount from the host, for LVM in
# the image: a devices file in /etc/lvm/devices and the device filters as
# /etc/lvm/lvmlocal.conf. The image's own files are put back afterwards.
HOST_DEVICE_SELECTION = r"""
set -eu
mkdir -p /etc/lvm/devices
cp -p /etc/lvm/lvmlocal.conf /tmp/lvmlocal.conf.image
restore() {
    rm -f /etc/lvm/devices/system.devices
    mv /tmp/lvmlocal.conf.image /etc/lvm/lvmlocal.conf
}
trap restore EXIT
printf '%s' "$1" >/etc/lvm/devices/system.devices
printf '%s' "$2" >/etc/lvm/lvmlocal.conf
lvmconfig --validate
echo "--- devices"; lvm lvmdevices 2>&1
echo "--- filter"; lvmconfig devices/global_filter
"""


def test_container_lvm_follows_the_hosts_device_selection(ctr: str) -> None:
    devices = ("VERSION=1.1.1\nIDTYPE=devname IDNAME=/dev/csilocal-test0 "
               "DEVNAME=/dev/csilocal-test0 PVID=abcdefABCDEF0123456789abcdefABCD PART=0\n")
    local = 'devices {\n  global_filter = [ "r|^/dev/sdb$|" ]\n}\n'
    r = run_in(ctr, "sh", "-c", HOST_DEVICE_SELECTION, "sh", devices, local)
    after_devices = r.stdout.split("--- devices", 1)[1]
    # the host's devices file is the one LVM uses, the host's filter too
    assert "IDNAME=/dev/csilocal-test0" in after_devices, r.stdout
    assert 'global_filter="r|^/dev/sdb$|"' in r.stdout.split("--- filter", 1)[1], r.stdout
