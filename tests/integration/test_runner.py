"""The runner against real (harmless) processes: output, exit codes, the
environment, input, and the timeout that kills a child. (Unit tests start no
processes, so these run with the integration suite.)"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import pytest

from csi_local.errors import CommandError
from csi_local.host.runner import ProcessRunner

pytestmark = pytest.mark.integration


def test_output_exit_code_and_fixed_environment() -> None:
    res = ProcessRunner().run(["sh", "-c", 'echo "out $LC_ALL"; echo err >&2; exit 3'],
                         ok_codes=(3,))
    assert (res.returncode, res.stdout, res.stderr) == (3, "out C\n", "err\n")
    assert res.argv[0].endswith("/sh")  # resolved to an absolute path


def test_an_unexpected_exit_code_carries_argv_code_and_output() -> None:
    with pytest.raises(CommandError) as info:
        ProcessRunner().run(["sh", "-c", "echo partial; echo 'it broke' >&2; exit 5"])
    err = info.value
    assert (err.returncode, err.stdout, err.stderr) == (5, "partial\n", "it broke\n")
    assert err.argv[1:] == ["-c", "echo partial; echo 'it broke' >&2; exit 5"]
    assert not err.timed_out and str(err).endswith("exited 5: it broke")


def test_input_reaches_the_child() -> None:
    assert ProcessRunner().run(["cat"], input="a line\n").stdout == "a line\n"


def test_bytes_reach_the_child_byte_for_byte() -> None:
    """A key file's bytes, not UTF-8 text, reach cryptsetup's standard input
    as they are; the output is text as ever."""
    raw = bytes(range(256))
    res = ProcessRunner().run(["od", "-An", "-v", "-tx1"], input=raw)
    assert bytes.fromhex(res.stdout) == raw
    assert ProcessRunner().run(["sh", "-c", "cat; echo err >&2"], input=b"a\r\nb").stdout \
        == "a\nb"  # as a text pipe gives it: universal newlines


def test_a_hung_child_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(CommandError) as info:
        ProcessRunner().run(["sleep", "30"], timeout=0.3)
    assert info.value.timed_out and info.value.returncode == -9
    assert time.monotonic() - started < 10


def test_a_child_killed_by_someone_else_is_a_command_error() -> None:
    # The shell kills itself: no timeout fired, so this is no timeout either.
    with pytest.raises(CommandError) as info:
        ProcessRunner().run(["sh", "-c", f"kill -{signal.SIGTERM} $$"])
    assert info.value.returncode == -signal.SIGTERM and not info.value.timed_out


def test_a_missing_tool_is_exit_127() -> None:
    with pytest.raises(CommandError) as info:
        ProcessRunner().run([f"no-such-tool-{os.getpid()}"])
    assert info.value.returncode == 127


def test_a_timeout_kills_what_the_child_started_too() -> None:
    # The shell's own child (sleep) would hold the pipes open for 30 s after
    # the shell alone was killed; the output written before the kill is kept.
    started = time.monotonic()
    with pytest.raises(CommandError) as info:
        ProcessRunner().run(["sh", "-c", "echo started; echo $$ >&2; sleep 30; true"],
                            timeout=1)
    assert time.monotonic() - started < 10
    err = info.value
    assert err.timed_out and err.stdout == "started\n"
    shell = int(err.stderr.splitlines()[0])
    assert err.stderr.endswith("timed out after 1s")
    # Nothing of the killed group is left.
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(shell, 0)


def test_each_command_has_its_own_timeout() -> None:
    runner = ProcessRunner()
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        hung = pool.submit(runner.run, ["sleep", "30"], timeout=0.5)
        quick = pool.submit(runner.run, ["sleep", "2"], timeout=60)
        later = pool.submit(runner.run, ["sleep", "1"], timeout=0.2)
        with pytest.raises(CommandError) as info:
            hung.result(timeout=20)
        assert info.value.timed_out
        assert quick.result(timeout=20).returncode == 0
        with pytest.raises(CommandError) as info:
            later.result(timeout=20)
        assert info.value.timed_out
    # One watchdog thread for every command, not a thread each.
    before = threading.active_count()
    for _ in range(5):
        runner.run(["true"])
    assert threading.active_count() == before
