"""The test VM's kernels are found where scripts/install-vm-kernel puts them
(DIR/VER/boot/vmlinuz-VER beside DIR/VER/lib/modules/VER), never in /boot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import vm


def _kernel(root: Path, ver: str, modules: bool = True) -> str:
    boot = root / ver / "boot"
    boot.mkdir(parents=True)
    (boot / f"vmlinuz-{ver}").write_bytes(b"")
    if modules:
        mods = root / ver / "lib" / "modules" / ver
        mods.mkdir(parents=True)
        (mods / "modules.dep").write_text("")
    return str(boot / f"vmlinuz-{ver}")


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(vm.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(vm.KERNEL_ENV, raising=False)
    monkeypatch.delenv(vm.NEWER_KERNEL_ENV, raising=False)
    return tmp_path


def test_the_stock_and_newer_kernels_come_from_the_kernel_directory(kernels: Path) -> None:
    old = _kernel(kernels, "6.1.0-9-amd64")
    new = _kernel(kernels, "6.1.0-56-amd64")
    backports = _kernel(kernels, "6.12.95+deb12-amd64")
    _kernel(kernels, "6.1.0-99-amd64", modules=False)
    assert vm.installed_kernels() == [backports, new, old]
    assert vm.find_kernel() == new
    assert vm.find_newer_kernel() == backports
    assert vm.modules_of(new) == str(kernels / "6.1.0-56-amd64/lib/modules/6.1.0-56-amd64")


def test_a_kernel_in_boot_alone_is_not_taken(kernels: Path) -> None:
    with pytest.raises(vm.HarnessMissing, match=re.escape(str(kernels))):
        vm.find_kernel()


def test_a_kernel_named_in_the_environment_needs_its_modules_beside_it(
        kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lone = _kernel(kernels, "6.1.0-1-amd64", modules=False)
    monkeypatch.setenv(vm.KERNEL_ENV, lone)
    with pytest.raises(vm.HarnessMissing, match=re.escape("lib/modules/6.1.0-1-amd64")):
        vm.find_kernel()
