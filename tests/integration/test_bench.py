"""The benchmark runner's short version (benchmarks/, `python -m benchmarks`):
every RPC next to the raw commands it wraps, on a VG of its own, in one run.
Prints the figures for the CI log; asserts only that each one was produced,
never a timing."""

from __future__ import annotations

import pytest

from benchmarks.report import format_tables
from benchmarks.runner import Options, run_bench

pytestmark = [pytest.mark.integration, pytest.mark.report]


def test_benchmark_figures_are_all_produced() -> None:
    progress: list[str] = []
    # 1,000 volumes (and 100 snapshots) by the fast fill (benchmarks/fill.py).
    res = run_bench(Options(scales=[10, 1000], rounds=2, concurrency=20, startup_rounds=1,
                            import_rounds=1, storm=8, storm_workers=3, idle_seconds=10,
                            scrape_interval=5, idle_at=10, encryption_rounds=1,
                            progress=progress.append))
    print("\n" + format_tables(res))
    # Where the bench's own time went: each section's seconds, for CI's budget.
    print("bench sections: " + "; ".join(
        line for line in progress if line.endswith("s)") and (" done (" in line
                                                            or line.startswith("cleaned up"))))
    if res.errors or res.missing():
        print("--- bench progress ---\n" + "\n".join(progress))
    assert not res.errors, res.errors
    assert not res.missing(), f"figures missing: {res.missing()}"
    expected = {"CreateVolume", "NodeStageVolume", "NodePublishVolume", "GetCapacity",
                "ListVolumes", "DeleteVolume"}
    assert expected <= {e.rpc for e in res.execs if e.count is not None}
    for op in ("ListVolumes, warm, 10 volumes", "plugin RSS, 10 volumes",
               "ListVolumes, first after start, 1000 volumes", "ListVolumes, warm, 1000 volumes",
               "ListSnapshots, 100 snapshots of 1000 volumes",
               "GetCapacity, 1000 volumes", "CreateVolume, 1000 volumes",
               "DeleteVolume, 1000 volumes", "start-up to first Probe, 1000 volumes",
               "start-up step, 1000 volumes: the state file loaded, reconciled with LVM",
               "start-up to first Probe, 10 volumes", "20 concurrent CreateVolume",
               "pod storm: 8 PVCs to published", "pod storm: 8 up while 8 go",
               "pod storm CreateVolume p99", "pod storm DeleteVolume p50",
               "NodeStageVolume (ext4, LUKS2)", "write 24 MiB, LUKS2 vs plain",
               "python + grpc + CSI stubs (the floor)",
               "idle: programs a minute, 10 volumes, nothing happening",
               "idle: programs a minute, 10 volumes, metrics scraped every 5 s",
               "idle: programs a minute, 10 volumes, pool autoextend on"):
        assert res.row(op) is not None, op
