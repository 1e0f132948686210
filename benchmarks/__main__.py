"""`python -m benchmarks`: run the bench (as root, with device-mapper: in the
test VM, `scripts/vm-run -- python -m benchmarks`) and print its tables."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from benchmarks.report import format_tables
from benchmarks.runner import Options, run_bench


def _scales(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("volume counts must be positive")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Time csi-local's RPCs against the raw LVM, mkfs and mount commands on a "
        "loop-backed VG of its own (root and device-mapper needed: run it in the test VM, "
        "scripts/vm-run -- python -m benchmarks). Prints figures and ratios; asserts nothing.")
    parser.add_argument("--scale", type=_scales, default=[10, 100],
                        help="volume counts for ListVolumes, GetCapacity, RSS and start-up "
                        "(default 10,100)")
    parser.add_argument("--large", action="store_true",
                        help="add 1,000 volumes to the scales (slow under emulation: about "
                        "25 minutes more)")
    parser.add_argument("--huge", action="store_true",
                        help="add 1,000 and 5,000 volumes to the scales (about an hour more "
                        "under emulation; give the VM 4G of memory)")
    parser.add_argument("--scale-only", action="store_true",
                        help="only the scale cases (with the idle cost and imports): no "
                        "latency, exec count, concurrency or storm sections")
    parser.add_argument("--idle-at", type=_positive, default=None,
                        help="measure the idle cost at this scale (one of --scale; default: "
                        "the largest)")
    parser.add_argument("--first-list-delay", type=float, default=0.0, metavar="SECONDS",
                        help="seconds between each scale point's last start and its first "
                        "ListVolumes (default 0: at once, before the plugin's background "
                        "parse of the VG can end)")
    parser.add_argument("--rounds", type=_positive, default=5,
                        help="rounds per latency figure; the median is shown (default 5)")
    parser.add_argument("--qos-rounds", type=int, default=5,
                        help="publishes into a pod's cgroup with and without IO limits, "
                             "each (0: no IO limits section)")
    parser.add_argument("--encryption-rounds", type=int, default=3,
                        help="rounds of the encrypted volume section: stage, publish and dd "
                        "throughput beside the bare cryptsetup commands and a plain volume "
                        "(default 3; 0: none)")
    parser.add_argument("--concurrency", type=_positive, default=20,
                        help="concurrent CreateVolume calls (default 20)")
    parser.add_argument("--startup-rounds", type=_positive, default=None,
                        help="plugin starts per scale (default: rounds, at most 3)")
    parser.add_argument("--storm", type=int, default=50,
                        help="PVCs in the pod storm, created, staged and published at once, "
                        "then as many more while those are torn down (default 50; 0: none)")
    parser.add_argument("--storm-workers", type=_positive, default=10,
                        help="concurrent CreateVolume/DeleteVolume calls in the storm: "
                        "external-provisioner's --worker-threads in deploy/ (default 10)")
    parser.add_argument("--storm-slowest", type=int, default=0, metavar="N",
                        help="print the storm's N slowest CreateVolume calls, each with the "
                        "plugin's breakdown of its time (needs the plugin's debug log: add "
                        "-- --log-level debug)")
    parser.add_argument("--storm-no-bare", action="store_true",
                        help="the storm's plugin side alone, without the bare commands' (to "
                        "look at the plugin's times; no ratios)")
    parser.add_argument("--idle-seconds", type=float, default=300.0,
                        help="seconds to count the programs an idle plugin starts, in each "
                        "of three cases (default 300; 0: none)")
    parser.add_argument("--scrape-interval", type=float, default=15.0,
                        help="seconds between metrics scrapes in the idle case (default 15)")
    parser.add_argument("--json", metavar="FILE",
                        help="also write every figure and sample as JSON to FILE ('-': "
                        "stdout). In the VM the host's file systems are read-only: use "
                        "a path under /run or /tmp there, or '-'")
    parser.add_argument("--cbt-parse", action="store_true",
                        help="only changed-block tracking's read of 1,000,000 thin_dump "
                        "mappings, the old whole-document parse against the stream, on the "
                        "host: no root, no LVM (python -m benchmarks.cbt_parse --help for "
                        "its options)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("plugin_args", nargs="*", metavar="-- SERVE-FLAG",
                        help="extra flags for csi-local serve, after --")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cbt_parse:
        from benchmarks import cbt_parse

        return cbt_parse.main((["--quiet"] if args.quiet else [])
                              + (["--json", args.json] if args.json else []))
    if os.geteuid() != 0:
        print("benchmarks: needs root and device-mapper (run it in the VM: "
              "scripts/vm-run -- python -m benchmarks)", file=sys.stderr)
        return 2
    scales = sorted(set(args.scale + ([1000] if args.large else [])
                        + ([1000, 5000] if args.huge else [])))

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the clean-up

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    opts = Options(
        scales=scales, rounds=args.rounds, concurrency=args.concurrency,
        startup_rounds=args.startup_rounds or min(args.rounds, 3),
        import_rounds=min(args.rounds, 3), plugin_args=list(args.plugin_args),
        storm=max(0, args.storm), storm_workers=args.storm_workers,
        storm_slowest=max(0, args.storm_slowest), storm_bare=not args.storm_no_bare,
        idle_seconds=max(0.0, args.idle_seconds), scrape_interval=args.scrape_interval,
        idle_at=args.idle_at, scale_only=args.scale_only,
        encryption_rounds=max(0, args.encryption_rounds),
        qos_rounds=max(0, args.qos_rounds),
        first_list_delay=max(0.0, args.first_list_delay),
        progress=None if args.quiet else (lambda s: print(f"bench: {s}", file=sys.stderr,
                                                           flush=True)),
    )
    res = run_bench(opts)
    text = format_tables(res, markdown=args.markdown)
    print(text, flush=True)
    if args.json == "-":
        print(res.dump())
    elif args.json:
        with open(args.json, "w") as f:
            f.write(res.dump() + "\n")
    missing = res.missing()
    if missing:
        print(f"benchmarks: figures missing: {', '.join(missing)}", file=sys.stderr)
    return 1 if res.errors or missing else 0


if __name__ == "__main__":
    sys.exit(main())
