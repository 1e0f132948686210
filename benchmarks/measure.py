"""What the bench counts besides time: the processes a running plugin starts
(strace), its resident memory, and Python's import costs."""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The LVM tools (every one is the `lvm` binary under another name) and lvm's helpers.
LVM_TOOLS = frozenset({
    "lvm", "lvcreate", "lvremove", "lvchange", "lvextend", "lvresize", "lvreduce", "lvrename",
    "lvconvert", "lvs", "lvdisplay", "lvscan", "vgs", "vgcreate", "vgchange", "vgremove",
    "vgextend", "vgreduce", "vgscan", "vgdisplay", "vgck", "pvs", "pvcreate", "pvremove",
    "pvscan", "pvdisplay", "pvchange", "lvmconfig", "lvmdevices", "dmsetup", "thin_check",
})


@dataclass
class ExecCount:
    """The programs started while a trace was on, by name."""

    programs: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def lvm(self) -> int:
        return sum(n for name, n in self.programs.items() if name in LVM_TOOLS)

    @property
    def other(self) -> int:
        return sum(n for name, n in self.programs.items() if name not in LVM_TOOLS)

    def names(self, lvm: bool) -> str:
        picked = sorted((name, n) for name, n in self.programs.items()
                        if (name in LVM_TOOLS) == lvm)
        return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in picked) or "-"


_EXEC_START = re.compile(r'^(\d+)\s+execve\("([^"]*)"')
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. execve resumed>")
_RESULT = re.compile(r"\)\s+=\s+(-?\d+)")


def parse_execs(text: str) -> ExecCount:
    """Successful execve calls in `strace -f -o FILE -e trace=execve` output
    (with pids), by the basename of the program run; failed attempts (a PATH
    search) do not count."""
    pending: dict[str, str] = {}
    count = ExecCount()

    def done(path: str, line: str) -> None:
        m = _RESULT.search(line)
        if m and m.group(1) == "0":
            count.programs[os.path.basename(path)] += 1

    for line in text.splitlines():
        if m := _EXEC_START.match(line):
            pid, path = m.group(1), m.group(2)
            if line.rstrip().endswith("<unfinished ...>"):
                pending[pid] = path
            else:
                done(path, line)
        elif m := _RESUMED.match(line):
            path = pending.pop(m.group(1), "")
            if path:
                done(path, line)
    return count


def strace_available() -> str | None:
    return shutil.which("strace") or shutil.which("strace", path="/usr/bin:/bin")


@contextmanager
def traced_execs(pid: int, settle: float = 0.2) -> Iterator[ExecCount]:
    """Count the programs process `pid` (every thread) and its children start
    inside the block. The count is filled in when the block ends."""
    strace = strace_available()
    if strace is None:
        raise RuntimeError("strace is not installed (apt-get install strace)")
    count = ExecCount()
    with tempfile.TemporaryDirectory(prefix="csi-bench-strace-") as tmp:
        out = os.path.join(tmp, "trace")
        proc = subprocess.Popen(
            [strace, "-f", "-qq", "-e", "trace=execve", "-o", out, "-p", str(pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_traced(pid, proc)
            yield count
            time.sleep(settle)  # a child's exec reported late still lands in the file
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # detach
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        with open(out, errors="replace") as f:
            count.programs.update(parse_execs(f.read()).programs)


def _tracer(status_path: str) -> int:
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def _wait_traced(pid: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """Until strace has attached to every thread of `pid`."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"strace exited {proc.returncode}: {err.strip()}")
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError as exc:
            raise RuntimeError(f"process {pid} is gone") from exc
        if tasks and all(_tracer(f"/proc/{pid}/task/{t}/status") == proc.pid for t in tasks):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("strace did not attach")
        time.sleep(0.05)


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """VmRSS of a process, in bytes; or VmHWM, its peak so far."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


@dataclass(frozen=True)
class ImportCost:
    module: str
    depth: int
    self_us: int
    cumulative_us: int


def parse_importtime(text: str) -> list[ImportCost]:
    """Rows of `python -X importtime` (stderr), in its order."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:"):].split("|")
        if len(parts) != 3:
            continue
        name = parts[2]
        stripped = name.lstrip(" ")
        depth = (len(name) - len(stripped) - 1) // 2  # one space, then two per level
        try:
            rows.append(ImportCost(stripped.strip(), max(depth, 0), int(parts[0]),
                                   int(parts[1])))
        except ValueError:
            continue
    return rows


def import_costs(statement: str) -> tuple[list[ImportCost], str]:
    """The import-time rows of running `statement` in a fresh interpreter, and
    its stderr when that failed."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", statement],
                          capture_output=True, text=True, check=False, timeout=600)
    return parse_importtime(proc.stderr), proc.stderr if proc.returncode else ""


def top_imports(rows: list[ImportCost], share: float = 0.04, max_depth: int = 3,
                limit: int = 24) -> list[ImportCost]:
    """The costly part of the import tree, in display order: every import
    taking at least `share` of the total, down to `max_depth` levels, the
    costlier first among siblings (importtime prints children before parents)."""
    children: dict[int, list[ImportCost]] = {}
    pending: dict[int, list[ImportCost]] = {}
    for row in rows:
        children[id(row)] = pending.pop(row.depth + 1, [])
        pending.setdefault(row.depth, []).append(row)
    roots = pending.get(0, [])
    total = sum(r.cumulative_us for r in roots) or 1
    out: list[ImportCost] = []

    def walk(nodes: list[ImportCost]) -> None:
        for node in sorted(nodes, key=lambda r: -r.cumulative_us):
            if len(out) >= limit or node.cumulative_us < share * total:
                continue
            out.append(node)
            if node.depth < max_depth:
                walk(children.get(id(node), []))

    walk(roots)
    return out


# The steps of the plugin's start before its socket answers, by (file name,
# function name) as cProfile records them (file names, not module paths, so
# that a module moved to another folder is still found; a renamed one must be
# renamed here: test_benchmarks checks each name against src/), in the order
# they run.
STARTUP_STEPS: tuple[tuple[str, str, str], ...] = (
    ("server.py", "_claim_socket", "the socket path checked"),
    ("plugin.py", "__init__", "the plugin's objects (the next four, and the rest)"),
    ("state_file.py", "__init__", "the state file loaded, reconciled with LVM"),
    ("pool.py", "note_volume_groups", "which VGs are here (the pools read)"),
    ("changed_blocks.py", "release_leftovers", "a held metadata snapshot released"),
    ("group_snapshots.py", "recover", "group snapshot journals recovered"),
    ("server.py", "build_server", "the gRPC server built"),
    ("_server.py", "start", "the gRPC server started (grpc)"),
    ("plugin.py", "start", "pool monitors and the lvm shell started"),
)


@dataclass
class StartupStep:
    label: str
    seconds: float  # cumulative, under the profiler


def startup_steps(stats: dict[tuple[str, int, str], tuple[Any, ...]]) -> list[StartupStep]:
    """STARTUP_STEPS' cumulative times in a cProfile dump (pstats.Stats.stats:
    {(file, line, function): (calls, primitive calls, own, cumulative, callers)}),
    each step summed over the functions of that name in a file of that name;
    steps that never ran are left out."""
    out = []
    for file, func, label in STARTUP_STEPS:
        got = [v[3] for (f, _line, fn), v in stats.items()
               if fn == func and os.path.basename(f) == file]
        if got:
            out.append(StartupStep(label, float(sum(got))))
    return out
