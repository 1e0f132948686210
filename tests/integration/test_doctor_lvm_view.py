"""doctor's comparison of the plugin's LVM view with the host's
(--host-lvm-dir), with real LVM on a loop VG: a copy of this machine's
/etc/lvm is the same view; one whose filter hides the VG's PV is a warning
that names the filter with both values, and the PV with its VG. The check is
called in-process (a CLI start costs half a minute under the VM's
emulation); tests/unit/test_doctor.py covers the flag."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi_local.host.runner import ProcessRunner
from csi_local.ops import doctor
from tests.integration.conftest import SCRATCH, LoopVG

pytestmark = pytest.mark.integration


def _copy_of_etc_lvm(target: Path, lvmlocal: str | None = None) -> Path:
    """lvm.conf, lvmlocal.conf and the devices file of /etc/lvm, as a host
    directory mounted into the container would hold them. Where this machine
    has no lvm.conf (the test VM's /etc/lvm has none: LVM's defaults apply),
    one that sets nothing, which means the same to LVM (a file without any
    section is refused: "Failed to load config file")."""
    target.mkdir()
    print("/etc/lvm:", sorted(p.name for p in Path("/etc/lvm").iterdir())
          if Path("/etc/lvm").is_dir() else "none")
    for name in ("lvm.conf", "lvmlocal.conf", "devices/system.devices"):
        source = Path("/etc/lvm") / name
        if source.exists():
            (target / name).parent.mkdir(exist_ok=True)
            shutil.copy(source, target / name)
    if not (target / "lvm.conf").exists():
        (target / "lvm.conf").write_text("# LVM's defaults, as without lvm.conf\ndevices {\n}\n")
    if lvmlocal is not None:
        (target / "lvmlocal.conf").write_text(lvmlocal)
    return target


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory in tmpfs (as the other fixtures' files: not the 9p share)."""
    path = SCRATCH / f"lvm-view-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_same_configuration_is_one_view(vg: LoopVG, scratch: Path) -> None:
    host = _copy_of_etc_lvm(scratch / "host-lvm")
    got = doctor.check_lvm_view(doctor.System(ProcessRunner(timeout=60.0)), str(host))
    print(got)
    assert got.status == doctor.OK, got
    assert got.message.startswith(f"the same as the host's ({host}): ")
    assert vg.name in got.message


def test_a_host_filter_that_hides_the_pv_is_named(vg: LoopVG, scratch: Path) -> None:
    hide = f'r|^{vg.loop}$|'
    host = _copy_of_etc_lvm(scratch / "host-lvm",
                            lvmlocal=f'devices {{\n  global_filter = [ "{hide}" ]\n}}\n')
    got = doctor.check_lvm_view(doctor.System(ProcessRunner(timeout=60.0)), str(host))
    print(got)
    assert got.status == doctor.WARN, got
    assert f'devices/global_filter: plugin ["a|.*|"], host ["{hide}"]' in got.message
    assert f"PV {vg.loop} (VG {vg.name}) seen by the plugin only" in got.message
    assert "lvmlocal.conf" in got.fix
