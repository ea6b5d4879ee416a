"""The serving engine's served set compiles — not only lowers — for a TPU (v6e-1) and an H200 from
this CPU host, program by program (`clover_jax.api.compile.served_set`, run by the real compilers
in the compile subprocess): every ragged forward (one per token padding) with its Pallas kernels
(the paged attention, the grouped expert matmuls), every decision of the served modes, the slot
writes and the GDN state copies — exactly the programs `precompile.planned_programs` counts, on a
small model with the kernels' real tile sizes."""

from __future__ import annotations

import pytest

from clover_jax.core.config import CloverConfig
from tests.clover_jax.parallel.test_compile_targets import SMALL

MODES = ("diffusion", "self_speculative")
SETTINGS = dict(max_running=2, max_context=1024, block_sizes=(16,), modes=MODES, prefill_budget=32,
                prefix_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def compiled():
    import dataclasses

    from clover_jax.api.compile.served_set import ServedSetJob
    from clover_jax.api.compile.worker import compile_in_subprocess

    config = CloverConfig.from_dict(SMALL)
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    jobs = [ServedSetJob(config=fields, target=name, quantize=None, mesh={"data": 1, "expert": 1, "tensor": 1},
                         rules={}, **SETTINGS) for name in ("v6e-1", "H200")]
    return dict(zip(("v6e-1", "H200"), compile_in_subprocess(jobs, timeout=1800), strict=True))


@pytest.mark.parametrize("name", ["v6e-1", "H200"])
def test_every_program_of_the_served_set_compiles(compiled, name):
    from decoding.engine.precompile import planned_programs

    programs = compiled[name]
    assert {key: memory.error for key, memory in programs.items() if memory.error} == {}
    planned = planned_programs(modes=MODES, block_sizes=SETTINGS["block_sizes"], max_running=2,
                               chunk_size=SETTINGS["prefill_budget"])
    forwards = [key for key in programs if key.startswith("forward/")]
    assert len(programs) == planned["total"] and len(forwards) == planned["forward"] == 4, sorted(programs)
    # the forwards run the Pallas kernels (paged attention, the grouped expert matmuls), not XLA fallbacks
    assert all(programs[key].kernel_calls >= 2 for key in forwards), {key: programs[key].kernel_calls
                                                                      for key in forwards}
    assert all(memory.compile_seconds > 0 and memory.total_bytes > 0 for memory in programs.values())
