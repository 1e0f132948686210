"""csi-local-dhv: a Nomad dynamic host volume plugin on the same LVM thin pool
as the CSI plugin.

    csi-local-dhv fingerprint | create | delete     (run by Nomad)
    csi-local-dhv install --plugin-dir DIR --volume-group VG --thin-pool POOL

Nomad runs the plugin with an empty environment plus DHV_* variables and
gives fingerprint one second, so that path imports nothing but this module:
the LVM, file-system and locking code is imported inside create/delete.
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
        return _install(args[2:])
    if op in ("create", "delete"):
        return _operate(op, argv0)
    if op in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    return _fail(f"unknown operation {op!r}; expected fingerprint, create or delete")


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
    logging.getLogger("sh").setLevel(logging.WARNING)


def _operate(op: str, argv0: str) -> int:
    _setup_logging()
    try:
        from csi_local.dhv_spec import load_config, ok_json, parse_request

        req = parse_request(op, os.environ, argv0)
        config = load_config(req.plugin_dir, argv0)
        from csi_local.dhv_ops import Plugin

        plugin = Plugin(config)
        if op == "create":
            path, size = plugin.create(req)
            out = ok_json(path, size)
        else:
            plugin.delete(req)
            out = "{}"
    except Exception as exc:
        return _fail(_message(exc))
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
    return 0


def _message(exc: Exception) -> str:
    from csi_local.dhv_spec import DhvError

    if isinstance(exc, DhvError):
        return str(exc)
    message = getattr(exc, "message", None)  # CsiError (CommandError, Aborted, ...)
    if isinstance(message, str) and message:
        return message
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"


# install -----------------------------------------------------------------------

SHIM = """\
#!{python} -I
# Nomad dynamic host volume plugin "{plugin_id}", written by `csi-local-dhv install`.
# Configuration: {plugin_id}.json in this directory. -I: ignore the environment
# and keep this directory off sys.path.
import sys

from csi_local.dhv import main

sys.exit(main())
"""


def shim_text(python: str, plugin_id: str) -> str:
    from csi_local.dhv_spec import DhvError

    if not os.path.isabs(python) or any(c.isspace() for c in python) or len(python) > 200:
        raise DhvError(f"interpreter path {python!r} cannot go in a #! line")
    return SHIM.format(python=python, plugin_id=plugin_id)


def _install(args: list[str]) -> int:
    import argparse
    import json

    from csi_local.dhv_spec import (
        DEFAULT_LOCK_DIR,
        DEFAULT_TIMEOUT,
        FS_TYPES,
        PLUGIN_ID,
        DhvError,
        PluginConfig,
        parse_size,
    )

    parser = argparse.ArgumentParser(
        prog="csi-local-dhv install",
        description="Write the plugin executable and its configuration into Nomad's "
        "host volume plugin directory (client host_volume_plugin_dir).",
    )
    parser.add_argument("--plugin-dir", required=True, help="Nomad's host_volume_plugin_dir")
    parser.add_argument("--volume-group", required=True)
    parser.add_argument("--thin-pool", required=True)
    parser.add_argument("--fs-type", default="ext4", choices=FS_TYPES,
                        help="file system when a volume's parameters name none")
    parser.add_argument("--lock-dir", default=DEFAULT_LOCK_DIR,
                        help="must be the CSI plugin's --lock-dir when both share a pool")
    parser.add_argument("--overprovision-ratio", type=float, default=1.0)
    parser.add_argument("--default-size", default="1GiB",
                        help="size when a volume sets no capacity_min/capacity_max")
    parser.add_argument("--timeout-seconds", type=float, default=DEFAULT_TIMEOUT)
    parser.add_argument("--plugin-id", default=PLUGIN_ID,
                        help="executable name, the volume spec's plugin_id")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter that has csi-local installed (default: this one)")
    ns = parser.parse_args(args)
    try:
        plugin_dir = os.path.abspath(ns.plugin_dir)
        if not ns.plugin_id or "/" in ns.plugin_id or ns.plugin_id.startswith("."):
            raise DhvError(f"invalid plugin id {ns.plugin_id!r}")
        config = PluginConfig(
            volume_group=ns.volume_group,
            thin_pool=ns.thin_pool,
            fs_type=ns.fs_type,
            lock_dir=ns.lock_dir,
            overprovision_ratio=ns.overprovision_ratio,
            default_size=parse_size(ns.default_size),
            timeout_seconds=ns.timeout_seconds,
        )
        shim = shim_text(ns.python, ns.plugin_id)
    except DhvError as err:
        parser.error(str(err))
    os.makedirs(plugin_dir, mode=0o755, exist_ok=True)
    exe = os.path.join(plugin_dir, ns.plugin_id)
    conf = exe + ".json"
    _write(conf, json.dumps(config.to_json(), indent=2) + "\n", 0o644)
    _write(exe, shim, 0o755)
    sys.stdout.write(json.dumps({"plugin": exe, "config": conf}) + "\n")
    return 0


def _write(path: str, text: str, mode: int) -> None:
    from csi_local.state import write_atomic

    write_atomic(path, text, mode)
