"""Day one: the README's first command, run as a newcomer runs it.

The README opens with an Install section whose first command is
`sudo scripts/quickstart`. The last test here runs that command exactly as
written, in a fresh clone of this repository (its committed HEAD) with a
scrubbed environment, and checks that it ends by showing a volume created,
staged, published, written and read back. On a host without device-mapper it
boots the project's VM (several minutes); it needs root, sudo and qemu, and
with CI=true their absence is a failure, not a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO, require_as_root

README = REPO / "README.md"
QUICKSTART = REPO / "scripts" / "quickstart"
INSTALL_KERNEL = REPO / "scripts" / "install-vm-kernel"
# What the issue of day one asks the Install section to name.
RUNTIME_PACKAGES = {"lvm2", "thin-provisioning-tools", "e2fsprogs", "xfsprogs", "btrfs-progs",
                    "cryptsetup-bin"}


def _sections() -> list[tuple[str, str]]:
    text = README.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def _install() -> str:
    return dict(_sections())["Install"]


def test_install_is_the_readme_s_first_section() -> None:
    assert _sections()[0][0] == "Install"


def test_the_set_up_is_two_commands_exactly() -> None:
    blocks = _blocks(_install())
    assert blocks[:2] == ["sudo scripts/quickstart", "sudo .ci/run"], blocks


def _quickstart_packages() -> set[str]:
    text = QUICKSTART.read_text()
    arrays = re.findall(r"packages(?:\+)?=\(([^)]*)\)", text)
    return {p for a in arrays for p in a.split()}


def test_the_install_section_names_what_the_quickstart_installs() -> None:
    """Every package the script installs is named in the README, and those
    include what the plugin runs."""
    named = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", _install()))
    installs = _quickstart_packages()
    assert RUNTIME_PACKAGES <= installs
    assert installs <= named, installs - named


def test_the_install_section_says_root_time_memory_and_what_ci_run_is_for() -> None:
    text = " ".join(_install().split())
    for needed in ("root", "minutes", "GiB of memory", "disposable machine", "40 minutes",
                   "/var/lib/csi-local-vm"):
        assert needed in text, needed


def test_the_vm_kernels_never_go_into_the_host_s_boot() -> None:
    """A kernel copied into /boot without dpkg and an initramfs becomes, at the
    next update-grub, the default boot entry of a workstation, and cannot mount
    its root: install-vm-kernel writes only under its own directory."""
    for line in INSTALL_KERNEL.read_text().splitlines():
        code = line.split("#", 1)[0]
        for path in re.findall(r"(?<![\w$/.])/(?:boot|lib/modules|usr/lib/modules)\b", code):
            pytest.fail(f"install-vm-kernel names the host's {path}: {line.strip()}")
    assert "/var/lib/csi-local-vm" in INSTALL_KERNEL.read_text()


@pytest.mark.heavy_host
def test_the_readme_s_first_command_works_in_a_fresh_clone(tmp_path: Path) -> None:
    require_as_root(("sudo", "git", "qemu-system-x86_64"),
                    "the quick start runs with sudo: LVM, loop devices, apt, qemu",
                    "the README's first command cannot run here")
    command = _blocks(_install())[0]
    clone = tmp_path / "csi-local"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8"}
    r = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True,
                       text=True, timeout=30 * 60, check=False)
    out = r.stdout + r.stderr
    print(out[-6000:])
    assert r.returncode == 0, out[-6000:]
    # The tour's own lines, in order: each step happened and said so.
    steps = ["created volume", "staged (first time)", "published", "wrote",
             "staged (second time)", "read back", "deleted volume", "done:"]
    at = 0
    for step in steps:
        found = out.find(f"quickstart: {step}", at)
        assert found >= 0, f"no {step!r} after offset {at}:\n{out[-6000:]}"
        at = found
    # It made its own venv in the clone, and left the caller's alone.
    assert (clone / ".venv" / "bin" / "csi-local").exists()
