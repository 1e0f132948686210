"""Loaded into the pytest run inside the VM: selects the host's chosen tests
and writes one JSON line per test phase for the host to report."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness.vm import COSTS_LOG_ENV, RESULTS_ENV, SELECT_ENV


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get(SELECT_ENV)
    if not path:
        return
    with open(path) as f:
        wanted = {line.strip() for line in f if line.strip()}
    keep = [i for i in items if i.nodeid in wanted]
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
    items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    costs = os.environ.get(COSTS_LOG_ENV)
    if costs:
        # Every phase's seconds, for the host's packing of the next run.
        with open(costs, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                                "duration": report.duration}) + "\n")
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    # A passing teardown is sent only for what it printed (a failed test's
    # plugin log is printed by its fixture's teardown).
    teardown_output = report.when == "teardown" and any(
        "teardown" in title for title, _ in report.sections)
    if report.when == "call" or report.outcome != "passed" or teardown_output:
        longrepr = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            longrepr = str(report.longrepr[2])
        elif report.longrepr is not None:
            longrepr = report.longreprtext
        line = {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "longrepr": longrepr,
            "duration": report.duration,
            "sections": [list(s) for s in report.sections
                         if report.when != "teardown" or "teardown" in s[0]],
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
