"""The runner against real (harmless) processes: output, exit codes, the
environment, input, and the timeout that kills a child. (Unit tests start no
processes, so these run with the integration suite.)"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Generator

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


# Runner.stream: output read as it is written (thin_dump, thin_delta) ---------

def gone(group: int) -> bool:
    """Nothing of process group `group` is left (given a moment to be reaped)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_stream_reads_output_as_it_is_written() -> None:
    # The child waits for a file that the reader makes only after it has the
    # first line: output held until the end would never arrive.
    flag = f"/run/csi-local-stream-{os.getpid()}"
    with ProcessRunner().stream(
            ["sh", "-c", f'echo "first $LC_ALL"; while [ ! -e {flag} ]; do sleep 0.05; done; '
             "echo second"], timeout=30) as out:
        first = out.read(100)
        open(flag, "w").close()
        rest = b""
        while chunk := out.read(100):
            rest += chunk
    os.unlink(flag)
    assert (first, rest) == (b"first C\n", b"second\n")


def test_stream_failure_carries_code_and_stderr() -> None:
    heard: list[tuple[str, bool]] = []
    runner = ProcessRunner(observe=lambda tool, _seconds, ok: heard.append((tool, ok)))
    with pytest.raises(CommandError) as info, runner.stream(
            ["sh", "-c", "echo partial; echo 'it broke' >&2; exit 5"]) as out:
        assert out.read(100) == b"partial\n"
    err = info.value
    assert (err.returncode, err.stderr) == (5, "it broke\n") and not err.timed_out
    with runner.stream(["true"]):
        pass
    assert heard == [("sh", False), ("true", True)]  # the metrics hear of both
    with pytest.raises(CommandError) as info, ProcessRunner().stream(
            [f"no-such-tool-{os.getpid()}"]):
        pass
    assert info.value.returncode == 127


def test_stream_a_failed_tool_outranks_the_readers_error_about_its_output() -> None:
    """thin_dump failing halfway: the truncated XML is the symptom, the
    tool's exit and standard error the cause."""
    with pytest.raises(CommandError) as info, ProcessRunner().stream(
            ["sh", "-c", "echo '<superblock'; echo 'bad metadata' >&2; exit 1"]) as out:
        while out.read(100):
            pass
        raise ValueError("not XML")
    assert (info.value.returncode, info.value.stderr) == (1, "bad metadata\n")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="not XML"), ProcessRunner().stream(
            ["sh", "-c", "echo '<superblock'"]) as out:  # exit 0: the reader's error
        while out.read(100):
            pass
        raise ValueError("not XML")


def test_stream_a_reader_that_gives_up_leaves_no_child() -> None:
    """A reader failing (or a caller going away) mid-output: the child, which
    would block on the full pipe, and what it started are killed."""
    started = time.monotonic()
    with pytest.raises(RuntimeError), ProcessRunner().stream(
            ["sh", "-c", "echo $$; yes; sleep 30"], timeout=60) as out:
        group = int(out.read(4096).split(b"\n")[0])
        raise RuntimeError("reader failed")
    assert gone(group) and time.monotonic() - started < 10

    def reader() -> Generator[bytes, None, None]:
        with ProcessRunner().stream(["sh", "-c", "echo $$; yes"], timeout=60) as out:
            while True:
                yield out.read(4096)

    gen = reader()
    group = int(next(gen).split(b"\n")[0])
    gen.close()  # GeneratorExit at the yield: as a cancelled gRPC stream
    assert gone(group)


def test_stream_timeout_kills_the_group_and_says_so() -> None:
    started = time.monotonic()
    with pytest.raises(CommandError) as info, ProcessRunner().stream(
            ["sh", "-c", "echo $$; echo err >&2; sleep 30"], timeout=1) as out:
        group = int(out.read(100).split(b"\n")[0])
        while out.read(100):
            pass
    err = info.value
    assert err.timed_out and err.returncode == -9
    assert err.stderr == "err\ntimed out after 1s"
    assert gone(group) and time.monotonic() - started < 10


def test_stream_a_chatty_stderr_cannot_block_the_child() -> None:
    """Standard error is not a pipe: 1 MiB of it while the reader waits for
    standard output does not stall the child; the failure keeps its tail."""
    with pytest.raises(CommandError) as info, ProcessRunner().stream(
            ["sh", "-c", "head -c 1048576 /dev/zero | tr '\\0' x >&2; echo done; "
             "echo last >&2; exit 2"], timeout=30) as out:
        assert out.read(100) == b"done\n"
    assert info.value.stderr.endswith("xxxlast\n")
    assert len(info.value.stderr) <= 64 * 1024
