"""Command line: `csi-local serve|probe|status|doctor`, flags with environment fallbacks."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence

from csi_local import __version__
from csi_local.config import (
    DEFAULT_CERT_WARNING_DAYS,
    DEFAULT_DRIVER_NAME,
    DEFAULT_ENDPOINT,
    DEFAULT_FREEZE_LIMIT,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_SNAPSHOT_METADATA_ADDRESS,
    DEFAULT_STATE_DIR,
    Config,
    ConfigError,
    absolute_path,
    parse_listen_address,
    parse_size,
    seconds,
    socket_path,
)
from csi_local.host.filesystem_rules import SUPPORTED_FS as FS_TYPES
from csi_local.host.locks import DEFAULT_LOCK_DIR
from csi_local.logs import LOG_FORMATS, LOG_LEVELS, setup_logging
from csi_local.volumes.device_classes import load_classes


class _EnvDefault(argparse.Action):
    """An option whose default comes from an environment variable.

    The variable's value becomes the option's default. argparse passes a
    string default through the option's `type` when the flag is absent, so
    every option that restricts its values does so with a `type` (never with
    `choices` alone, which argparse checks on the command line only): a bad
    environment value then fails at start-up with the flag's own message.
    """

    def __init__(self, env: str, required: bool = False, default: object = None,
                 **kwargs: object) -> None:
        if env in os.environ:
            default = os.environ[env]
            required = False
        help_text = str(kwargs.pop("help", ""))
        kwargs["help"] = f"{help_text} [env {env}]"
        super().__init__(default=default, required=required, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _one_of(*names: str) -> Callable[[str], str]:
    """A `type` accepting only `names`: see _EnvDefault for why not `choices`."""

    def check(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(names)})")
        return text

    return check


def _size(text: str) -> int | None:
    """Bytes from "4G" and the like; empty means unset, as it always did."""
    if not text.strip():
        return None
    try:
        return parse_size(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="csi-local",
        description="CSI plugin for node-local block storage on LVM thin pools.",
    )
    parser.add_argument("--version", action="version", version=f"csi-local {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve Identity, Controller and Node on a unix socket")
    e = serve.add_argument
    e("--endpoint", action=_EnvDefault, env="CSI_ENDPOINT", default=DEFAULT_ENDPOINT,
      help="unix:///path/to/csi.sock")
    e("--node-id", action=_EnvDefault, env="NODE_ID", required=True,
      help="this node's name, as the CO knows it")
    e("--volume-group", action=_EnvDefault, env="CSI_LOCAL_VOLUME_GROUP", default="",
      help="LVM volume group holding the thin pool (one device class, named default)")
    e("--thin-pool", action=_EnvDefault, env="CSI_LOCAL_THIN_POOL", default="",
      help="thin pool LV in that group")
    e("--config", action=_EnvDefault, env="CSI_LOCAL_CONFIG", default="",
      help="TOML file of device classes (several thin pools), instead of --volume-group "
      "and --thin-pool; see docs/device-classes.md")
    e("--state-dir", action=_EnvDefault, env="CSI_LOCAL_STATE_DIR", default=DEFAULT_STATE_DIR,
      help="directory of the node state file")
    e("--driver-name", action=_EnvDefault, env="CSI_LOCAL_DRIVER_NAME",
      default=DEFAULT_DRIVER_NAME, help="CSI driver name (domain-name notation)")
    # `choices` as well as the `type`: it shows the values in --help.
    e("--log-level", action=_EnvDefault, env="CSI_LOCAL_LOG_LEVEL", default="info",
      type=_one_of(*LOG_LEVELS), choices=LOG_LEVELS, help="log level")
    e("--log-format", action=_EnvDefault, env="CSI_LOCAL_LOG_FORMAT", default="text",
      type=_one_of(*LOG_FORMATS), choices=LOG_FORMATS, help="log format")
    e("--overprovision-ratio", action=_EnvDefault, env="CSI_LOCAL_OVERPROVISION_RATIO",
      default="1.0", type=float, help="thin over-provisioning ratio: provisioned sizes may "
      "add up to this times the pool size")
    e("--max-volumes-per-node", action=_EnvDefault, env="CSI_LOCAL_MAX_VOLUMES_PER_NODE",
      default="0", type=int, help="reported to the CO by NodeGetInfo; 0 means no limit")
    e("--default-fs-type", action=_EnvDefault, env="CSI_LOCAL_DEFAULT_FS_TYPE", default="ext4",
      type=_one_of(*FS_TYPES), choices=FS_TYPES,
      help="file system when the request names none")
    e("--node-expansion-only", action=_EnvDefault, env="CSI_LOCAL_NODE_EXPANSION_ONLY",
      nargs="?", const=True, default="false", type=_bool,
      help="do not advertise controller expansion; NodeExpandVolume grows LV and file system")
    e("--command-timeout", action=_EnvDefault, env="CSI_LOCAL_COMMAND_TIMEOUT", default="120",
      type=float, help="seconds before an external command is killed")
    e("--group-freeze-timeout", action=_EnvDefault, env="CSI_LOCAL_GROUP_FREEZE_TIMEOUT",
      default=f"{DEFAULT_FREEZE_LIMIT:g}", type=float,
      help="seconds a snapshot may keep file systems frozen (a group's members, an encrypted "
      "source); past it they are thawed and the snapshot fails (UNAVAILABLE), leaving none")
    e("--lvm-shell", action=_EnvDefault, env="CSI_LOCAL_LVM_SHELL", nargs="?", const=True,
      default="true", type=_bool,
      help="run lvcreate, lvremove, lvextend and lvchange in one lvm shell kept running, "
      "which reads the command profile csi-local-shell.profile that csi-local writes in "
      "LVM's profile directory (false: one process per command)")
    e("--lock-dir", action=_EnvDefault, env="CSI_LOCAL_LOCK_DIR", default=DEFAULT_LOCK_DIR,
      help="directory of per-volume lock files, shared with csi-local-dhv")
    e("--pool-data-limit-percent", action=_EnvDefault, env="CSI_LOCAL_POOL_DATA_LIMIT_PERCENT",
      default="90", type=float, help="refuse new volumes and snapshots while the thin pool's "
      "data is at least this full, and report volumes abnormal")
    e("--pool-metadata-limit-percent", action=_EnvDefault,
      env="CSI_LOCAL_POOL_METADATA_LIMIT_PERCENT", default="90", type=float,
      help="the same for the thin pool's metadata")
    e("--pool-autoextend-threshold-percent", action=_EnvDefault,
      env="CSI_LOCAL_POOL_AUTOEXTEND_THRESHOLD_PERCENT", default="0", type=float,
      help="grow the thin pool from the VG's free space when its data or metadata is this "
      "full (0: never; must be below the limits)")
    e("--pool-autoextend-percent", action=_EnvDefault, env="CSI_LOCAL_POOL_AUTOEXTEND_PERCENT",
      default="20", type=float, help="grow by this share of the current size")
    e("--pool-monitor-interval", action=_EnvDefault, env="CSI_LOCAL_POOL_MONITOR_INTERVAL",
      default="10", type=float, help="seconds between the pool monitor's readings")
    e("--shutdown-grace", action=_EnvDefault, env="CSI_LOCAL_SHUTDOWN_GRACE",
      default=f"{DEFAULT_SHUTDOWN_GRACE:g}", type=float,
      help="seconds the RPCs still running at SIGTERM may take before the plugin stops; "
      "keep it below the CO's kill timeout (Nomad's kill_timeout, Kubernetes' "
      "terminationGracePeriodSeconds)")
    e("--modify-validate-only", action=_EnvDefault, env="CSI_LOCAL_MODIFY_VALIDATE_ONLY",
      nargs="?", const=True, default="false", type=_bool,
      help="ControllerModifyVolume validates and records nothing (the central csi-resizer's "
      "copy, which reaches no node's LVM); each node plugin applies the volume's "
      "VolumeAttributesClass itself")
    e("--qos-reconcile-interval", action=_EnvDefault, env="CSI_LOCAL_QOS_RECONCILE_INTERVAL",
      default="10", type=float,
      help="seconds between rereads of the published volumes' IO limits: the longest a "
      "change takes to reach the workloads' io.max")
    e("--cgroup-root", action=_EnvDefault, env="CSI_LOCAL_CGROUP_ROOT",
      default="/sys/fs/cgroup", help="where the host's cgroup v2 hierarchy is mounted")
    e("--metrics-address", action=_EnvDefault, env="CSI_LOCAL_METRICS_ADDRESS", default="",
      help="serve Prometheus metrics at http://ADDRESS/metrics (host:port or :port); "
      "empty: off")
    e("--backing-file", action=_EnvDefault, env="CSI_LOCAL_BACKING_FILE",
      help="demo mode: create the VG and thin pool on this loop-backed file if missing")
    e("--backing-size", action=_EnvDefault, env="CSI_LOCAL_BACKING_SIZE", type=_size,
      help="size of the backing file, e.g. 2G")

    probe = sub.add_parser("probe", help="call Identity Probe on a running plugin")
    probe.add_argument("--endpoint", action=_EnvDefault, env="CSI_ENDPOINT",
                       default=DEFAULT_ENDPOINT, help="unix:///path/to/csi.sock")
    probe.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")
    vac = sub.add_parser("vac-sync", help="Kubernetes: carry the PVs' VolumeAttributesClasses "
                         "to the node plugin's volumes (ControllerModifyVolume on its socket)")
    vac.add_argument("--endpoint", action=_EnvDefault, env="CSI_ENDPOINT",
                     default=DEFAULT_ENDPOINT, help="the node plugin's socket")
    vac.add_argument("--driver-name", action=_EnvDefault, env="CSI_LOCAL_DRIVER_NAME",
                     default=DEFAULT_DRIVER_NAME, help="the PVs' CSI driver")
    vac.add_argument("--interval", action=_EnvDefault, env="CSI_LOCAL_VAC_SYNC_INTERVAL",
                     default="30", type=float, help="seconds between passes over the PVs")
    _add_status_and_doctor(sub)
    return parser


def _directory(what: str) -> Callable[[str], str]:
    """A `type` for status's and doctor's directories (and doctor's
    certificate file): serve's rule (config.absolute_path), so what serve
    refuses they refuse too."""

    def check(text: str) -> str:
        try:
            return absolute_path(text, what)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return check


def _endpoint(text: str) -> str:
    """serve's rule of the endpoint (config.socket_path), for doctor."""
    try:
        socket_path(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _host_port(text: str) -> str:
    """A TLS server's address as clients dial it: host:port, [v6]:port."""
    try:
        host, _ = parse_listen_address(text)
    except ConfigError:
        host = ""
    if not host:
        raise argparse.ArgumentTypeError(f"not host:port: {text!r}")
    return text


def _days(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a whole number of days: {text!r}")
    return int(text)


def _lvm_name(text: str) -> str:
    from csi_local.ops.status import lvm_name

    return lvm_name(text)


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 1.0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError("the over-provisioning ratio must be a number >= 1.0")
    return value


def _duration(text: str) -> float:
    from csi_local.ops.status import parse_duration

    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class _ClassSourceParser(argparse.ArgumentParser):
    """The parser of `status` and `doctor`: their node's device classes come
    from exactly one of --config and --volume-group with --thin-pool (flags
    or environment), checked once everything is parsed (exit 2 otherwise)."""

    def parse_known_args(  # type: ignore[override]
            self, args: Sequence[str] | None = None,
            namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        flags = {"--volume-group": parsed.volume_group, "--thin-pool": parsed.thin_pool}
        if parsed.config:
            if any(flags.values()):
                self.error("give either --config (CSI_LOCAL_CONFIG) or --volume-group and "
                           "--thin-pool (CSI_LOCAL_VOLUME_GROUP, CSI_LOCAL_THIN_POOL), not both")
        elif not all(flags.values()):
            missing = ", ".join(f for f, v in flags.items() if not v)
            self.error(f"the following arguments are required: {missing} (or --config FILE "
                       "with the node's device classes)")
        return parsed, extras


def _add_status_and_doctor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`status` and `doctor`: read-only, usable while the plugin is down."""
    # argparse takes the class of a subcommand's parser from the subparsers
    # action only: these two get one that checks where the classes come from.
    parser_class = sub._parser_class
    sub._parser_class = _ClassSourceParser
    try:
        status = sub.add_parser("status", help="volumes, snapshots, host volumes, pools and "
                                "possible orphans of this node, from LVM and the state file")
        doctor = sub.add_parser("doctor", help="check what this node needs; exit 1 on a "
                                "failure")
    finally:
        sub._parser_class = parser_class
    for p in (status, doctor):
        p.add_argument("--volume-group", action=_EnvDefault, env="CSI_LOCAL_VOLUME_GROUP",
                       type=_lvm_name, help="LVM volume group (one device class, named "
                       "default; or --config)")
        p.add_argument("--thin-pool", action=_EnvDefault, env="CSI_LOCAL_THIN_POOL",
                       type=_lvm_name, help="thin pool LV in that group")
        p.add_argument("--config", action=_EnvDefault, env="CSI_LOCAL_CONFIG",
                       help="TOML file of the node's device classes, as serve's, instead of "
                       "--volume-group and --thin-pool")
        p.add_argument("--state-dir", action=_EnvDefault, env="CSI_LOCAL_STATE_DIR",
                       default=DEFAULT_STATE_DIR, type=_directory("the state directory"),
                       help="directory of the node state file")
        p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.add_argument("--overprovision-ratio", action=_EnvDefault,
                        env="CSI_LOCAL_OVERPROVISION_RATIO", default="1.0", type=_ratio,
                        help="as serve's: for the room left for new volumes (with --config: "
                        "of the classes that set no ratio)")
    status.add_argument("--orphan-age", default="1h", type=_duration,
                        help="a CSI volume neither staged nor published and older than this "
                        "is a possible orphan (90s, 30m, 1h, 2d)")
    status.add_argument("--cgroup-root", action=_EnvDefault, env="CSI_LOCAL_CGROUP_ROOT",
                        default="/sys/fs/cgroup",
                        help="as serve's: where the published volumes' IO limits are read")
    doctor.add_argument("--lock-dir", action=_EnvDefault, env="CSI_LOCAL_LOCK_DIR",
                        default=DEFAULT_LOCK_DIR, type=_directory("the lock directory"),
                        help="directory of the lock files")
    doctor.add_argument("--endpoint", action=_EnvDefault, env="CSI_ENDPOINT",
                        default=DEFAULT_ENDPOINT, type=_endpoint,
                        help="the plugin's unix:///path/to/csi.sock")
    doctor.add_argument("--host-lvm-dir", action=_EnvDefault, env="CSI_LOCAL_HOST_LVM_DIR",
                        type=_directory("the host's LVM directory"),
                        help="the host's /etc/lvm as mounted in the plugin's container: "
                        "doctor compares the devices and VGs its LVM sees with the host's")
    doctor.add_argument("--snapshot-metadata-tls-cert", action=_EnvDefault,
                        env="CSI_LOCAL_SNAPSHOT_METADATA_TLS_CERT",
                        type=_directory("the snapshot-metadata TLS certificate"),
                        help="the snapshot-metadata sidecar's certificate (PEM, the Secret's "
                        "tls.crt) as mounted here: doctor checks it is there and not expiring")
    doctor.add_argument("--snapshot-metadata-address", action=_EnvDefault,
                        env="CSI_LOCAL_SNAPSHOT_METADATA_ADDRESS",
                        default=DEFAULT_SNAPSHOT_METADATA_ADDRESS, type=_host_port,
                        help="the SnapshotMetadataService's spec.address (host:port): doctor "
                        "checks the certificate is for its host")
    doctor.add_argument("--tls-cert-warning-days", action=_EnvDefault,
                        env="CSI_LOCAL_TLS_CERT_WARNING_DAYS",
                        default=str(DEFAULT_CERT_WARNING_DAYS), type=_days,
                        help="warn when the certificate expires within this many days")


def config_from_args(args: argparse.Namespace) -> Config:
    try:
        classes = None
        if args.config:
            classes = load_classes(args.config,
                                   overprovision_ratio=float(args.overprovision_ratio),
                                   default_fs_type=args.default_fs_type)
        return Config(
            endpoint=args.endpoint,
            node_id=args.node_id,
            volume_group=args.volume_group,
            thin_pool=args.thin_pool,
            device_classes=classes,
            state_dir=args.state_dir,
            driver_name=args.driver_name,
            overprovision_ratio=float(args.overprovision_ratio),
            max_volumes_per_node=int(args.max_volumes_per_node),
            default_fs_type=args.default_fs_type,
            node_expansion_only=_bool(args.node_expansion_only),
            command_timeout=float(args.command_timeout),
            group_freeze_timeout=float(args.group_freeze_timeout),
            lvm_shell=_bool(args.lvm_shell),
            lock_dir=args.lock_dir,
            pool_data_limit_percent=float(args.pool_data_limit_percent),
            pool_metadata_limit_percent=float(args.pool_metadata_limit_percent),
            pool_autoextend_threshold_percent=float(args.pool_autoextend_threshold_percent),
            pool_autoextend_percent=float(args.pool_autoextend_percent),
            pool_monitor_interval=float(args.pool_monitor_interval),
            shutdown_grace=float(args.shutdown_grace),
            metrics_address=args.metrics_address,
            modify_validate_only=_bool(args.modify_validate_only),
            qos_reconcile_interval=float(args.qos_reconcile_interval),
            cgroup_root=args.cgroup_root,
            backing_file=args.backing_file,
            backing_size=(_size(args.backing_size) if isinstance(args.backing_size, str)
                          else args.backing_size),
        )
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise ConfigError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "probe":
        from csi_local.csi.probe import probe

        return probe(args.endpoint, args.timeout)
    if args.command == "vac-sync":
        from csi_local.csi.vac_sync import InClusterApi, VacSync, socket_modify

        setup_logging("info", "json")
        try:
            seconds(args.interval, "the interval")
        except ConfigError as err:
            parser.error(str(err))
        VacSync(InClusterApi.from_environment(), args.driver_name,
                socket_modify(args.endpoint), args.interval).run()
        return 0
    if args.command == "status":
        from csi_local.ops import status

        return status.main(args)
    if args.command == "doctor":
        from csi_local.ops import doctor

        return doctor.main(args)
    try:
        config = config_from_args(args)
    except ConfigError as err:
        parser.error(str(err))
    from csi_local.csi.server import ServerError, serve
    from csi_local.host.crypt import forbid_core_dumps

    forbid_core_dumps()  # before any key arrives
    setup_logging(args.log_level, args.log_format)
    try:
        serve(config)
    except ServerError as err:
        logging.getLogger("csi_local").error("%s", err)
        print(f"csi-local: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
