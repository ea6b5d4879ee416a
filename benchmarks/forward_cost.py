"""Per-forward cost on a medium random model sized for CPU (~0.3 B parameters, float32), against
this machine's limits.

1. The machine: read bandwidth and matmul rate (`benchmarks/machine_rates.py`), measured first.
2. Autoregressive decoding tokens/s, clover-jax (`generate(mode="autoregressive")`, one jitted
   while_loop) against `transformers` `generate` (greedy, with cache) on the same weights and
   prompt, alternating; both stop at the same EOS / max_new_tokens. Same tokens checked.
3. The steady-state time per autoregressive token — the difference between `generate` with
   `--new` and with 8 new tokens, divided by the extra tokens (prefill and per-call overhead
   cancel) — against its bound: the bytes one token reads (`benchmarks/cost_model.py`: every
   non-expert weight, the top-k experts of each layer, the LM head) over the read bandwidth.
4. One denoising step (a block of `--block` masks after `--prefix` tokens, coreset as the config
   says), one fused commit + denoising step, and one autoregressive step, each a compiled
   `CloverModel` call, against their roofline bounds: max(bytes / bandwidth, FLOPs / matmul rate),
   with the distinct experts each step actually used.

`denoise_over_autoregressive_step` is the break-even point: a denoising step pays for itself when
it decides more tokens per forward than this ratio. `xla_cost_analysis` is XLA's own static
estimate for the compiled steps; it counts a dynamic slice of an expert as a read of the whole
stacked array and a loop body once, so it is reported beside the measurements, not used.

Targets (`checks`, enforced by `benchmarks/run_all.py`): clover / transformers tokens/s >= 1.8;
autoregressive tokens/s >= 75% of the bandwidth bound; each step within 1.5x its bound; the
denoising step <= 1.5x the autoregressive step.

Usage: `python benchmarks/forward_cost.py [--quick] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    alternate,
    check,
    emit,
    machine,
    ratio,
    setup_environment,
    timed,
    torch_threads,
    write_random_checkpoint,
)

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
    """XLA's own cost analysis of the compiled steps (see the module docstring for its caveats)."""
    import jax.numpy as jnp

    from clover_jax.model.clover_model import run_causal, run_pass

    def analysis(compiled):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return {"bytes_accessed": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0))}

    coreset = model._coreset(None, None)
    autoregressive = run_causal.lower(model.passes, model.run_params, jnp.asarray(token), state,
                                      chunk_size=model.chunk_size, logits="last")
    denoise = run_pass.lower(model.passes, model.run_params, jnp.asarray(block), state, num_causal=0, logits_from=0,
                             coreset=coreset["coreset"], coreset_top_p=jnp.float32(coreset["coreset_top_p"]))
    return {"autoregressive_step": analysis(autoregressive.compile()), "denoise_step": analysis(denoise.compile())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a tiny config, 1 round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the generate comparisons")
    parser.add_argument("--step-rounds", type=int, default=10, help="rounds of the step comparison")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens for generate")
    parser.add_argument("--new", type=int, default=32, help="max_new_tokens for generate")
    parser.add_argument("--prefix", type=int, default=256, help="prefix tokens before the timed steps")
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args(argv)
    fields = QUICK if args.quick else MEDIUM
    if args.quick:
        args.rounds, args.step_rounds, args.new = 1, 2, 16

    import jax
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    from benchmarks import cost_model, machine_rates
    from clover_jax import CloverModel
    from decoding import generate

    rates = machine_rates.measure()
    print(f"forward_cost: read {rates['read_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
          f"{rates['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s", file=sys.stderr)
    threads = torch_threads()
    workdir = tempfile.mkdtemp(prefix="clover-bench-forward-")
    try:
        seconds, paths = timed(lambda: write_random_checkpoint(workdir, fields, seed=0,
                                                               mask_token_id=fields["vocab_size"] - 1))
        print(f"forward_cost: wrote the random checkpoints in {seconds:.1f}s", file=sys.stderr)
        model = CloverModel.from_pretrained(paths["clover"], progress=False)
        config = model.config
        hf = Qwen3_5MoeForCausalLM.from_pretrained(paths["backbone"], dtype=torch.float32).eval()
        calls = [0]
        hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        rng = np.random.default_rng(0)
        prompt = rng.integers(2, fields["vocab_size"] - 1, args.prompt).tolist()
        eos = [fields["eos_token_id"]]

        def clover_ar(new=args.new):
            out = generate(model, [prompt], mode="autoregressive", max_new_tokens=new)
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
        ar_over_transformers = ratio(generate_results["clover_autoregressive"]["tokens_per_s"],
                                     generate_results["transformers"]["tokens_per_s"])

        # Steady-state seconds per autoregressive token: generate with `new` and with 8 tokens.
        short = 8
        steady = alternate({"long": lambda: clover_ar(args.new), "short": lambda: clover_ar(short)}, args.rounds * 2)
        long_tokens, short_tokens = len(steady["long"]["last"][0]), len(steady["short"]["last"][0])
        per_token = (steady["long"]["median"] - steady["short"]["median"]) / max(long_tokens - short_tokens, 1)
        ar_cost = cost_model.pass_cost(config, 1, 0, args.prompt + args.new // 2, config.num_experts_per_tok, 1)
        ar_bound = cost_model.bound(ar_cost, rates)

        # One denoising step, one fused commit + denoising step, one autoregressive step.
        prefix = rng.integers(2, fields["vocab_size"] - 1, (1, args.prefix)).astype(np.int32)
        state = model.init_state(1, args.prefix + 2 * args.block)
        _, state = model.extend(state, prefix, logits="none")
        jax.block_until_ready(state)
        block = np.full((1, args.block), config.mask_token_id, np.int32)
        commit = rng.integers(2, fields["vocab_size"] - 1, (1, args.block)).astype(np.int32)
        token = rng.integers(2, fields["vocab_size"] - 1, (1, 1)).astype(np.int32)
        distinct = {}

        def denoise_step():
            out = model.denoise(state, block)
            jax.block_until_ready(out.logits)
            distinct["denoise"] = np.asarray(out.distinct_experts)[:, 0]

        def fused_step():
            out, new_state = model.commit_and_denoise(state, commit, block)
            jax.block_until_ready((out.logits, new_state))
            distinct["fused"] = np.asarray(out.distinct_experts)[:, 0]

        def ar_step():
            jax.block_until_ready(model.extend(state, token, logits="last"))

        steps = alternate({"denoise_step": denoise_step, "commit_and_denoise_step": fused_step,
                           "autoregressive_step": ar_step}, args.step_rounds)
        costs = {
            "denoise_step": cost_model.pass_cost(config, 0, args.block, args.prefix, distinct["denoise"], args.block),
            "commit_and_denoise_step": cost_model.pass_cost(config, args.block, args.block, args.prefix,
                                                            distinct["fused"], args.block),
            "autoregressive_step": cost_model.pass_cost(config, 1, 0, args.prefix, config.num_experts_per_tok, 1),
        }
        step_results = {}
        for name, timing in steps.items():
            limit = cost_model.bound(costs[name], rates)
            step_results[name] = {"median_ms": 1e3 * timing["median"],
                                  "samples_ms": [1e3 * s for s in timing["samples"]],
                                  "cost": costs[name], "bound": limit,
                                  "over_bound": timing["median"] / limit["seconds"]}
        denoise_over_ar = ratio(steps["denoise_step"]["median"], steps["autoregressive_step"]["median"])
        bound_ratio = ratio(step_results["denoise_step"]["bound"]["seconds"],
                            step_results["autoregressive_step"]["bound"]["seconds"])
        checks = [
            check("clover autoregressive / transformers tokens/s (medium model)", ar_over_transformers, 1.8, True),
            check("autoregressive tokens/s / bandwidth bound (medium model)", ratio(ar_bound["seconds"], per_token),
                  0.75, True, 1.0),
            check("denoising step / its roofline bound", step_results["denoise_step"]["over_bound"], 1.5, False, 1.0),
            check("commit + denoise step / its roofline bound", step_results["commit_and_denoise_step"]["over_bound"],
                  1.5, False, 1.0),
            check("denoising step / autoregressive step", denoise_over_ar, 1.5, False, bound_ratio,
                  "hardware bound = the ratio of the two roofline bounds"),
        ]
        emit({
            "benchmark": "forward_cost", "quick": args.quick,
            "config": {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                                              "moe_intermediate_size", "vocab_size")},
            "parameters": parameter_count(model.params), "dtype": str(model.dtype), "torch_threads": threads,
            "machine_rates": rates,
            "generate": {"prompt_tokens": args.prompt, "max_new_tokens": args.new, "rounds": args.rounds,
                         **generate_results, "clover_over_transformers_tokens_per_s": ar_over_transformers,
                         "same_tokens": same},
            "autoregressive_steady": {"seconds_per_token": per_token, "tokens": [short_tokens, long_tokens],
                                      "tokens_per_s": 1 / per_token if per_token > 0 else None,
                                      "bytes_per_token": ar_cost["bytes"], "bound": ar_bound,
                                      "fraction_of_bound": ratio(ar_bound["seconds"], per_token)},
            "step": {"prefix_tokens": args.prefix, "block": args.block, "rounds": args.step_rounds, **step_results,
                     "denoise_distinct_experts_per_layer": float(np.mean(distinct["denoise"])),
                     "coreset": config.moe_block_coreset_enabled, "denoise_over_autoregressive_step": denoise_over_ar,
                     "bound_ratio_denoise_over_autoregressive": bound_ratio,
                     "xla_cost_analysis": compiled_traffic(model, state, token, block)},
            "checks": checks, "machine": machine(),
        })
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
