"""Fixtures of the weights tests."""

from __future__ import annotations

import jax
import pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT


@pytest.fixture
def compilations():
    """The list of XLA compilations made while the test runs (one entry per backend compile)."""
    seen = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)
