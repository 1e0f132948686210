"""The lvm shell's pure rules: which commands it may take, how a command's
log document becomes an exit code and output, and its profile file. The shell
itself (a real `lvm`) is tested in tests/integration/test_lvm_shell.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from csi_local.storage import lvm_shell
from csi_local.storage.lvm_shell import PROFILE, ensure_profile, line, outcome


@pytest.mark.parametrize(("argv", "taken"), [
    (["lvcreate", "--yes", "--thin", "vg/pool", "--virtualsize", "67108864b", "--name", "v1",
      "--addtag", "csi-local.name=6d79"], True),
    (["lvremove", "--yes", "vg/v1"], True),
    (["lvremove", "-y", "vg/v1"], True),
    (["lvextend", "--size", "134217728b", "vg/v1"], True),
    (["lvchange", "--addtag", "a=b", "vg/v1"], True),
    # A question (wipe a signature? remove an active LV?) would read the next
    # command as its answer.
    (["lvcreate", "--thin", "vg/pool", "-V", "1g", "-n", "v1"], False),
    (["lvremove", "vg/v1"], False),
    # Not a changing command, or not by its bare name.
    (["lvs", "vg"], False),
    (["vgcreate", "--yes", "vg", "/dev/loop0"], False),
    (["/sbin/lvcreate", "--yes", "vg/pool"], False),
    # What lvm_split would not pass through unchanged.
    (["lvchange", "--addtag", "#a", "vg/v1"], False),
    (["lvchange", "--addtag", "a#b", "vg/v1"], True),
    (["lvcreate", "--yes", "--config", "allocation/x=1 y", "vg/pool"], False),
    # Some settings LVM refuses in its shell: a --config runs as a process.
    (["lvcreate", "--yes", "--config", "allocation/thin_pool_zero=0", "vg/pool"], False),
    (["lvcreate", "--yes", "--config=allocation/thin_pool_zero=0", "vg/pool"], False),
    (["lvcreate", "--yes", "--config", 'a="b"', "vg/pool"], False),
    (["lvcreate", "--yes", "--config", "a='b'", "vg/pool"], False),
    (["lvchange", "--addtag", "a\\b", "vg/v1"], False),
    (["lvchange", "--addtag", "a\tb", "vg/v1"], False),
    (["lvchange", "--addtag", "a\nlvremove --yes vg/v2", "vg/v1"], False),
    (["lvchange", "--addtag", "", "vg/v1"], False),
    ([], False),
])
def test_which_commands_the_shell_takes(argv: list[str], taken: bool) -> None:
    assert (line(argv) == " ".join(argv)) if taken else line(argv) is None


def test_too_many_words_or_too_long_a_line_runs_as_a_process() -> None:
    many = ["lvchange", *(["--addtag", "t"] * 31), "vg/v1"]  # 64 words: lvm's MAX_ARGS
    assert line(many) is None and line([*many[:-2], "vg/v1"]) is not None
    long_tag = "t" * (lvm_shell.MAX_LINE - len("lvchange --addtag  vg/v1"))
    assert line(["lvchange", "--addtag", long_tag, "vg/v1"]) is None
    assert line(["lvchange", "--addtag", long_tag[:-1], "vg/v1"]) is not None


def _row(kind: str, message: str, *, context: str = "processing", obj: str = "vg",
         name: str = "vg", code: int = 0) -> dict[str, Any]:
    return {"log_seq_num": "1", "log_type": kind, "log_context": context,
            "log_object_type": obj, "log_object_name": name, "log_message": message,
            "log_errno": "0", "log_ret_code": str(code)}


def _status(command: str, code: int) -> dict[str, Any]:
    return _row("status", "success" if code == 1 else "failure", context="shell", obj="cmd",
                name=command, code=code)


def test_success_is_exit_0_with_the_printed_messages_on_stdout() -> None:
    doc = {"log": [_row("print", 'Logical volume "v1" created.'),
                   _row("warn", "WARNING: Sum of all thin volume sizes exceeds the pool."),
                   _row("status", "success", code=1), _status("lvcreate", 1)]}
    code, out, err = outcome(["lvcreate", "--yes"], doc)
    assert code == 0
    assert out == '  Logical volume "v1" created.\n'
    assert err == "  WARNING: Sum of all thin volume sizes exceeds the pool.\n"


@pytest.mark.parametrize(("ret", "exit_code"), [(5, 5), (3, 3), (4, 4), (0, 5)])
def test_failure_is_lvms_exit_code_with_its_errors_on_stderr(ret: int, exit_code: int) -> None:
    doc = {"log": [_row("error", 'Failed to find logical volume "vg/v9"'),
                   _row("fatal", "Internal error"), _status("lvremove", ret)]}
    code, out, err = outcome(["lvremove", "--yes", "vg/v9"], doc)
    assert (code, out) == (exit_code, "")
    assert err == '  Failed to find logical volume "vg/v9"\n  Internal error\n'


@pytest.mark.parametrize("doc", [
    {},
    {"log": []},
    {"log": "x"},
    {"log": [["not", "a", "row"]]},
    # The status of another command: the framing is lost.
    {"log": [_status("lvchange", 1)]},
    # The last row is not the shell's status.
    {"log": [_status("lvcreate", 1), _row("print", "more")]},
    {"log": [{**_status("lvcreate", 1), "log_ret_code": "x"}]},
])
def test_a_document_that_is_not_the_commands_is_refused(doc: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        outcome(["lvcreate", "--yes"], doc)


def test_the_profile_is_written_once_and_whole(tmp_path: Path) -> None:
    directory = tmp_path / "profile"
    ensure_profile(str(directory))
    path = directory / f"{lvm_shell.PROFILE_NAME}.profile"
    assert path.read_text() == PROFILE
    assert path.stat().st_mode & 0o777 == 0o644
    assert os.listdir(directory) == [path.name]  # no temporary file left
    first = path.stat().st_mtime_ns
    ensure_profile(str(directory))
    assert path.stat().st_mtime_ns == first  # the same text: not written again
    path.write_text("log { report_command_log=0 }\n")
    ensure_profile(str(directory))
    assert path.read_text() == PROFILE


def test_the_profile_turns_on_the_json_command_log_with_every_message() -> None:
    settings = {ln.strip() for ln in PROFILE.splitlines()}
    assert {"report_command_log=1", 'command_log_selection="all"',
            'output_format="json"'} <= settings


def test_a_profile_directory_that_cannot_be_written_is_an_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        ensure_profile(str(blocker / "profile"))


@pytest.mark.parametrize(("code", "stderr", "stale"), [
    # The shell's outdated view of a VG whose PV another process removed.
    (5, "  Cannot process volume group vg0\n", True),
    (5, "  WARNING: Couldn't find device with uuid x.\n  Cannot process volume group vg0\n",
     True),
    # No such VG: a process would say the same; the shell's answer stands.
    (5, '  Volume group "vg0" not found\n  Cannot process volume group vg0\n', False),
    (5, "  Thin pool vg0/pool not found.\n", False),
    (0, "  Cannot process volume group vg0\n", False),
])
def test_only_a_vg_the_shell_could_not_read_is_run_again(code: int, stderr: str,
                                                         stale: bool) -> None:
    assert lvm_shell.stale_vg(code, stderr) is stale


def test_a_closed_shell_never_starts_again(tmp_path: Path) -> None:
    """The plugin starts its shell in a background thread; a close() that comes
    first (a busy metrics port stops the plugin at once) must win, or a real
    lvm shell outlives the plugin."""
    profile_asked: list[str] = []

    def profile_dir() -> str:
        profile_asked.append("asked")
        return str(tmp_path)

    shell = lvm_shell.LvmShell({}, lambda: "/usr/sbin/lvm", profile_dir)
    shell.close()
    assert shell.start() is False
    assert shell.run(["lvcreate", "-n", "x", "vg0"], ["/usr/sbin/lvcreate"], 5.0) is None
    assert shell.disabled == "closed" and shell.started == 0 and not profile_asked


def test_creates_wait_for_a_busy_shell_and_the_others_run_as_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An lvcreate or lvextend holds its pool's lock, which every other create
    waits for: it waits for the shell another command holds (up to
    SHELL_WAIT) rather than start a slower process; an lvremove does not."""
    import threading
    import time

    shell = lvm_shell.LvmShell({}, lambda: "/usr/sbin/lvm", lambda: "/nonexistent")
    ran: list[str] = []
    monkeypatch.setattr(shell, "_exchange",
                        lambda text, name, deadline: ran.append(name))  # then: no shell
    busy = threading.Event()

    def other_command() -> None:
        with shell._lock:
            busy.set()
            time.sleep(0.5)

    t = threading.Thread(target=other_command)
    t.start()
    busy.wait(5)
    t0 = time.monotonic()
    assert shell.run(["lvremove", "--yes", "vg0/x"], ["/usr/sbin/lvremove"], 5.0) is None
    assert time.monotonic() - t0 < 0.3 and ran == []  # a process now
    assert shell.run(["lvcreate", "--yes", "-n", "x", "vg0"], ["/usr/sbin/lvcreate"], 5.0) \
        is None
    assert time.monotonic() - t0 >= 0.4 and ran == ["lvcreate"]  # it waited, then had the shell
    t.join(5)
    monkeypatch.setattr(lvm_shell, "SHELL_WAIT", 0.1)
    with shell._lock:  # a shell busy past SHELL_WAIT: a process after all
        t1 = time.monotonic()
        assert shell.run(["lvextend", "-L", "1g", "vg0/x"], ["/usr/sbin/lvextend"], 5.0) is None
        assert 0.05 < time.monotonic() - t1 < 1.0 and ran == ["lvcreate"]
