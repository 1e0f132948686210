"""The interceptor that ends every call: codes from rpc.status_of, one log line per call."""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from csi_local._gen import csi_pb2 as pb
from csi_local.csi.server import ErrorInterceptor
from csi_local.errors import NoRoom


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code.name, message)


def _stream(fn: Any, observed: list[tuple[str, str]]) -> list[Any] | tuple[str, str]:
    """Run a server-streaming handler through the interceptor: the messages, or
    the (code, message) it ended with."""
    interceptor = ErrorInterceptor(lambda method, code, _s: observed.append((method, code)))
    details = types.SimpleNamespace(method="/csi.v1.SnapshotMetadata/GetMetadataDelta")
    handler = interceptor.intercept_service(
        lambda _: grpc.unary_stream_rpc_method_handler(fn), details)
    assert handler is not None and handler.unary_stream is not None
    got: list[Any] = []
    try:
        for reply in handler.unary_stream(pb.GetMetadataDeltaRequest(), _Context()):  # type: ignore[arg-type]
            got.append(reply)
    except _Aborted as aborted:
        return aborted.args[0], aborted.args[1]
    return got


def test_a_stream_that_fails_part_way_ends_with_its_code_after_what_it_sent(
        caplog: pytest.LogCaptureFixture) -> None:
    def two_then_full(request: Any, context: Any) -> Iterator[Any]:
        yield pb.GetMetadataDeltaResponse()
        yield pb.GetMetadataDeltaResponse()
        raise NoRoom("the pool is full")

    observed: list[tuple[str, str]] = []
    with caplog.at_level(logging.INFO, logger="csi_local.csi.server"):
        assert _stream(two_then_full, observed) == ("RESOURCE_EXHAUSTED", "the pool is full")
    assert observed == [("GetMetadataDelta", "RESOURCE_EXHAUSTED")]
    assert "GetMetadataDelta -> RESOURCE_EXHAUSTED after 2 messages: the pool is full" \
        in caplog.text
    assert "Traceback" not in caplog.text


def test_a_bug_in_a_stream_is_internal_with_its_traceback_in_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: Any, context: Any) -> Iterator[Any]:
        yield pb.GetMetadataDeltaResponse()
        raise KeyError("a bug")

    observed: list[tuple[str, str]] = []
    with caplog.at_level(logging.INFO, logger="csi_local.csi.server"):
        code, _message = _stream(broken, observed)
    assert code == "INTERNAL"
    assert observed == [("GetMetadataDelta", "INTERNAL")]
    assert "GetMetadataDelta failed unexpectedly" in caplog.text
    assert "KeyError" in caplog.text


def test_a_stream_that_ends_normally_sends_everything() -> None:
    def three(request: Any, context: Any) -> Iterator[Any]:
        for _ in range(3):
            yield pb.GetMetadataDeltaResponse()

    observed: list[tuple[str, str]] = []
    assert len(_stream(three, observed)) == 3
    assert observed == [("GetMetadataDelta", "OK")]
