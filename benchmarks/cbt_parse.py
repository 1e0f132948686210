"""Changed-block tracking's read of a thin pool's mappings, old against new,
on the host (no root, no LVM: only the parse is measured).

A synthetic `thin_dump` or `thin_delta` document of N fragmented mappings
(by default 1,000,000; runs a chunk or more apart, so that nothing merges) is
written to a file and served by a fake tool, a script named `thin_dump` or
`thin_delta` that prints the file, first on PATH. Each way of reading it runs
in a process of its own, which notes its resident memory once imported, reads
the mapping as the plugin does and makes every byte extent, and reports its
peak resident memory (VmHWM) and its time:

- old: the plugin before the stream, kept here only to compare: the tool's
  whole output from `Runner.run`, `ElementTree.fromstring`, a `Run` per
  mapping, sorted and merged, a tuple of `Extent`s;
- new: `ThinMetadata.allocated` (or `delta`), the tool's output parsed as it
  is read (`Runner.stream`), runs merged as they come, then
  `BlockMap.starting_at(0)`;
- raw: the fake tool's output read and dropped, for the floor.

Both give the same extents (checked). Figures: peak resident memory over the
process's idle memory (VmHWM - VmRSS before the read), and time per mapping.

`python -m benchmarks.cbt_parse [--mappings N] [--tool thin_dump|thin_delta]`
(also `python -m benchmarks --cbt-parse`). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20
DEV_ID = 7
CHUNK_SECTORS = 128  # 64 KiB chunks
CAPACITY = 1 << 50  # far past the last mapping: no extent is cut
GOAL_BYTES = 50 * MiB  # the ceiling for 1,000,000 mappings, over idle
_CHANGED = ("different", "left_only", "right_only")
_DELTA_KINDS = ("same", *_CHANGED)


# The document ------------------------------------------------------------

def write_document(path: Path, tool: str, mappings: int, seed: int = 1) -> None:
    """`mappings` fragmented mappings as `tool` prints them: runs one to three
    chunks apart; thin_dump's mostly single, every fifth a range; thin_delta's
    of its four kinds ("same" ones are not changes)."""
    rng = random.Random(seed)  # noqa: S311 (a reproducible document)
    with open(path, "w", encoding="ascii") as f:
        f.write('<superblock uuid="" time="1" transaction="7" flags="0" version="2" '
                f'data_block_size="{CHUNK_SECTORS}" nr_data_blocks="{4 * mappings}">\n')
        f.write(f'  <device dev_id="{DEV_ID}" mapped_blocks="{mappings}" transaction="1" '
                'creation_time="1" snap_time="1">\n' if tool == "thin_dump"
                else f'  <diff left="{DEV_ID}" right="{DEV_ID + 1}">\n')
        block = data = 0
        lines = []
        for i in range(mappings):
            block += rng.randint(1, 3)  # a gap of at least one chunk: nothing merges
            length = rng.randint(2, 9) if i % 5 == 4 else 1
            if tool == "thin_dump":
                lines.append(
                    f'    <range_mapping origin_begin="{block}" data_begin="{data}" '
                    f'length="{length}" time="0"/>\n' if length > 1 else
                    f'    <single_mapping origin_block="{block}" data_block="{data}" '
                    'time="0"/>\n')
            else:
                kind = _DELTA_KINDS[rng.randrange(4)]
                lines.append(f'    <{kind} begin="{block}" length="{length}"/>\n')
            block += length
            data += length + rng.randint(0, 2)
            if len(lines) >= 10000:
                f.write("".join(lines))
                lines.clear()
        f.write("".join(lines))
        f.write("  </device>\n" if tool == "thin_dump" else "  </diff>\n")
        f.write("</superblock>\n")


def fake_tool(directory: Path, tool: str, document: Path) -> None:
    """A `tool` in `directory` that prints `document`, whatever its arguments."""
    exe = directory / tool
    exe.write_text(f"#!/bin/sh\nexec cat '{document}'\n", encoding="utf-8")
    exe.chmod(0o755)


# The old read, as the plugin did it before the stream (only to compare) --

def old_parse(xml: str, tool: str, dev_id: int = DEV_ID) -> tuple[int, list[tuple[int, int]]]:
    """(chunk size in bytes, merged (begin, length) runs): the whole-document
    parse of thin_mappings.parse_dump / parse_delta before the stream."""
    root = ET.fromstring(xml)  # noqa: S314 (the bench's own document)
    if root.tag != "superblock":
        raise ValueError(f"{tool} printed <{root.tag}>, not <superblock>")
    runs: list[tuple[int, int]] = []
    if tool == "thin_dump":
        device = next((d for d in root.iter("device") if d.get("dev_id") == str(dev_id)),
                      None)
        if device is None:
            raise ValueError(f"thin device {dev_id} is not in the pool's metadata")
        for m in device:
            if m.tag == "single_mapping":
                runs.append((int(m.get("origin_block", "0")), 1))
            elif m.tag == "range_mapping":
                runs.append((int(m.get("origin_begin", "0")), int(m.get("length", "0"))))
    else:
        runs = [(int(e.get("begin", "0")), int(e.get("length", "0")))
                for diff in root.iter("diff") for e in diff if e.tag in _CHANGED]
    sectors = int(root.get("data_block_size", "0"))
    if sectors <= 0:
        raise ValueError(f"{tool}: no data_block_size in its superblock")
    return sectors * 512, old_merge(runs)


def old_merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """thin_mappings.merge before the stream, on (begin, length) pairs."""
    out: list[tuple[int, int]] = []
    for begin, length in sorted(runs, key=lambda r: r[0]):
        if length <= 0:
            continue
        if out and begin <= out[-1][0] + out[-1][1]:
            last = out[-1]
            end = max(last[0] + last[1], begin + length)
            out[-1] = (last[0], end - last[0])
        else:
            out.append((begin, length))
    return out


def _old_read(tool: str) -> tuple[int, int]:
    """The old path: run() holds the output, the tree, a Run each, the extents."""
    from csi_local.host.runner import ProcessRunner
    from csi_local.storage.thin_mappings import Run
    from csi_local.volumes.changed_blocks import Extent

    xml = ProcessRunner().run([tool]).stdout
    chunk, pairs = old_parse(xml, tool)
    runs = tuple(Run(b, n) for b, n in pairs)  # the old Mapping's tuple
    extents = tuple(Extent(r.begin * chunk, min((r.begin + r.length) * chunk, CAPACITY)
                           - r.begin * chunk) for r in runs)
    return len(extents), _digest((e.offset, e.length) for e in extents)


def _new_read(tool: str, state_dir: str) -> tuple[int, int]:
    """The plugin's path now: ThinMetadata over the real runner, BlockMap."""
    from csi_local.host.kernel import Kernel
    from csi_local.host.runner import ProcessRunner
    from csi_local.storage.thin_mappings import ThinMetadata
    from csi_local.volumes.changed_blocks import BlockMap

    meta = ThinMetadata(ProcessRunner(), Kernel(), "vg", "pool", state_dir)
    mapping = meta.allocated(DEV_ID) if tool == "thin_dump" else meta.delta(DEV_ID, DEV_ID + 1)
    extents = BlockMap(CAPACITY, mapping).starting_at(0)
    count = [0]

    def pairs() -> Any:
        for e in extents:
            count[0] += 1
            yield e.offset, e.length

    digest = _digest(pairs())
    return count[0], digest


