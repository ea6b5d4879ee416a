"""Host-side reports of committed blocks while the jitted loop runs (streaming and progress).

The loop calls `report_closed_blocks` through `jax.debug.callback` only on the steps where some
sequence decides a block — one host round trip per block, never per denoising step. Each
`generate` call registers its listener under a call id that travels into the loop as a traced
operand, so one compiled loop serves every call and listener.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

BlockListener = Callable[[int, list, int], None]  # (prompt index, response tokens of the block, block number)

_listeners: dict[int, Callable] = {}
_call_ids = itertools.count(1)


def register(listener: Callable) -> int:
    call_id = next(_call_ids)
    _listeners[call_id] = listener
    return call_id


def unregister(call_id: int) -> None:
    _listeners.pop(call_id, None)


def report_closed_blocks(call_id, closing, block, block_iter, response_base) -> None:
    """Host callback: forward each just-decided block's response tokens to the call's listener."""
    listener = _listeners.get(int(call_id))
    if listener is None:
        return
    size = block.shape[1]
    for index in np.flatnonzero(np.asarray(closing)):
        first_row = max(0, -int(response_base[index]) - int(block_iter) * size)
        listener(int(index), np.asarray(block[index, first_row:]).tolist(), int(block_iter))
