"""Per-forward cost on a medium random model sized for CPU (~0.3 B parameters, float32):

1. autoregressive decoding tokens/s, clover-jax (`generate(mode="autoregressive")`, one jitted
   while_loop) against `transformers` `generate` (greedy, with cache) on the same weights and
   prompt, alternating; both stop at the same EOS / max_new_tokens, forward calls counted;
2. the time of one denoising step (`CloverModel.denoise`, a block of `--block` masks after a
   prefix of `--prefix` tokens, coreset as the config says) against one autoregressive step
   (`CloverModel.extend` of one token after the same prefix, last-position logits), alternating,
   each a compiled call (compile excluded by a warm-up call).

`denoise_over_autoregressive_step` is the break-even point: a denoising step pays for itself
when it decides more tokens per forward than this ratio. Random weights decide about one token
per denoising step, so diffusion `generate` on this model would only repeat (2) many times over;
it is not run here (`benchmarks/decoding.py` does, on the trained tiny model).

`xla_cost_analysis` is XLA's static estimate for each compiled step (bytes accessed, FLOPs)
against the bytes of all parameters: a step that reads only the experts it routes to would
access well under the parameter bytes (here top-8 of 32 experts, so about half of them); a
ratio near or above 1 says the compiled step touches every expert's weights.

Usage: `python benchmarks/forward_cost.py [--quick] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (alternate, emit, machine, ratio, setup_environment, timed, torch_threads,  # noqa: E402
                               write_random_checkpoint)

setup_environment()

import numpy as np  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
# Qwen3.6's layout and ratios at a CPU-sized width: 2 x (3 GDN + 1 attention), 32 experts top-8.
MEDIUM = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
              head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_conv_kernel_dim=4, moe_intermediate_size=256,
              shared_expert_intermediate_size=512, num_experts=32, num_experts_per_tok=8, eos_token_id=1,
              tie_word_embeddings=False, max_position_embeddings=4096, rope_parameters=ROPE)
QUICK = dict(MEDIUM, vocab_size=512, hidden_size=128, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
             moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4)


def parameter_count(params) -> int:
    import jax

    return int(sum(np.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params)))


def compiled_traffic(model, state, token, block) -> dict:
    """XLA's own cost analysis of the two compiled steps: bytes accessed and FLOPs, next to the
    parameter bytes (what an ideal step would read is the non-expert weights plus the used experts)."""
    import jax
    import jax.numpy as jnp

    from clover_jax.clover_model import run_causal, run_pass

    def analysis(compiled):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return {"bytes_accessed": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0))}

    parameter_bytes = int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(model.params)))
    ar = analysis(run_causal.lower(model.module, model.params, jnp.asarray(token), state, model.chunk_size,
                                   "last").compile())
    coreset = model._coreset(None, None)
    denoise = analysis(run_pass.lower(model.module, model.params, jnp.asarray(block), state, 0, 0, coreset["coreset"],
                                      jnp.float32(coreset["coreset_top_p"])).compile())
    return {"parameter_bytes": parameter_bytes, "autoregressive_step": ar, "denoise_step": denoise,
            "autoregressive_bytes_over_parameter_bytes": ratio(ar["bytes_accessed"], parameter_bytes),
            "denoise_bytes_over_parameter_bytes": ratio(denoise["bytes_accessed"], parameter_bytes)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a tiny config, 1 round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the generate comparison")
    parser.add_argument("--step-rounds", type=int, default=10, help="rounds of the step comparison")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens for generate")
    parser.add_argument("--new", type=int, default=32, help="max_new_tokens for generate")
    parser.add_argument("--prefix", type=int, default=256, help="prefix tokens before the timed step")
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args(argv)
    fields = QUICK if args.quick else MEDIUM
    if args.quick:
        args.rounds, args.step_rounds, args.new = 1, 2, 8

    import jax
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    from clover_jax import CloverModel
    from decoding import generate

    threads = torch_threads()
    workdir = tempfile.mkdtemp(prefix="clover-bench-forward-")
    try:
        seconds, paths = timed(lambda: write_random_checkpoint(workdir, fields, seed=0,
                                                               mask_token_id=fields["vocab_size"] - 1))
        print(f"forward_cost: wrote the random checkpoints in {seconds:.1f}s", file=sys.stderr)
        model = CloverModel.from_pretrained(paths["clover"], progress=False)
        hf = Qwen3_5MoeForCausalLM.from_pretrained(paths["backbone"], dtype=torch.float32).eval()
        calls = [0]
        hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        rng = np.random.default_rng(0)
        prompt = rng.integers(2, fields["vocab_size"] - 1, args.prompt).tolist()
        eos = [fields["eos_token_id"]]

        def clover_ar():
            out = generate(model, [prompt], mode="autoregressive", max_new_tokens=args.new)
            return out.sequences[0], out.nfe[0]

        def transformers_ar():
            calls[0] = 0
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                generated = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                        do_sample=False, use_cache=True, eos_token_id=eos, pad_token_id=0)
            response = generated[0, len(prompt):].tolist()
            cut = next((n + 1 for n, t in enumerate(response) if t in eos), len(response))
            return response[:cut], calls[0]

        gen = alternate({"clover_autoregressive": clover_ar, "transformers": transformers_ar}, args.rounds)
        generate_results = {}
        for name, timing in gen.items():
            tokens, nfe = len(timing["last"][0]), timing["last"][1]
            generate_results[name] = {"tokens_per_s": tokens / timing["median"],
                                      "tokens_per_s_samples": [tokens / s for s in timing["samples"]],
                                      "response_tokens": tokens, "nfe": nfe, "seconds": timing["median"]}
        same = gen["clover_autoregressive"]["last"][0] == gen["transformers"]["last"][0]

        # One denoising step vs one autoregressive step after the same prefix.
        prefix = rng.integers(2, fields["vocab_size"] - 1, (1, args.prefix)).astype(np.int32)
        state = model.init_state(1, args.prefix + args.block)
        _, state = model.extend(state, prefix, logits="none")
        jax.block_until_ready(state)
        block = np.full((1, args.block), model.config.mask_token_id, np.int32)
        token = rng.integers(2, fields["vocab_size"] - 1, (1, 1)).astype(np.int32)
        distinct = []

        def denoise_step():
            out = model.denoise(state, block)
            jax.block_until_ready(out.logits)
            distinct.append(float(np.mean(np.asarray(out.distinct_experts))))

        def ar_step():
            logits, new_state = model.extend(state, token, logits="last")
            jax.block_until_ready((logits, new_state))

        steps = alternate({"denoise_step": denoise_step, "autoregressive_step": ar_step}, args.step_rounds)
        traffic = compiled_traffic(model, state, token, block)
        step_results = {name: {"median_ms": 1e3 * t["median"], "samples_ms": [1e3 * s for s in t["samples"]]}
                        for name, t in steps.items()}
        emit({
            "benchmark": "forward_cost", "quick": args.quick,
            "config": {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                                              "moe_intermediate_size", "vocab_size")},
            "parameters": parameter_count(model.params), "dtype": str(model.dtype), "torch_threads": threads,
            "generate": {"prompt_tokens": args.prompt, "max_new_tokens": args.new, "rounds": args.rounds,
                         **generate_results,
                         "clover_over_transformers_tokens_per_s": ratio(
                             generate_results["clover_autoregressive"]["tokens_per_s"],
                             generate_results["transformers"]["tokens_per_s"]),
                         "same_tokens": same},
            "step": {"prefix_tokens": args.prefix, "block": args.block, "rounds": args.step_rounds, **step_results,
                     "denoise_distinct_experts_per_layer": float(np.mean(distinct)) if distinct else None,
                     "coreset": model.config.moe_block_coreset_enabled,
                     "denoise_over_autoregressive_step": ratio(steps["denoise_step"]["median"],
                                                               steps["autoregressive_step"]["median"]),
                     "xla_cost_analysis": traffic},
            "machine": machine(),
        })
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
