"""The image's lvm.conf bounds LVM's metadata archive: with its backup
settings, a VG's archive files in the (host's) archive directory stop at
retain_min, however many changes; with LVM's default retention they grow
with every change. Real LVM on a loop VG, the settings read by lvmconfig
from deploy/container/lvm.conf."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.integration.conftest import LoopVG, run

REPO = Path(__file__).resolve().parents[2]
CONTAINER_LVM_CONF = REPO / "deploy" / "container" / "lvm.conf"


def _image_setting(tmp_path: Path, name: str) -> int:
    """A setting as LVM reads it from the image's lvm.conf."""
    system = tmp_path / "image-lvm"
    system.mkdir(exist_ok=True)
    (system / "lvm.conf").write_text(CONTAINER_LVM_CONF.read_text())
    r = subprocess.run(["lvmconfig", "--type", "full", name], capture_output=True, text=True,
                       env={**os.environ, "LVM_SYSTEM_DIR": str(system),
                            "LVM_SUPPRESS_FD_WARNINGS": "1"}, timeout=60, check=True)
    key, _, value = r.stdout.strip().partition("=")
    assert key == name.rsplit("/", 1)[1], r.stdout
    return int(value)


def _changes(vg: LoopVG, archive: Path, settings: str, count: int) -> int:
    """`count` thin LVs created (each a VG change, archived first), then the
    VG's archive files in `archive`."""
    config = f'backup {{ archive=1 archive_dir="{archive}" {settings} }}'
    for i in range(count):
        run("lvcreate", "--config", config, "--type", "thin", "--virtualsize", "4M",
            "--thinpool", vg.pool, "--name", f"arch{i}", "--setactivationskip", "y", vg.name)
    return len([p for p in archive.iterdir() if p.name.startswith(f"{vg.name}_")])


def test_the_image_bounds_the_metadata_archive(vg: LoopVG, tmp_path: Path) -> None:
    retain_days = _image_setting(tmp_path, "backup/retain_days")
    assert 0 < _image_setting(tmp_path, "backup/retain_min") <= 100
    assert retain_days == 0  # no age keeps a file: the count alone bounds them
    changes, keep = 8, 3  # the image's retain_min is larger; the rule is the same
    bounded = tmp_path / "bounded"
    bounded.mkdir()
    files = _changes(vg, bounded, f"retain_min={keep} retain_days={retain_days}", changes)
    assert files <= keep + 1, files  # LVM removes the surplus at the next change
    vg.clean()
    # LVM's default (30 days): one more file per change, for a month
    default = tmp_path / "default"
    default.mkdir()
    assert _changes(vg, default, f"retain_min={keep}", changes) >= changes