def _raw_read(tool: str) -> tuple[int, int]:
    from csi_local.host.runner import ProcessRunner

    with ProcessRunner().stream([tool]) as out:
        while out.read(1 << 16):
            pass
    return 0, 0


def _digest(pairs: Any) -> int:
    h = 0
    for offset, length in pairs:
        h = (h * 1_000_003 + offset * 31 + length) & 0xFFFFFFFFFFFF
    return h


def _status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def child(way: str, tool: str, state_dir: str) -> dict[str, Any]:
    """In the measuring process: imports first, then the idle memory, the read."""
    import csi_local.host.runner
    import csi_local.storage.thin_mappings
    import csi_local.volumes.changed_blocks  # noqa: F401

    idle = _status("VmRSS")
    started = time.perf_counter()
    if way == "old":
        extents, digest = _old_read(tool)
    elif way == "new":
        extents, digest = _new_read(tool, state_dir)
    else:
        extents, digest = _raw_read(tool)
    seconds = time.perf_counter() - started
    return {"way": way, "idle": idle, "peak": _status("VmHWM"), "seconds": seconds,
            "extents": extents, "digest": digest}


# The bench -----------------------------------------------------------------

def measure(way: str, tool: str, tools: Path, state_dir: str) -> dict[str, Any]:
    env = dict(os.environ, PATH=f"{tools}:{os.environ.get('PATH', '')}")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cbt_parse", "--child", way, "--tool", tool,
         "--state-dir", state_dir],
        env=env, cwd=root, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    result["over_idle"] = result["peak"] - result["idle"]
    return result


