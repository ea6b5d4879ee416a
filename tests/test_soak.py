"""A short soak (`benchmarks/soak.py`; the full one runs in `make bench`): one server of the bundled
model, mixed requests at concurrency 8 — chat and completions, the three modes, sampled and greedy,
streamed and whole, some cancelled mid-stream, some invalid, multi-turn conversations resending
their transcript — with a prefix cache small enough to evict. Nothing fails with a 5xx, every
request is answered as its kind says, nothing is left in the engine, the cache hit and evicted and
stayed within its budget with its counts equal to its trie counted afresh, every K/V page came back
but the cache's, and after the server's precompile the traffic compiled no program at all."""

from __future__ import annotations

import collections

from benchmarks.soak import _replayed, checks, soak
from benchmarks.soak_traffic import kind_of, request_mix

BUDGET = 96 << 10  # bytes: about three prompts' prefixes (32 KB a chunk with its states), so that the soak evicts


def test_a_short_soak_answers_everything_and_leaves_nothing_behind():
    result = soak(requests=24, warmup=12, phase=24, concurrency=8, seed=11, prefix_cache_bytes=BUDGET,
                  drop_programs=False)
    assert result["server_errors"] == 0, result
    assert result["left_in_engine"] == {"running": 0, "queued": 0, "held": 0, "pages": 0}
    assert result["compiled_on_demand"] == 0
    warm = request_mix(12, 11)
    expected = collections.Counter()
    for item in warm + _replayed(warm, 24):
        status = 400 if item["invalid"] else 200
        expected[f"{kind_of(item)} {status}"] += len(item["turns"] or [None])
    outcomes = collections.Counter()
    for phase in [result["after_warmup"], *result["phases"]]:
        outcomes.update(phase["outcomes"])
    assert outcomes == expected
    assert {"cancelled 200", "invalid 400", "turn 200", "served 200"} <= set(expected)  # the mix holds every kind

    cache = result["prefix_cache"]
    assert cache["budget"] == BUDGET and cache["hits"] > 0 and cache["evicted"] > 0, cache
    # the checks `make bench` applies, the memory growth aside (a few dozen requests still compile)
    failed = [one for one in checks(result) if not one["passed"] and "memory" not in one["name"]]
    assert not failed, (failed, cache, result["programs_by_function"])
    programs, bound = result["programs_by_function"], result["program_bound"]
    # one forward per token padding: 16 .. 2048 (the bundled model's prefill chunk), halfway points between
    assert 0 < programs["forward"] <= bound["forward"] == 15, (programs, bound)
    # every engine program was compiled (or loaded) while the soak counted
    assert 0 < sum(result["programs_by_function"].values()) <= result["phases"][-1]["process_compiles"]
