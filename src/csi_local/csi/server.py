"""The gRPC server: unix socket, the error interceptor, signals, shutdown."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from csi_local._gen import csi_pb2_grpc
from csi_local.config import Config
from csi_local.csi.plugin import CsiPlugin
from csi_local.csi.rpc import RpcError, status_of
from csi_local.errors import FormatTooNew, LockDirError, StorageError
from csi_local.nodestate.state_file import StateLocked
from csi_local.ops.demo_vg import ensure_backing

log = logging.getLogger(__name__)


class ServerError(Exception):
    """The server cannot start."""


def redact(request: Message) -> str:
    """The request as text, with every `secrets` field emptied."""
    from google.protobuf import text_format  # only when debug logging is on

    if any(f.name == "secrets" for f in request.DESCRIPTOR.fields):
        request = type(request).FromString(request.SerializeToString())
        request.ClearField("secrets")
    return text_format.MessageToString(request, as_one_line=True)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns errors into status codes (through rpc.status_of, the one table) and
    logs every call with its outcome and time. `observe(method, code, seconds)`,
    when given, hears of every call too ("OK" or the code's name); the metrics
    use it."""

    def __init__(self, observe: Callable[[str, str, float], None] | None = None) -> None:
        self.observe = observe

    def _observed(self, method: str, code: str, started: float) -> float:
        """Seconds since `started`, told to the observer (which never fails a call)."""
        seconds = time.monotonic() - started
        if self.observe is not None:
            try:
                self.observe(method, code, seconds)
            except Exception:
                log.exception("RPC observer failed")
        return seconds

    def _abort(self, context: grpc.ServicerContext, method: str, err: Exception,
               started: float, progress: str) -> NoReturn:
        """End the call with the code rpc.status_of gives `err`: an expected error
        is logged as the call's outcome, anything else with its traceback."""
        code, message = status_of(method, err)
        if isinstance(err, (RpcError, StorageError)):
            log.info("%s -> %s%s: %s (%.3fs)", method, code, progress, message,
                     self._observed(method, code, started))
        else:
            log.exception("%s failed unexpectedly", method)
            self._observed(method, code, started)
        context.abort(grpc.StatusCode[code], message)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        if handler.unary_stream is not None:
            return self._streaming(handler, method)
        if handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def wrapped(request: Message, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()
            if log.isEnabledFor(logging.DEBUG):  # never pay for the text otherwise
                log.debug("%s request: %s", method, redact(request))
            try:
                reply = inner(request, context)
            except Exception as err:
                self._abort(context, method, err, started, "")
            log.info("%s -> OK (%.3fs)", method, self._observed(method, "OK", started))
            return reply

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _streaming(self, handler: grpc.RpcMethodHandler[Any, Any],
                   method: str) -> grpc.RpcMethodHandler[Any, Any]:
        """The same for a server-streaming RPC (SnapshotMetadata): an error raised
        before or between messages ends the stream with its code, which the
        spec tells a client apart from the stream's normal end."""
        inner = handler.unary_stream
        assert inner is not None

        def wrapped(request: Message, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.monotonic()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s request: %s", method, redact(request))
            sent = 0
            try:
                for reply in inner(request, context):
                    sent += 1
                    yield reply
            except Exception as err:
                self._abort(context, method, err, started, f" after {sent} messages")
            log.info("%s -> OK, %d messages (%.3fs)", method, sent,
                     self._observed(method, "OK", started))

        return grpc.unary_stream_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _claim_socket(path: str) -> None:
    """Remove a stale socket file; refuse when a live server answers on it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.lexists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
    except OSError:
        log.info("removing stale socket %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ServerError(f"another server is already listening on {path}; refusing to start")


def build_server(plugin: CsiPlugin, socket_file: str, workers: int = 16) -> grpc.Server:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        interceptors=[ErrorInterceptor(plugin.metrics.observe_rpc if plugin.metrics else None)],
    )
    csi_pb2_grpc.add_IdentityServicer_to_server(plugin.identity, server)
    csi_pb2_grpc.add_ControllerServicer_to_server(plugin.controller, server)
    csi_pb2_grpc.add_NodeServicer_to_server(plugin.node, server)
    csi_pb2_grpc.add_SnapshotMetadataServicer_to_server(plugin.snapshot_metadata, server)
    csi_pb2_grpc.add_GroupControllerServicer_to_server(plugin.group_controller, server)
    if server.add_insecure_port(f"unix://{socket_file}") == 0:
        raise ServerError(f"cannot listen on {socket_file}")
    return server


def _seconds_since_exec() -> float | None:
    """How long ago this process started (Linux: /proc), for the start-up log."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def serve(config: Config) -> None:
    began = time.monotonic()
    before = _seconds_since_exec()
    path = config.socket
    _claim_socket(path)
    if config.backing_file is not None and config.backing_size is not None:
        ensure_backing(config)
    try:
        plugin = CsiPlugin(config)
    except (StateLocked, LockDirError, FormatTooNew) as err:
        raise ServerError(str(err)) from None
    server = build_server(plugin, path)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    plugin.start()
    metrics_server = None
    if plugin.metrics is not None:
        from csi_local.ops.metrics import serve_metrics

        try:
            metrics_server = serve_metrics(plugin.metrics, config.metrics_address)
        except OSError as err:
            server.stop(0).wait()
            plugin.close()
            if os.path.lexists(path):
                os.unlink(path)
            raise ServerError(f"cannot serve metrics on {config.metrics_address}: {err}") from None
    classes = config.classes
    log.info(
        "csi-local serving %s on %s (node %s; device classes: %s; default %s)",
        config.driver_name, config.endpoint, config.node_id,
        ", ".join(f"{c.name}={c.pool_name}" for c in classes.classes), classes.default,
    )
    # Python and its imports, then csi-local's own start (the state loaded and
    # reconciled with the mount table and LVM, the recovery of a crashed run).
    log.info("started in %s (own start: %.3fs)",
             "?" if before is None else f"{before + time.monotonic() - began:.3f}s",
             time.monotonic() - began)
    stop.wait()
    # New RPCs are refused at once; in-flight ones get the grace period
    # (--shutdown-grace), which ends before the CO's SIGKILL.
    server.stop(config.shutdown_grace).wait()
    if metrics_server is not None:
        metrics_server.stop()
    plugin.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    log.info("stopped")