def run_bench(mappings: int, tool: str, rounds: int, progress: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="csi-local-cbt-") as tmp:
        doc = Path(tmp, "mappings.xml")
        write_document(doc, tool, mappings)
        fake_tool(Path(tmp), tool, doc)
        results: dict[str, list[dict[str, Any]]] = {"raw": [], "old": [], "new": []}
        for i in range(rounds):
            for way in results:
                if progress:
                    print(f"cbt-parse: round {i + 1}/{rounds}, {way}", file=sys.stderr,
                          flush=True)
                results[way].append(measure(way, tool, Path(tmp), tmp))
        size = doc.stat().st_size
    best = {way: min(rs, key=lambda r: r["seconds"]) for way, rs in results.items()}
    peak = {way: max(r["over_idle"] for r in rs) for way, rs in results.items()}
    return {"mappings": mappings, "tool": tool, "document_bytes": size, "rounds": rounds,
            "best": best, "peak_over_idle": peak,
            "same_extents": best["old"]["digest"] == best["new"]["digest"]
            and best["old"]["extents"] == best["new"]["extents"], "samples": results}


def format_report(res: dict[str, Any]) -> str:
    n: int = res["mappings"]
    best, peak = res["best"], res["peak_over_idle"]

    def per(way: str) -> float:
        seconds: float = best[way]["seconds"]
        return seconds / n * 1e9

    lines = [
        f"changed-block read, {res['tool']}: {n:,} fragmented mappings "
        f"({res['document_bytes'] / MiB:.0f} MiB of XML), {best['new']['extents']:,} extents, "
        f"best of {res['rounds']} (time) / worst (memory)",
        f"{'':24}{'old':>12}{'new':>12}{'new/old':>10}{'raw read':>12}",
        f"{'peak RSS over idle':24}{peak['old'] / MiB:>8.1f} MiB{peak['new'] / MiB:>8.1f} MiB"
        f"{peak['new'] / max(peak['old'], 1):>9.2f}x{peak['raw'] / MiB:>8.1f} MiB",
        f"{'time per mapping':24}{per('old'):>9.0f} ns{per('new'):>9.0f} ns"
        f"{per('new') / per('old'):>9.2f}x{per('raw'):>9.0f} ns",
        f"{'whole read':24}{best['old']['seconds']:>10.2f} s{best['new']['seconds']:>10.2f} s"
        f"{'':>10}{best['raw']['seconds']:>10.2f} s",
        f"same extents: {'yes' if res['same_extents'] else 'NO'}; goal: new peak over idle "
        f"<= {GOAL_BYTES / MiB:.0f} MiB at 1,000,000 mappings "
        f"({'met' if peak['new'] <= GOAL_BYTES else 'not met'}), "
        f"time per mapping <= old ({'met' if per('new') <= per('old') else 'not met'})",
    ]
    return "\n".join(lines)


ABOUT = ("Changed-block tracking's read of thin_dump / thin_delta XML: the whole-document "
         "parse it replaced against the streamed one, on a synthetic document served by a "
         "fake tool. On the host only: no root, no LVM. Asserts nothing.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cbt_parse", description=ABOUT)
    parser.add_argument("--mappings", type=int, default=1_000_000,
                        help="fragmented mappings in the document (default 1,000,000)")
    parser.add_argument("--tool", choices=("thin_dump", "thin_delta"), default="thin_dump",
                        help="whose output to read (default thin_dump)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="processes per way of reading; the fastest is shown (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--child", choices=("old", "new", "raw"), help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", default="", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.tool, args.state_dir)))
        return 0
    res = run_bench(max(1, args.mappings), args.tool, max(1, args.rounds),
                    progress=not args.quiet)
    print(format_report(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0 if res["same_extents"] else 1


if __name__ == "__main__":
    sys.exit(main())
