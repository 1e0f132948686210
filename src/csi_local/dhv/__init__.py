"""csi-local-dhv: a Nomad dynamic host volume plugin on the same LVM thin pools
(device classes) as the CSI plugin, sharing its pools, locks and file-system
rules.

    csi-local-dhv fingerprint | create | delete     (run by Nomad)
    csi-local-dhv install --plugin-dir DIR --volume-group VG --thin-pool POOL
    csi-local-dhv install --plugin-dir DIR --config CLASSES.toml   (device classes)
    csi-local-dhv snapshot create|delete|list ...    (run by an operator)

Nomad runs the plugin with an empty environment plus DHV_* variables and
gives fingerprint one second, so that path imports nothing but this module:
the rest of the package (request, config, tags, plugin, install) and the
LVM, file-system and locking code are imported inside create/delete.
Results go to stdout as one JSON object ({"version"}, {"path", "bytes"}, or
{"error"} with exit status 1); logs go to stderr, which Nomad logs.
"""

from __future__ import annotations

import os
import sys

from csi_local import __version__

USAGE = """\
usage: csi-local-dhv fingerprint|create|delete   (run by Nomad, configured by DHV_* variables)
       csi-local-dhv install --plugin-dir DIR --volume-group VG --thin-pool POOL [options]
       csi-local-dhv install --plugin-dir DIR --config CLASSES.toml [options]
       csi-local-dhv snapshot create VOLUME_ID NAME [--device-class C] | delete NAME |
                              list [VOLUME_ID] [--json]
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv if argv is None else argv)
    argv0 = args[0] if args else ""
    op = args[1] if len(args) > 1 else os.environ.get("DHV_OPERATION", "")
    if op == "fingerprint":
        sys.stdout.write('{"version": "%s"}\n' % __version__)  # noqa: UP031 - no imports
        sys.stdout.flush()
        return 0
    if op == "install":
        from csi_local.dhv.install import install

        return install(args[2:])
    if op in ("create", "delete"):
        return _operate(op, argv0)
    if op == "snapshot":
        _setup_logging()
        from csi_local.dhv.snapshot import main as snapshot

        return snapshot(args[2:], argv0)
    if op in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    return _fail(f"unknown operation {op!r}; expected fingerprint, create, delete, install "
                 "or snapshot")


def _fail(message: str) -> int:
    import json

    sys.stderr.write(f"csi-local-dhv: error: {message}\n")
    sys.stdout.write(json.dumps({"error": message}) + "\n")
    sys.stdout.flush()
    return 1


def _setup_logging() -> None:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("csi-local-dhv: %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def _operate(op: str, argv0: str) -> int:
    _setup_logging()
    try:
        from csi_local.host.crypt import forbid_core_dumps

        forbid_core_dumps()  # before any key file is read
        from csi_local.dhv.config import load_config
        from csi_local.dhv.request import ok_json, parse_request

        req = parse_request(op, os.environ, argv0)
        config = load_config(req.plugin_dir, argv0)
        from csi_local.dhv.host_volumes import HostVolumes

        plugin = HostVolumes(config)
        if op == "create":
            path, size = plugin.create(req)
            out = ok_json(path, size)
        else:
            plugin.delete(req)
            out = "{}"
    except Exception as exc:
        return fail_with(exc)
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
    return 0


def fail_with(exc: Exception) -> int:
    """Report `exc` as {"error": ...} (exit status 1)."""
    return _fail(_message(exc))


def _message(exc: Exception) -> str:
    from csi_local.dhv.request import DhvError

    if isinstance(exc, DhvError):
        return str(exc)
    message = getattr(exc, "message", None)  # a StorageError (CommandError, LockBusy, ...)
    if isinstance(message, str) and message:
        return message
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"
