"""host/crypt.py: cryptsetup's commands as the plugin runs them, the key on
standard input only, and cryptsetup's exit codes as errors."""

from __future__ import annotations

import json
import os
import pickle
import resource
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from csi_local.errors import CommandError, KeyMissing, KeyRefused
from csi_local.host import crypt
from csi_local.host.crypt import Crypt, Key, LuksSettings, forbid_core_dumps, read_key_file
from csi_local.host.runner import Result
from tests.unit.fakes.common import WholeOutputStreams

SECRET = "correct horse\nbattery staple"


class Recorder(WholeOutputStreams):
    """A Runner that records argv and standard input, and answers with exit
    codes a test sets per subcommand (cryptsetup's second argument)."""

    def __init__(self, codes: dict[str, int] | None = None,
                 stderrs: dict[str, str] | None = None) -> None:
        self.calls: list[tuple[tuple[str, ...], str | bytes | None]] = []
        self.codes = codes or {}
        self.stderrs = stderrs or {}

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            input: str | bytes | None = None, timeout: float | None = None) -> Result:
        argv = tuple(argv)
        self.calls.append((argv, input))
        code = self.codes.get(argv[1], 0)
        stderr = self.stderrs.get(
            argv[1], "No key available with this passphrase.\n" if code == 2 else "")
        if code not in ok_codes:
            raise CommandError(argv, code, "", stderr)
        return Result(argv, code, "", stderr)


def test_key_hides_its_value() -> None:
    key = Key(SECRET)
    assert SECRET not in repr(key) and SECRET not in str(key)
    assert SECRET not in f"{key!r} {key}" and key.reveal() == SECRET.encode()
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(ValueError):
        Key("")
    with pytest.raises(ValueError):
        Key("x" * (64 * 1024 + 1))


def test_format_passes_the_key_on_stdin_only() -> None:
    runner = Recorder()
    Crypt(runner).format("/dev/vg0/lv", Key(SECRET))
    ((argv, stdin),) = runner.calls
    assert stdin == SECRET.encode()
    assert all(SECRET not in a and "horse" not in a for a in argv)
    assert argv[:3] == ("cryptsetup", "luksFormat", "--batch-mode")
    assert argv[-3:] == ("--key-file", "-", "/dev/vg0/lv")
    # The documented defaults.
    joined = " ".join(argv)
    for part in ("--type luks2", "--cipher aes-xts-plain64", "--key-size 512",
                 "--pbkdf argon2id", "--pbkdf-memory 65536", "--pbkdf-parallel 1",
                 "--iter-time 1000"):
        assert part in joined


def test_settings_reach_the_command() -> None:
    runner = Recorder()
    Crypt(runner, LuksSettings(pbkdf_memory_kib=32768, iter_time_ms=200)).format(
        "/dev/x", Key("k"))
    argv = runner.calls[0][0]
    assert argv[argv.index("--pbkdf-memory") + 1] == "32768"
    assert argv[argv.index("--iter-time") + 1] == "200"


def test_open_and_a_wrong_key() -> None:
    runner = Recorder()
    assert Crypt(runner).open("/dev/vg0/lv", "csi-local-luks-lv", Key(SECRET)) == \
        "/dev/mapper/csi-local-luks-lv"
    argv, stdin = runner.calls[0]
    assert argv == ("cryptsetup", "open", "--type", "luks2", "--allow-discards",
                    "--disable-keyring", "--persistent", "--key-file", "-", "/dev/vg0/lv",
                    "csi-local-luks-lv")
    assert stdin == SECRET.encode()
    refused = Recorder({"open": 2})
    with pytest.raises(KeyRefused) as err:
        Crypt(refused).open("/dev/vg0/lv", "m", Key(SECRET))
    assert SECRET not in err.value.message and "no keyslot" in err.value.message
    # Any other failure stays a CommandError, with its exit code.
    other = Recorder({"open": 5})
    with pytest.raises(CommandError) as cerr:
        Crypt(other).open("/dev/vg0/lv", "m", Key(SECRET))
    assert cerr.value.returncode == 5 and not isinstance(cerr.value, KeyRefused)


def luks2_header(flags: list[str] | None, seqid: int = 1, magic: bytes = b"LUKS\xba\xbe",
                 size: int = 16384) -> bytes:
    """One LUKS2 header copy as cryptsetup writes it: the binary part, then
    the JSON area (config.flags when given), NUL-padded to `size`."""
    binary = (magic + (2).to_bytes(2, "big") + size.to_bytes(8, "big")
              + seqid.to_bytes(8, "big")).ljust(4096, b"\0")
    config: dict[str, object] = {"json_size": "12288", "keyslots_size": "16744448"}
    if flags is not None:
        config["flags"] = flags
    text = json.dumps({"keyslots": {}, "segments": {}, "config": config}).encode()
    return binary + text.ljust(size - 4096, b"\0")


