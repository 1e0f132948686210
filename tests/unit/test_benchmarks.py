"""The benchmark runner's parsers and tables (the runner itself needs LVM: it
runs in the VM, tests/integration/test_bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.measure import ExecCount, parse_execs, parse_importtime, top_imports
from benchmarks.report import ExecRow, MiB, Results, Row, format_tables

STRACE = """\
101   execve("/usr/sbin/lvs", ["lvs", "--reportformat", "json"], 0x7ff /* 4 vars */) = 0
102   execve("/usr/local/sbin/mkfs.ext4", ["mkfs.ext4"], 0x7ff /* 4 vars */) = -1 ENOENT (No such file or directory)
102   execve("/usr/sbin/mkfs.ext4", ["mkfs.ext4", "-q"], 0x7ff /* 4 vars */ <unfinished ...>
103   execve("/usr/sbin/lvcreate", ["lvcreate"], 0x7ff /* 4 vars */ <unfinished ...>
102   <... execve resumed>)             = 0
103   <... execve resumed>)             = 0
104   execve("/usr/bin/mount", ["mount", "--bind", "a", "b"], 0x7ff /* 4 vars */) = 0
105   execve("/usr/sbin/lvs", ["lvs"], 0x7ff /* 4 vars */) = 0
"""  # noqa: E501


def test_exec_counts_take_successful_execs_by_program() -> None:
    count = parse_execs(STRACE)
    assert count.programs == {"lvs": 2, "lvcreate": 1, "mkfs.ext4": 1, "mount": 1}
    assert (count.lvm, count.other) == (3, 2)
    assert count.names(lvm=True) == "lvcreate, lvs x2"
    assert count.names(lvm=False) == "mkfs.ext4, mount"


IMPORTTIME = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   _io
import time:       500 |       4000 | site
import time:      2000 |       2000 |     grpc._cython
import time:       300 |       2300 |   grpc
import time:        50 |         50 |   tiny
import time:      1000 |       3350 | csi_local.csi.server
"""


def test_import_costs_keep_the_tree_and_drop_the_cheap() -> None:
    rows = parse_importtime(IMPORTTIME)
    assert [(r.module, r.depth) for r in rows][:3] == [("_io", 1), ("site", 0),
                                                       ("grpc._cython", 2)]
    shown = [(r.module, r.depth) for r in top_imports(rows, share=0.05)]
    assert shown == [("site", 0), ("csi_local.csi.server", 0), ("grpc", 1), ("grpc._cython", 2)]


def test_tables_show_ratio_goal_and_what_is_missing() -> None:
    res = Results(meta={"rounds": 3})
    res.rows = [Row("CreateVolume (64 MiB)", 3.0, 1.5, "lvcreate", goal=1.0),
                Row("ListVolumes, 10 volumes", 0.5, 0.5, "lvs", goal=1.2, goal_applies=False),
                Row("plugin RSS, 10 volumes", 40.0 * MiB, unit="bytes", goal=60.0 * MiB,
                    goal_kind="max"),
                Row("GetCapacity", 1.0, None, "lvs", goal=1.0)]
    count = ExecCount()
    count.programs.update({"lvcreate": 1})
    res.execs = [ExecRow("CreateVolume", count, lvm_goal=1), ExecRow("Probe")]
    text = format_tables(res)
    assert "2.00x" in text and "(yes)" in text and "40.0 MiB" in text
    assert [r.met for r in res.rows] == [False, True, True, None]
    assert res.missing() == ["GetCapacity", "lvm execs of Probe", "import costs"]
    assert format_tables(res, markdown=True).splitlines()[1].startswith("| operation |")


def test_percentile_is_a_sample_that_was_measured() -> None:
    from benchmarks.runner import percentile

    xs = [float(x) for x in range(1, 51)]  # 50 samples, as in the pod storm
    assert percentile(xs, 50) == 25.0
    assert percentile(xs, 99) == 50.0  # nearest rank: the slowest of 50
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_counts_a_minute_print_as_such_with_what_was_started() -> None:
    res = Results(meta={"rounds": 1})
    res.rows.append(Row("idle: programs a minute, 10 volumes, nothing happening", 4.0,
                        unit="per_min", goal=0.0, goal_kind="max",
                        note="1 in 15 s (strace): lvs"))
    text = format_tables(res)
    assert "4.0/min" in text and "<= 0.0/min" in text
    assert "nothing happening: 1 in 15 s (strace): lvs" in text
    assert res.rows[0].met is False


def test_startup_steps_are_found_by_file_and_function_name() -> None:
    from benchmarks.measure import startup_steps

    stats: dict[tuple[str, int, str], tuple[int, int, float, float, dict[Any, Any]]] = {
        ("/x/csi_local/csi/plugin.py", 58, "__init__"): (1, 1, 0.1, 2.5, {}),
        ("/x/csi_local/state/state_file.py", 196, "__init__"): (1, 1, 0.0, 1.5, {}),  # moved
        ("/x/csi_local/nodestate/state_file.py", 300, "other"): (1, 1, 0.0, 9.0, {}),
        ("/x/csi_local/volumes/pool.py", 495, "note_volume_groups"): (1, 1, 0.0, 0.5, {}),
        ("/x/grpc/_server.py", 10, "start"): (1, 1, 0.0, 0.25, {}),
        ("/x/csi_local/plugin.py", 119, "start"): (1, 1, 0.0, 0.125, {}),
    }
    got = [(s.label.split(" ")[1], s.seconds) for s in startup_steps(stats)]
    assert got == [("plugin's", 2.5), ("state", 1.5), ("VGs", 0.5), ("gRPC", 0.25),
                   ("monitors", 0.125)]


def test_each_startup_step_names_a_function_of_the_plugin() -> None:
    """A step is found by file and function name: a module or function renamed
    in src/ must be renamed in STARTUP_STEPS, or its row silently vanishes."""
    import ast

    from benchmarks.measure import STARTUP_STEPS

    src = Path(__file__).resolve().parents[2] / "src" / "csi_local"
    defined = {(path.name, node.name) for path in src.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    ours = [(f, fn) for f, fn, _ in STARTUP_STEPS if f != "_server.py"]  # grpc's own
    assert [s for s in ours if s not in defined] == []
