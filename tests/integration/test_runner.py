"""The runner against real (harmless) processes: output, exit codes, the
environment, input, and the timeout that kills a child. (Unit tests start no
processes, so these run with the integration suite.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from csi_local.errors import CommandError
from csi_local.runner import ShRunner

pytestmark = pytest.mark.integration


def test_output_exit_code_and_fixed_environment() -> None:
    res = ShRunner().run(["sh", "-c", 'echo "out $LC_ALL"; echo err >&2; exit 3'],
                         ok_codes=(3,))
    assert (res.returncode, res.stdout, res.stderr) == (3, "out C\n", "err\n")
    assert res.argv[0].endswith("/sh")  # resolved to an absolute path


def test_an_unexpected_exit_code_carries_argv_code_and_output() -> None:
    with pytest.raises(CommandError) as info:
        ShRunner().run(["sh", "-c", "echo partial; echo 'it broke' >&2; exit 5"])
    err = info.value
    assert (err.returncode, err.stdout, err.stderr) == (5, "partial\n", "it broke\n")
    assert err.argv[1:] == ["-c", "echo partial; echo 'it broke' >&2; exit 5"]
    assert not err.timed_out and str(err).endswith("exited 5: it broke")


def test_input_reaches_the_child() -> None:
    assert ShRunner().run(["cat"], input="a line\n").stdout == "a line\n"


def test_a_hung_child_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(CommandError) as info:
        ShRunner().run(["sleep", "30"], timeout=0.3)
    assert info.value.timed_out and info.value.returncode == -9
    assert time.monotonic() - started < 10


def test_a_child_killed_by_someone_else_is_a_command_error() -> None:
    # The shell kills itself: no timeout fired, so this is no timeout either.
    with pytest.raises(CommandError) as info:
        ShRunner().run(["sh", "-c", f"kill -{signal.SIGTERM} $$"])
    assert info.value.returncode == -signal.SIGTERM and not info.value.timed_out


def test_a_missing_tool_is_exit_127() -> None:
    with pytest.raises(CommandError) as info:
        ShRunner().run([f"no-such-tool-{os.getpid()}"])
    assert info.value.returncode == 127
