"""The table-driven servicer tests' one kit: a row (one request and what it must
answer), and a Table that runs a row on a fake node and checks it.

Every row is checked the same way: the status code; a piece of the error
message that names the branch; exactly the tools that ran; and that the
parts of the node the row may not change are as they were. What differs
from one test file to another is a parameter of its Table (how a request is
sent, what "unchanged" covers, what an OK row may change), never a copy of
the runner. The tables themselves stay in their test files.

The tools: a row's `ran` names each tool that runs. In parentheses, one that
runs only when the node reads LVM by its commands (servicers.READ_PATH
"lvs"): where the VGs' committed metadata answers, the plugin reads it off
the PVs instead, and that tool must not run. "(lvs) lvcreate": an `lvs` then
the `lvcreate` on that path; the `lvcreate` alone on the other."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pytest
from _pytest.mark import ParameterSet

from csi_local.host.locks import Locks
from tests.unit.fakehost import FakeHost

W = TypeVar("W")  # what a row runs on: a node, a world of several classes, a lab

BUSY_WAIT = 0.0  # the busy lock is tried once: how long a call waits is not the point


def nothing(world: object) -> None:
    """No setup."""


def expected(tools: str, committed: bool) -> list[str]:
    """The tools of `tools` (in order, space-separated) that run on a node that
    reads the committed metadata (`committed`) or not: one in parentheses
    only when not."""
    return [t.strip("()") for t in tools.split()
            if not (committed and t.startswith("(") and t.endswith(")"))]


@dataclass(frozen=True)
class Case:
    request: Any  # a request, or world -> request
    code: str
    says: str  # a piece of the error message that names the branch ("" for OK rows)
    setup: Callable[[Any], object]
    # exactly the tools that ran, by variant ("": every variant); None: not checked
    ran: Mapping[str, frozenset[str]] | None
    busy: str  # a lock key held by "another operation" during the call
    changes: frozenset[str] | None  # what the call may change (None: the table's default)
    check: Callable[[Any, Any], None] | None  # (world, reply or message)
    method: str = ""  # the RPC, when the row names it rather than its test
    only: str = ""  # the one variant the row applies to ("": all)
    world: Mapping[str, Any] = field(default_factory=dict)  # how to build the row's world

    def tools(self, variant: str = "", committed: bool = False) -> frozenset[str] | None:
        """The tools that must run, on the variant's world, reading the committed
        metadata or not: a tool in parentheses only when not."""
        if self.ran is None:
            return None
        named = self.ran[variant] if variant in self.ran else self.ran[""]
        return frozenset(expected(" ".join(named), committed))


def row(id: str, request: Any, code: str, says: str = "", *,
        setup: Callable[[Any], object] = nothing,
        ran: str | Mapping[str, str] | None = "", busy: str = "",
        changes: str | None = None, check: Callable[[Any, Any], None] | None = None,
        method: str = "", only: str = "", xfail: str = "", **world: Any) -> ParameterSet:
    """One row. `ran`: the tools, or {variant: the tools} where the variants differ.
    `changes`: of the Table's `kept` parts, what the call may change. `xfail`: a
    defect of src/ still open, why the row fails (strict: it must fail). The
    other keywords build the row's world."""
    by = {"": ran} if isinstance(ran, str) else ran
    tools = None if by is None else {k: frozenset(v.split()) for k, v in by.items()}
    case = Case(request, code, says, setup, tools, busy,
                None if changes is None else frozenset(changes.split()), check,
                method, only, world)
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(case, id=id, marks=marks)


def by_variant(rows: list[ParameterSet], variants: list[str]) -> list[ParameterSet]:
    """Each row once per variant it applies to: parameters (case, variant)."""
    out = []
    for p in rows:
        case = p.values[0]
        assert isinstance(case, Case)
        for variant in variants:
            if case.only in ("", variant):
                out.append(pytest.param(case, variant, id=f"{p.id}/{variant}", marks=p.marks))
    return out


@dataclass(frozen=True)
class Table(Generic[W]):
    """How one file's rows run on their world W."""

    # (world, method, request) -> ("OK", reply) or (code, message)
    send: Callable[[W, str, Any], tuple[str, Any]]
    host: Callable[[W], FakeHost]
    locks: Callable[[W], Locks]
    # the named parts of the world a row leaves as they were, unless its
    # `changes` names them
    kept: Callable[[W], Mapping[str, object]]
    ok_changes: str = ""  # what an OK row may change when it does not say
    busy_key: Callable[[W, str], str] = lambda world, key: key
    # more checks of every row: (world, case, method, code, answer)
    after: Callable[[W, Case, str, str, Any], None] | None = None

    def run(self, world: W, case: Case, method: str = "", variant: str = "") -> Any:
        """Run one row on `world`: its answer (reply or message), checked."""
        method = method or case.method
        case.setup(world)
        before = self.kept(world)
        host = self.host(world)
        host.calls.clear()
        request = case.request(world) if callable(case.request) else case.request
        with contextlib.ExitStack() as stack:
            if case.busy:
                locks = self.locks(world)
                locks.timeout = BUSY_WAIT
                stack.enter_context(locks.hold(self.busy_key(world, case.busy)))
            code, answer = self.send(world, method, request)
        assert code == case.code, answer
        if code != "OK":
            assert case.says in answer, answer
        tools = case.tools(variant, committed=host.pv_metadata)
        if tools is not None:
            assert {c[0] for c in host.calls} == tools, host.calls
        changes = case.changes
        if changes is None:
            changes = frozenset(self.ok_changes.split()) if code == "OK" else frozenset()
        after = self.kept(world)
        for what, value in before.items():
            if what not in changes:
                assert after[what] == value, f"{what} changed"
        if self.after is not None:
            self.after(world, case, method, code, answer)
        if case.check is not None:
            case.check(world, answer)
        return answer
