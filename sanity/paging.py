"""Pagination checks shared by ListVolumes and ListSnapshots."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from sanity.csi import expect_code

ListPage = Callable[[int, str], tuple[list[str], str]]
MAX_PAGES = 10000


def walk(list_page: ListPage, max_entries: int) -> list[str]:
    """All ids over all pages; every page must respect max_entries."""
    ids: list[str] = []
    token = ""
    for _ in range(MAX_PAGES):
        page, token = list_page(max_entries, token)
        if max_entries:
            assert len(page) <= max_entries, f"{len(page)} entries with max_entries={max_entries}"
        ids += page
        if not token:
            return ids
    raise AssertionError(f"next_token never ran out after {MAX_PAGES} pages")


def check_max_entries(list_page: ListPage, ours: list[str]) -> None:
    everything, _ = list_page(0, "")
    assert set(ours) <= set(everything), "a list without max_entries misses created entries"
    page, token = list_page(2, "")
    assert len(page) <= 2, f"max_entries=2 returned {len(page)} entries"
    if len(everything) > 2:
        assert token, "more entries exist than max_entries, but next_token is empty"


def check_walk(list_page: ListPage, ours: list[str]) -> None:
    paged = walk(list_page, 2)
    everything = walk(list_page, 0)
    assert sorted(paged) == sorted(everything), "paging by 2 does not give the full list"
    for v in ours:
        assert paged.count(v) == 1, f"{v} appears {paged.count(v)} times when paging"


def check_invalid_token(list_page: ListPage) -> None:
    expect_code(grpc.StatusCode.ABORTED, lambda: list_page(0, "sanity-invalid-token-%$#"))


def check_stability(
    list_page: ListPage,
    ours: list[str],
    delete_one: Callable[[str], None],
    create_one: Callable[[], str],
) -> None:
    """Add and remove entries between pages: entries present the whole time appear once."""
    page, token = list_page(2, "")
    seen = list(page)
    victim = next((v for v in page if v in ours), ours[0])
    delete_one(victim)
    added = create_one()
    for _ in range(MAX_PAGES):
        if not token:
            break
        page, token = list_page(2, token)
        seen += page
    stable = [v for v in ours if v != victim]
    for v in stable:
        assert seen.count(v) == 1, (
            f"{v} existed during the whole listing but appeared {seen.count(v)} times "
            f"(deleted {victim}, added {added} between pages)"
        )
