"""Opaque, signed page tokens for ListVolumes and ListSnapshots.

A token names the last ID returned; the next page starts after it in ID
order. Entries that exist the whole time appear exactly once, however many
are added or removed between pages. A token this process did not sign is
ABORTED.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from csi_local.csi.rpc import Aborted, InvalidArgument

T = TypeVar("T")


class Paginator:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or os.urandom(32)

    def _mac(self, payload: bytes) -> str:
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()[:24]

    def token(self, last_id: str) -> str:
        payload = last_id.encode()
        return base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + self._mac(payload)

    def after(self, token: str) -> str:
        body, _, mac = token.partition(".")
        try:
            payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError:
            raise Aborted(f"invalid starting_token {token!r}") from None
        if not mac or not hmac.compare_digest(mac, self._mac(payload)):
            raise Aborted(f"invalid starting_token {token!r}: not issued by this plugin")
        return payload.decode()

    def page(
        self, items: Sequence[T], key: Callable[[T], str], max_entries: int, starting_token: str
    ) -> tuple[list[T], str]:
        if max_entries < 0:
            raise InvalidArgument("max_entries must not be negative")
        ordered = sorted(items, key=key)
        if starting_token:
            last = self.after(starting_token)
            ordered = [i for i in ordered if key(i) > last]
        if max_entries and len(ordered) > max_entries:
            chosen = ordered[:max_entries]
            return chosen, self.token(key(chosen[-1]))
        return ordered, ""
