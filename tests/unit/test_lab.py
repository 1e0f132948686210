"""benchmarks/lab.py is the one home of the loop-backed VGs and the plugin
process that the bench and the integration tests' fixtures build on (what it
does to LVM is proven in the VM, by both). Here: the direction of the
imports, that the fixtures keep no second copy, and that each side still
starts the plugin as it did."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from benchmarks.lab import LoopVG, PluginProcess

REPO = Path(__file__).resolve().parents[2]
CONFTEST = REPO / "tests" / "integration" / "conftest.py"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _defined(path: Path) -> set[str]:
    """Top-level functions and classes of `path`."""
    return {node.name for node in _tree(path).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def test_benchmarks_import_nothing_from_tests() -> None:
    """`python -m benchmarks` runs from a fresh clone, without the tests."""
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        bad = {m for m in _imported(path) if m == "tests" or m.startswith("tests.")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_fixtures_keep_no_copy_of_the_lab() -> None:
    lab = _defined(REPO / "benchmarks" / "lab.py")
    assert {"run", "LoopVG", "make_vg", "unmount_under", "PluginProcess"} <= lab
    # make_vg stays as the tests' defaults (their scratch directory and names)
    # over the lab's: it must call it, not build a VG itself.
    assert _defined(CONFTEST) & lab == {"make_vg"}
    wrapper = next(n for n in _tree(CONFTEST).body
                   if isinstance(n, ast.FunctionDef) and n.name == "make_vg")
    calls = {ast.unparse(c.func) for c in ast.walk(wrapper) if isinstance(c, ast.Call)}
    assert calls == {"lab.make_vg"}, calls


VG = LoopVG(name="csitest0", pool="pool", image=Path("/run/x.img"), loop="/dev/loop9", size=1)


def test_the_tests_plugin_logs_debug_as_node_1() -> None:
    argv = PluginProcess(vg=VG, workdir=Path("/run/p")).argv()
    assert argv[:2] == [sys.executable, "-m"]
    assert argv[argv.index("--node-id") + 1] == "node-1"
    assert argv[argv.index("--log-level") + 1] == "debug"
    assert argv[argv.index("--volume-group") + 1:argv.index("--volume-group") + 4] == \
        ["csitest0", "--thin-pool", "pool"]
    assert "--config" not in argv


def test_the_bench_plugin_runs_at_the_default_log_level() -> None:
    """As `Lab.plugin` makes it: a deployment's log level, profiled if asked."""
    p = PluginProcess(VG, Path("/run/w"), ["--x"], node_id="bench-node", log_level=None,
                      python_args=["-m", "cProfile"])
    argv = p.argv()
    assert argv[1:3] == ["-m", "cProfile"] and argv[-1] == "--x"
    assert argv[argv.index("--node-id") + 1] == "bench-node"
    assert "--log-level" not in argv


def test_a_config_file_replaces_the_pool_flags() -> None:
    argv = PluginProcess(vg=VG, workdir=Path("/run/p"), config_file=Path("/run/c.yaml")).argv()
    assert argv[argv.index("--config") + 1] == "/run/c.yaml"
    assert "--volume-group" not in argv and "--thin-pool" not in argv
