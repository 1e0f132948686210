"""Where one call's time went (host/stopwatch.py): the phases the layers
below note while the call records, and nothing when none does."""

from __future__ import annotations

import threading

from csi_local.host import stopwatch


def test_phases_noted_while_recording_add_up_with_the_rest() -> None:
    with stopwatch.recording() as breakdown:
        with stopwatch.phase("pool lock"):
            pass
        stopwatch.note("lvcreate in shell", 1.5)
    assert [w for w, _, _ in breakdown.parts] == ["pool lock", "lvcreate in shell"]
    text = breakdown.text()
    assert "pool lock 0.00s, lvcreate in shell 1.50s, rest 0.00s" in text


def test_what_is_noted_inside_a_phase_is_its_part_not_added_again() -> None:
    with stopwatch.recording() as breakdown:
        with stopwatch.phase("report"):
            stopwatch.note("lvs process", 0.25)
    (inner, outer) = breakdown.parts
    assert inner == ("lvs process", 0.25, True) and outer[0] == "report" and not outer[2]
    assert "(lvs process 0.25s), report" in breakdown.text()


def test_nothing_is_kept_without_a_recording_nor_in_another_thread() -> None:
    stopwatch.note("lvcreate process", 1.0)  # no one records: nothing happens
    with stopwatch.phase("pool lock"):
        pass
    with stopwatch.recording() as breakdown:
        t = threading.Thread(target=stopwatch.note, args=("elsewhere", 1.0))
        t.start()
        t.join()
    assert breakdown.parts == []
