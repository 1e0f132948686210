"""The bench's results: rows of figures with their raw counterparts and goals,
exec counts, import costs; printed as tables (plain or Markdown) and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.measure import ExecCount, ImportCost

MiB = 1 << 20


@dataclass
class Row:
    """One figure: csi-local's `value` next to `raw` (seconds, or bytes for memory)."""

    operation: str
    value: float | None = None
    raw: float | None = None
    raw_label: str = ""
    unit: str = "s"  # "s", "bytes" or "per_min" (a count per minute)
    goal: float | None = None  # a ratio (goal_kind "ratio") or a ceiling in `unit` ("max")
    goal_kind: str = "ratio"
    goal_applies: bool = True  # False: the issue states the goal for another scale
    goal_note: str = ""
    samples: list[float] = field(default_factory=list)
    raw_samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.value is None or self.raw is None or self.raw <= 0:
            return None
        return self.value / self.raw

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        got = self.ratio if self.goal_kind == "ratio" else self.value
        return None if got is None else got <= self.goal

    @property
    def needs_raw(self) -> bool:
        return bool(self.raw_label)

    @property
    def complete(self) -> bool:
        return self.value is not None and (self.raw is not None or not self.needs_raw)


@dataclass
class ExecRow:
    rpc: str
    count: ExecCount | None = None
    lvm_goal: int | None = None  # at most this many lvm processes
    goal_note: str = ""

    @property
    def met(self) -> bool | None:
        if self.lvm_goal is None or self.count is None:
            return None
        return self.count.lvm <= self.lvm_goal


@dataclass
class Results:
    meta: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    execs: list[ExecRow] = field(default_factory=list)
    imports: list[ImportCost] = field(default_factory=list)
    import_total_us: int = 0
    errors: list[str] = field(default_factory=list)

    def row(self, operation: str) -> Row | None:
        return next((r for r in self.rows if r.operation == operation), None)

    def missing(self) -> list[str]:
        """Every figure the run should have produced and did not."""
        out = [r.operation for r in self.rows if not r.complete]
        out += [f"lvm execs of {e.rpc}" for e in self.execs if e.count is None]
        if not self.imports:
            out.append("import costs")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "rows": [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in self.rows],
            "execs": [{"rpc": e.rpc, "lvm": e.count.lvm if e.count else None,
                       "other": e.count.other if e.count else None,
                       "programs": dict(e.count.programs) if e.count else None,
                       "lvm_goal": e.lvm_goal, "met": e.met} for e in self.execs],
            "imports": [asdict(i) for i in self.imports],
            "import_total_us": self.import_total_us,
            "errors": self.errors,
        }

    def dump(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "bytes":
        return f"{value / MiB:.1f} MiB"
    if unit == "per_min":
        return f"{value:.1f}/min"
    if value >= 10:
        return f"{value:.1f} s"
    return f"{value * 1000:.0f} ms"


def fmt_goal(r: Row) -> str:
    if r.goal is None:
        return "-"
    text = (f"<= {r.goal:.1f}x" if r.goal_kind == "ratio" else f"<= {fmt_value(r.goal, r.unit)}")
    return f"{text} {r.goal_note}".strip()


def fmt_met(met: bool | None, applies: bool = True) -> str:
    if met is None:
        return "-"
    text = "yes" if met else "no"
    return text if applies else f"({text})"


def _table(header: list[str], rows: list[list[str]], markdown: bool,
           right: frozenset[int] = frozenset()) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if i in right else "---" for i in range(len(header)))
                 + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_tables(res: Results, markdown: bool = False) -> str:
    out = []
    rounds = res.meta.get("rounds")
    out.append(f"csi-local against the raw commands, same VG, same run (median of {rounds} "
               f"rounds unless noted; {res.meta.get('where', '')})")
    rows = [[r.operation, fmt_value(r.value, r.unit), r.raw_label or "-",
             fmt_value(r.raw, r.unit) if r.needs_raw else "-",
             f"{r.ratio:.2f}x" if r.ratio is not None else "-",
             fmt_goal(r), fmt_met(r.met, r.goal_applies)] for r in res.rows]
    out.append(_table(["operation", "csi-local", "raw command(s)", "raw", "ratio", "goal", "met"],
                      rows, markdown, right=frozenset({1, 3, 4})))
    counted = [r for r in res.rows if r.unit == "per_min"]
    if counted:
        out.append("")
        out.extend(f"{r.operation}: {r.note}" for r in counted)
    out.append("")
    out.append("processes started per RPC (strace -f -e trace=execve on the plugin, one call)")
    erows = [[e.rpc, str(e.count.lvm) if e.count else "n/a",
              e.count.names(lvm=True) if e.count else "n/a",
              str(e.count.other) if e.count else "n/a",
              e.count.names(lvm=False) if e.count else "n/a",
              "-" if e.lvm_goal is None else f"<= {e.lvm_goal} lvm {e.goal_note}".strip(),
              fmt_met(e.met)] for e in res.execs]
    out.append(_table(["RPC", "lvm", "lvm programs", "other", "other programs", "goal", "met"],
                      erows, markdown, right=frozenset({1, 3})))
    if res.imports:
        out.append("")
        out.append(f"import costs of the serve path (python -X importtime; "
                   f"{res.import_total_us / 1000:.0f} ms in all top-level imports)")
        indent = "&nbsp;&nbsp;" if markdown else "  "  # Markdown collapses spaces
        irows = [[indent * i.depth + i.module, f"{i.cumulative_us / 1000:.1f}",
                  f"{i.self_us / 1000:.1f}"] for i in res.imports]
        out.append(_table(["module (indent: nesting)", "cumulative ms", "self ms"], irows,
                          markdown, right=frozenset({1, 2})))
    notes = res.meta.get("notes") or []
    if notes:
        out.append("")
        out.extend(f"note: {n}" for n in notes)
    if res.errors:
        out.append("")
        out.extend(f"ERROR: {e}" for e in res.errors)
    return "\n".join(out)
