"""csi_local.host.crypt against real cryptsetup and dm-crypt on a thin LV:
format, open, a wrong key, verify, resize after lvextend (with and without
the key), close; and the key in no error, log line or argv."""

from __future__ import annotations

import logging
import os

import pytest

from csi_local.errors import CommandError, KeyMissing, KeyRefused
from csi_local.host.crypt import HEADER_BYTES, Crypt, Key, LuksSettings
from csi_local.host.runner import ProcessRunner
from tests.integration.conftest import LoopVG, run

pytestmark = pytest.mark.integration
MiB = 1 << 20
SECRET = "correct horse\nbattery staple"
# The fewest argon2 passes (4) over 32 MiB: the emulated VM is slow enough.
FAST = LuksSettings(pbkdf_memory_kib=32768, iter_time_ms=100)
PATTERN = b"csi-local-plaintext-pattern!" * 2341  # 64 KiB and a bit


def size_of(path: str) -> int:
    with open(path, "rb") as f:
        return f.seek(0, os.SEEK_END)


def test_format_open_resize_close_on_a_thin_lv(vg: LoopVG,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    run("modprobe", "dm_crypt")
    run("lvcreate", "--yes", "--thin", "--virtualsize", "64M", "--name", "luks1",
        f"{vg.name}/{vg.pool}")
    lv = f"/dev/{vg.name}/luks1"
    name = f"test-luks-{vg.name}"
    crypt = Crypt(ProcessRunner(timeout=120), FAST)
    assert not crypt.is_luks(lv)
    crypt.format(lv, Key(SECRET))
    assert crypt.is_luks(lv)
    with pytest.raises(KeyRefused) as refused:
        crypt.open(lv, name, Key("not the key"))
    assert not os.path.exists(f"/dev/mapper/{name}")
    path = crypt.open(lv, name, Key(SECRET))
    try:
        assert path == f"/dev/mapper/{name}"
        assert size_of(path) == 64 * MiB - HEADER_BYTES
        # What is written through the mapper device is not on the LV in plain text.
        with open(path, "r+b", buffering=0) as f:
            f.write(PATTERN)
            os.fsync(f.fileno())
        run("sync")
        with open(lv, "rb") as f:
            raw = f.read(HEADER_BYTES + len(PATTERN) + MiB)
        assert PATTERN[:64] not in raw
        # Opened twice: cryptsetup says busy (5), not a key problem.
        with pytest.raises(CommandError) as twice:
            crypt.open(lv, name + "-2", Key(SECRET))
        assert twice.value.returncode == 5 and not isinstance(twice.value, KeyRefused)
        # The header is asked while the device is open.
        with pytest.raises(KeyRefused):
            crypt.verify(lv, Key("not the key"))
        crypt.verify(lv, Key(SECRET))
        # Its volume key is in its dm-crypt table: it grows without the passphrase.
        run("lvextend", "--yes", "--size", "96M", f"{vg.name}/luks1")
        crypt.resize(name, None)
        assert size_of(path) == 96 * MiB - HEADER_BYTES
        with open(path, "rb") as f:
            assert f.read(len(PATTERN)) == PATTERN
        # Opened with the key in the kernel's keyring (LUKS2's default): a resize
        # asks for the passphrase, and reads none from /dev/null.
        crypt.close(name)
        run("cryptsetup", "open", "--type", "luks2", "--key-file", "-", lv, name,
            input=SECRET)
        run("lvextend", "--yes", "--size", "128M", f"{vg.name}/luks1")
        with pytest.raises(KeyMissing):
            crypt.resize(name, None)
        with pytest.raises(KeyRefused):
            crypt.resize(name, Key("not the key"))
        crypt.resize(name, Key(SECRET))
        assert size_of(path) == 128 * MiB - HEADER_BYTES
    finally:
        crypt.close(name)
    assert not os.path.exists(path)
    # A second close of what is closed: cryptsetup's "not active" (4).
    with pytest.raises(CommandError) as again:
        crypt.close(name)
    assert again.value.returncode == 4
    for text in (caplog.text, refused.value.message, str(refused.value)):
        assert "horse" not in text and "not the key" not in text


def test_the_runner_never_logs_or_reports_stdin(caplog: pytest.LogCaptureFixture) -> None:
    """A command that fails after reading its standard input reports argv and
    its own output, never what it was given."""
    caplog.set_level(logging.DEBUG)
    with pytest.raises(CommandError) as err:
        ProcessRunner(timeout=30).run(["sh", "-c", "cat >/dev/null; echo failed >&2; exit 2"],
                                      input=SECRET)
    text = f"{err.value} {err.value.argv} {err.value.stdout} {err.value.stderr}"
    assert "failed" in text and "horse" not in text and "horse" not in caplog.text
