"""The serving engine on a mesh of fake CPU devices, against `generate` on the same mesh; started by
tests/decoding/test_engine_mesh.py in a fresh process (the device count is fixed when JAX starts).

    python engine_mesh_run.py CHECKPOINT OUT.json --mesh 1,4,2

Writes {"mesh": ..., "requests": [{"mode", "engine": tokens, "generate": tokens, "nfe": [engine,
generate], "error"}], "joined_mid_flight": bool, "auto": the mesh `--target auto` picks here,
"prefix_cache": [{"mode", "engine", "generate", "cached_tokens", ...}]}. The first request
runs alone until its first block is out; the others join it then, so they join a lane mid-flight.
"""

from __future__ import annotations

import argparse
import json
import threading

from tests.clover_jax.parallel.sharded_run import MASK_ID, peaked

PROMPTS = [[5, 9, 17, 33, 2, 70, 12, 40, 41], [44, 3, 8], [60, 61, 62, 63, 64], [20, 21, 22, 23, 24, 25, 26]]
MODES = ["diffusion", "autoregressive", "self_speculative", "diffusion"]
OVERRIDES = [{"max_new_tokens": 16}, {}, {}, {"schedule": "fixed_k"}]
# a harness's growing transcript: its first 10 tokens are one turn, the whole of it the next
TRANSCRIPT = [20 + (7 * i) % 90 for i in range(19)]
PREFIX_MODES = ["diffusion", "autoregressive", "self_speculative"]


def generation_config():
    from decoding import GenerationConfig

    return GenerationConfig(max_new_tokens=12, block_size=4, threshold=0.6, eos_token_id=(1,), presence_penalty=0.5,
                            mask_token_id=MASK_ID, do_sample=False, dllm_length_penalty=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--mesh", required=True)
    args = parser.parse_args()

    import jax

    from clover_jax import CloverModel
    from clover_jax.api.placement import Placement, parse_mesh, resolve_placement
    from decoding import generate
    from decoding.engine import Engine, EngineRequest

    shape = parse_mesh(args.mesh)
    model = peaked(CloverModel.from_pretrained(args.checkpoint, progress=False, impl="xla",
                                               **Placement(mesh_shape=shape).load_options()))
    config = generation_config()
    requests = [EngineRequest(prompt, mode, overrides=overrides, seed=seed)
                for seed, (prompt, mode, overrides) in enumerate(zip(PROMPTS, MODES, OVERRIDES, strict=True))]
    first_out, finished = threading.Event(), threading.Event()
    first = {"tokens": [], "finish": None}

    def listen(event):
        first["tokens"] += event.tokens
        first_out.set()
        if event.finish is not None:
            first["finish"], first["nfe"] = event.finish, event.stats.nfe
            finished.set()

    with Engine(model, config, max_running=4) as engine:
        engine.submit(requests[0], listen)
        first_out.wait(600)
        joined_mid_flight = not finished.is_set()
        later = engine.run(requests[1:], timeout=600)
        finished.wait(600)
    results = [{"tokens": first["tokens"], "nfe": first["nfe"], "error": None}] + \
              [{"tokens": r.tokens, "nfe": r.stats.nfe, "error": r.error} for r in later]
    # The prefix cache on the mesh: each mode's transcript stored by its first turn, then a longer turn
    # that starts from the cached K/V rows and GDN states (sharded as the lanes' state is).
    cached = []
    with Engine(model, config, max_running=4, prefix_cache_bytes=1 << 26, prefix_cache_grid=4) as engine:
        for mode in PREFIX_MODES:
            engine.run([EngineRequest(TRANSCRIPT[:10], mode)], timeout=600)
            (turn,) = engine.run([EngineRequest(TRANSCRIPT, mode)], timeout=600)
            cached.append({"mode": mode, "engine": turn.tokens, "nfe": turn.stats.nfe, "error": turn.error,
                           "cached_tokens": turn.stats.cached_tokens})
    auto = resolve_placement(model.config, quantize=None, mesh=None, target="auto", context_length=256, batch=4)
    record = {"mesh": shape, "joined_mid_flight": joined_mid_flight, "requests": [], "auto": auto.mesh_shape,
              "prefix_cache": cached}
    for request, result in zip(requests, results, strict=True):
        alone = generate(model, [list(request.prompt)], config, key=jax.random.key(request.seed), mode=request.mode,
                         **request.overrides)
        record["requests"].append({"mode": request.mode, "engine": result["tokens"], "generate": alone.sequences[0],
                                   "nfe": [result["nfe"], alone.nfe[0]], "error": result["error"]})
    for one in cached:
        alone = generate(model, [TRANSCRIPT], config, key=jax.random.key(0), mode=one["mode"])
        one.update(generate=alone.sequences[0], generate_nfe=alone.nfe[0])
    with open(args.out, "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main()
