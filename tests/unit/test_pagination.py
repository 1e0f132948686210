import pytest

from csi_local.csi.pagination import Paginator
from csi_local.csi.rpc import Aborted


def walk(p: Paginator, items: list[str], n: int) -> list[str]:
    seen: list[str] = []
    token = ""
    while True:
        page, token = p.page(items, lambda s: s, n, token)
        seen += page
        if not token:
            return seen


def test_pages_cover_everything_once() -> None:
    items = [f"v{i:02d}" for i in range(7)]
    assert walk(Paginator(), items, 3) == sorted(items)


def test_stable_while_entries_change() -> None:
    p = Paginator()
    items = ["a", "b", "c", "d", "e"]
    page, token = p.page(items, lambda s: s, 2, "")
    assert page == ["a", "b"]
    changed = ["0", "a", "c", "d", "e", "f"]  # "b" removed, "0" and "f" added
    page2, token2 = p.page(changed, lambda s: s, 10, token)
    assert page2 == ["c", "d", "e", "f"] and token2 == ""


def test_foreign_or_garbled_token_aborts() -> None:
    p = Paginator()
    _, token = p.page(["a", "b"], lambda s: s, 1, "")
    with pytest.raises(Aborted):
        Paginator().page(["a", "b"], lambda s: s, 1, token)
    with pytest.raises(Aborted):
        p.page(["a"], lambda s: s, 1, "garbage")
    assert Paginator(b"k" * 32).page(["a", "b"], lambda s: s, 1, "")[1] == \
        Paginator(b"k" * 32).page(["a", "b"], lambda s: s, 1, "")[1]
