"""The responses kept for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`: in memory,
bounded in bytes.

Each stored response is kept with its conversation (the input items it was given, the previous
response's included, then its output items), so that a request naming it as its previous response
continues the whole conversation with one look-up. What a response costs is the length of its
JSON and its conversation's; when the total passes the bound, the oldest responses are dropped
first (a request naming one then gets a 404), and a response larger than the whole bound is not
kept. Nothing outlives the process.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

from clover_jax.api.serving.errors import ApiError

logger = logging.getLogger(__name__)

DEFAULT_STORE_BYTES = 64 << 20


class ResponseStore:
    """Used from the server's event loop only (no lock)."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES):
        self.max_bytes = max_bytes
        self.used = 0
        self.entries: OrderedDict[str, tuple[int, dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, items: list[dict]) -> bool:
        """Keep `response` and its conversation `items`; False when it alone is over the bound."""
        size = len(json.dumps(response)) + len(json.dumps(items))
        if size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, over the store's bound of %d", response["id"], size,
                           self.max_bytes)
            return False
        self.delete(response["id"])
        self.entries[response["id"]] = (size, response, items)
        self.used += size
        while self.used > self.max_bytes:
            _, (dropped, _, _) = self.entries.popitem(last=False)
            self.used -= dropped
        return True

    def response(self, response_id: str, param: str | None = None) -> dict:
        return self._entry(response_id, param)[1]

    def items(self, response_id: str, param: str | None = "previous_response_id") -> list[dict]:
        """The conversation that `response_id` ended: its input items, then its output items."""
        return self._entry(response_id, param)[2]

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.used -= entry[0]
        return entry is not None

    def _entry(self, response_id: str, param: str | None) -> tuple[int, dict, list[dict]]:
        entry = self.entries.get(response_id)
        if entry is None:
            raise ApiError(404, f"no stored response has the id {response_id!r} (sent with store: false, dropped "
                                "from the server's bounded store, or never made here)", param, "not_found")
        return entry