def test_persistent_flags_come_from_the_current_header_copy(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_bytes(luks2_header(["allow-discards"]) + luks2_header(None, 0, b"SKUL\xba\xbe"))
    assert crypt.persistent_flags(str(dev)) == frozenset({"allow-discards"})
    # The secondary copy is newer (a write cut short after it): it counts.
    dev.write_bytes(luks2_header(["allow-discards"], 4)
                    + luks2_header([], 5, b"SKUL\xba\xbe"))
    assert crypt.persistent_flags(str(dev)) == frozenset()
    dev.write_bytes(luks2_header(None) + b"\0" * 16384)
    assert crypt.persistent_flags(str(dev)) == frozenset()
    dev.write_bytes(b"\0" * 32768)  # no header
    assert crypt.persistent_flags(str(dev)) is None
    assert crypt.persistent_flags(str(tmp_path / "missing")) is None


def test_open_stores_the_discard_flag_only_where_the_header_lacks_it() -> None:
    """cryptsetup rewrites the header at every --persistent open: only a
    header without the flag is given it."""
    cases: list[tuple[frozenset[str] | None, bool]] = [
        (frozenset({"allow-discards"}), False), (frozenset(), True), (None, True)]
    for kept, persist in cases:
        runner = Recorder()

        def read(device: str, kept: frozenset[str] | None = kept) -> frozenset[str] | None:
            return kept
        Crypt(runner, header_flags=read).open("/dev/x", "m", Key(SECRET))
        argv = runner.calls[0][0]
        assert "--allow-discards" in argv and ("--persistent" in argv) == persist


def test_verify_asks_the_header_only() -> None:
    runner = Recorder()
    Crypt(runner).verify("/dev/vg0/lv", Key(SECRET))
    assert runner.calls == [(("cryptsetup", "open", "--test-passphrase", "--type", "luks2",
                              "--key-file", "-", "/dev/vg0/lv"), SECRET.encode())]
    with pytest.raises(KeyRefused) as err:
        Crypt(Recorder({"open": 2})).verify("/dev/vg0/lv", Key(SECRET))
    assert SECRET not in err.value.message and "no keyslot" in err.value.message
    with pytest.raises(CommandError) as cerr:
        Crypt(Recorder({"open": 4})).verify("/dev/vg0/lv", Key(SECRET))
    assert not isinstance(cerr.value, KeyRefused)


def test_is_luks_answers_only_yes_or_no() -> None:
    assert Crypt(Recorder()).is_luks("/dev/a")
    assert not Crypt(Recorder({"isLuks": 1})).is_luks("/dev/a")
    # A device cryptsetup cannot read is never "no header" (that could format it).
    with pytest.raises(CommandError):
        Crypt(Recorder({"isLuks": 4})).is_luks("/dev/a")


def test_resize_and_close() -> None:
    runner = Recorder()
    crypt = Crypt(runner)
    crypt.resize("m", Key(SECRET))
    crypt.resize("m", None)
    crypt.close("m")
    assert runner.calls == [
        (("cryptsetup", "resize", "--batch-mode", "--key-file", "-", "m"), SECRET.encode()),
        # No key: nothing on standard input (the Runner's /dev/null), no prompt.
        (("cryptsetup", "resize", "--batch-mode", "m"), None),
        (("cryptsetup", "close", "m"), None),
    ]
    with pytest.raises(KeyRefused):
        Crypt(Recorder({"resize": 2})).resize("m", Key(SECRET))


def test_a_resize_that_asks_for_a_passphrase_wants_the_key() -> None:
    """A device whose volume key is in the kernel's keyring: cryptsetup asks
    for the passphrase and reads none from /dev/null. That is KeyMissing (the
    request's INVALID_ARGUMENT), any other failure stays a CommandError."""
    asks = Recorder({"resize": 1}, {"resize": "Nothing to read on input.\n"})
    with pytest.raises(KeyMissing) as err:
        Crypt(asks).resize("m", None)
    assert "keyring" in err.value.message and "stage" in err.value.message
    with pytest.raises(CommandError) as other:
        Crypt(Recorder({"resize": 1}, {"resize": "Device m is not active.\n"})).resize(
            "m", None)
    assert not isinstance(other.value, KeyMissing)


# Key files: only a regular file, opened without blocking or following a link --------------


def _key_file(tmp_path: Path, data: bytes = b"k") -> Path:
    path = tmp_path / "key"
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def test_a_fifo_at_the_key_path_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO is refused as not a regular file, at once: without O_NONBLOCK
    the open waited for a writer that never comes (a create hung until
    Nomad's deadline)."""
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    got: list[BaseException] = []

    def read() -> None:
        try:
            read_key_file(str(fifo))
        except BaseException as err:  # handed to the test's thread
            got.append(err)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # blocked in open(): a writer's open lets it go on
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("the open of a FIFO blocked")
    (err,) = got
    assert isinstance(err, KeyMissing) and "not a regular file" in err.message


def test_a_symlink_at_the_key_path_is_refused(tmp_path: Path) -> None:
    target = _key_file(tmp_path, b"secret bytes")
    link = tmp_path / "key.link"
    link.symlink_to(target)
    with pytest.raises(KeyMissing) as err:
        read_key_file(str(link))
    assert "secret" not in err.value.message
    assert read_key_file(str(target)).reveal() == b"secret bytes"


# No core dumps: a dump would write the keys a plugin process holds to disk -----------------


def test_forbid_core_dumps_sets_rlimit_core_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, tuple[int, int]]] = []
    monkeypatch.setattr(resource, "setrlimit", lambda *a: calls.append(a))
    forbid_core_dumps()
    assert calls == [(resource.RLIMIT_CORE, (0, 0))]


def test_serve_and_dhv_forbid_core_dumps_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from csi_local import cli, dhv
    from csi_local.csi import server

    steps: list[str] = []
    monkeypatch.setattr(crypt, "forbid_core_dumps", lambda: steps.append("no core"))
    monkeypatch.setattr(server, "serve", lambda config: steps.append("serve"))
    monkeypatch.setattr(cli, "setup_logging", lambda *a: None)
    assert cli.main(["serve", "--endpoint", "unix:///run/x.sock", "--node-id", "n1",
                     "--volume-group", "vg0", "--thin-pool", "pool"]) == 0
    assert steps == ["no core", "serve"]
    steps.clear()
    monkeypatch.setattr(dhv, "_setup_logging", lambda: None)
    for key in [k for k in os.environ if k.startswith("DHV_")]:
        monkeypatch.delenv(key)
    assert dhv.main(["csi-local-dhv", "create"]) == 1  # no request: refused, but after
    assert steps == ["no core"]
