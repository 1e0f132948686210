"""Errors that carry their gRPC status code, by name.

Helpers raise these; the server interceptor is the one place that turns them
into a status on the wire. The codes are names, not grpc objects, so the LVM
and file-system layers (and the Nomad host volume plugin, which must start
fast) never import grpc.
"""

from __future__ import annotations

from collections.abc import Sequence


class CsiError(Exception):
    """An error with a defined CSI status code."""

    code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(CsiError):
    code = "INVALID_ARGUMENT"


class NotFound(CsiError):
    code = "NOT_FOUND"


class AlreadyExists(CsiError):
    code = "ALREADY_EXISTS"


class OutOfRange(CsiError):
    code = "OUT_OF_RANGE"


class ResourceExhausted(CsiError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(CsiError):
    code = "FAILED_PRECONDITION"


class Aborted(CsiError):
    code = "ABORTED"


class Unavailable(CsiError):
    code = "UNAVAILABLE"


class Unimplemented(CsiError):
    code = "UNIMPLEMENTED"


class Internal(CsiError):
    code = "INTERNAL"


class VolumeNotFound(NotFound):
    """The LV (volume or snapshot) does not exist: LVM's "not found", mapped once."""


class CommandError(Internal):
    """A command exited non-zero or timed out."""

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int,
        stdout: str,
        stderr: str,
        *,
        timed_out: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out
        what = "timed out" if timed_out else f"exited {returncode}"
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        super().__init__(f"{self.argv[0]} {what}: {detail}".rstrip(": "))
