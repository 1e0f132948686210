"""``python -m sanity --endpoint unix:///run/csi.sock [options] [-- pytest options]``."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from sanity import SUITE_DIR, TESTS_DIR
from sanity.csi import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sanity",
        description="CSI v1.12.0 conformance suite. Tests only what the plugin advertises; "
        "exits non-zero when any test fails. Unknown options are passed to pytest "
        "(e.g. -k EXPR, -x, -v).",
    )
    p.add_argument("--endpoint", required=True, help="CSI endpoint, e.g. unix:///run/csi.sock")
    p.add_argument("--controller-endpoint", default="",
                   help="separate Controller service endpoint (default: --endpoint)")
    p.add_argument("--staging-dir", default="",
                   help="directory for staging paths (default: fresh temp dir, removed after)")
    p.add_argument("--mount-dir", default="",
                   help="directory for target paths (default: fresh temp dir, removed after)")
    p.add_argument("--volume-size", default="64M", help="test volume size (bytes, K/M/G suffix)")
    p.add_argument("--expand-size", default="",
                   help="expansion size (bytes, K/M/G suffix; default twice --volume-size)")
    p.add_argument("--access-type", choices=["mount", "block"], default="mount")
    p.add_argument("--fs-type", default="ext4")
    p.add_argument("--volume-parameters", default="", metavar="FILE",
                   help="YAML mapping of CreateVolume parameters")
    p.add_argument("--snapshot-parameters", default="", metavar="FILE",
                   help="YAML mapping of CreateSnapshot parameters")
    p.add_argument("--volume-mutable-parameters", default="", metavar="FILE",
                   help="YAML mapping of mutable parameters (CreateVolume's "
                   "mutable_parameters, ControllerModifyVolume); without it the "
                   "ModifyVolume specs that need them skip")
    p.add_argument("--idempotency-repeats", type=int, default=3, metavar="N")
    p.add_argument("--rpc-timeout", type=float, default=120.0, metavar="SECONDS")
    p.add_argument("--cbt-granularity", default="1M", metavar="SIZE",
                   help="how far a changed-block range may reach beyond the changed bytes: "
                   "the plugin's block or chunk size, or larger (default 1M)")
    p.add_argument("--junit-xml", default="", metavar="FILE", help="write a JUnit XML report")
    return p


def pytest_args(ns: argparse.Namespace, extra: list[str]) -> list[str]:
    args = [
        str(TESTS_DIR),
        "-p", "sanity.plugin",
        "-p", "no:cacheprovider",
        "-c", "/dev/null",  # no ini file: the project's pytest settings do not apply
        "--rootdir", str(SUITE_DIR),
        "--confcutdir", str(SUITE_DIR),  # no conftest.py outside the suite is loaded
        "-o", "junit_family=xunit2",
        "-o", "junit_suite_name=csi-sanity",
        "--endpoint", ns.endpoint,
        "--volume-size", ns.volume_size,
        "--access-type", ns.access_type,
        "--fs-type", ns.fs_type,
        "--idempotency-repeats", str(ns.idempotency_repeats),
        "--rpc-timeout", str(ns.rpc_timeout),
        "--cbt-granularity", ns.cbt_granularity,
    ]
    for flag, value in (
        ("--controller-endpoint", ns.controller_endpoint),
        ("--staging-dir", ns.staging_dir),
        ("--mount-dir", ns.mount_dir),
        ("--expand-size", ns.expand_size),
        ("--volume-parameters", ns.volume_parameters),
        ("--snapshot-parameters", ns.snapshot_parameters),
        ("--volume-mutable-parameters", ns.volume_mutable_parameters),
        ("--junit-xml", ns.junit_xml),
    ):
        if value:
            args += [flag, value]
    return args + extra


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        parse_size(ns.volume_size)
        if ns.expand_size:
            parse_size(ns.expand_size)
        parse_size(ns.cbt_granularity)
    except ValueError as err:
        parser.error(str(err))
    if ns.idempotency_repeats < 2:
        parser.error("--idempotency-repeats must be at least 2")
    # Third-party pytest plugins (hypothesis, ...) are not needed and can take seconds to
    # import; export PYTEST_DISABLE_PLUGIN_AUTOLOAD= (empty) to keep them.
    os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return int(pytest.main(pytest_args(ns, extra)))


if __name__ == "__main__":
    sys.exit(main())
