"""A short soak (`benchmarks/soak.py`; the full one runs in `make bench`): one server of the bundled
model, mixed requests at concurrency 8 — chat and completions, the three modes, sampled and greedy,
streamed and whole, some cancelled mid-stream, some invalid. Nothing fails with a 5xx, every
request is answered as its kind says, and nothing is left in the engine afterwards."""

from __future__ import annotations

from benchmarks.soak import request_mix, soak


def test_a_short_soak_answers_everything_and_leaves_nothing_behind():
    result = soak(requests=24, warmup=4, phase=24, concurrency=8, seed=3)
    assert result["server_errors"] == 0, result
    assert result["left_in_engine"] == {"running": 0, "queued": 0, "held": 0, "lanes": 0, "prefills": 0}
    mix = request_mix(28, 3)
    outcomes = {}
    for phase in [result["after_warmup"], *result["phases"]]:
        for key, count in phase["outcomes"].items():
            outcomes[key] = outcomes.get(key, 0) + count
    invalid = sum(request["invalid"] for request in mix)
    cancelled = sum(request["cancel"] for request in mix)
    assert outcomes == {key: count for key, count in {"cancelled 200": cancelled, "invalid 400": invalid,
                                                      "served 200": len(mix) - invalid - cancelled}.items() if count}
    assert invalid and cancelled  # the mix holds both kinds
