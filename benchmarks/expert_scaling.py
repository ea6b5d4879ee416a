"""The same model with 8 and with 64 routed experts (top-8 both, hidden 512, 8 layers): does a
decoding step cost what it routes to, or what the layer holds?

Two random checkpoints that differ only in `num_experts` decode side by side:
  * autoregressive `generate` tokens/s (each token routes to 8 experts in either model);
  * one denoising step of a block of 32 masks after a 256-token prefix, coreset on (the step reads
    the coreset's experts: all 8 of the small model, the coreset of 64 in the large one), with
    the distinct experts it used and its roofline bound (`benchmarks/cost_model.py`).

Targets (`checks`): the 64-expert model's autoregressive tokens/s >= 0.85x the 8-expert model's,
and its denoising step likewise (step time of 8 / step time of 64 >= 0.85). The hardware bound of
each ratio comes from the same cost model: what a step must read and compute in each model.

Usage: `python benchmarks/expert_scaling.py [--quick] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternate, check, emit, machine, ratio, setup_environment, write_random_checkpoint  # noqa: E402

setup_environment()

import numpy as np  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
BASE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=128, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_conv_kernel_dim=4, moe_intermediate_size=256,
            shared_expert_intermediate_size=256, num_experts_per_tok=8, eos_token_id=1,
            tie_word_embeddings=False, max_position_embeddings=4096, rope_parameters=ROPE)
QUICK = dict(BASE, vocab_size=512, hidden_size=128, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
             moe_intermediate_size=64, shared_expert_intermediate_size=64)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: small widths, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experts", type=int, nargs=2, default=[8, 64])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else BASE
    if args.quick:
        args.rounds, args.new, args.prefix = 1, 8, 32

    import jax

    from benchmarks import cost_model, machine_rates
    from clover_jax import CloverModel
    from decoding import generate

    rates = machine_rates.measure()
    workdir = tempfile.mkdtemp(prefix="clover-bench-experts-")
    try:
        models = {}
        for experts in args.experts:
            fields = dict(base, num_experts=experts)
            path = write_random_checkpoint(os.path.join(workdir, str(experts)), fields, seed=0,
                                           mask_token_id=fields["vocab_size"] - 1)["clover"]
            models[experts] = CloverModel.from_pretrained(path, progress=False)
        rng = np.random.default_rng(0)
        prompt = rng.integers(2, base["vocab_size"] - 1, 64).tolist()
        prefix = rng.integers(2, base["vocab_size"] - 1, (1, args.prefix)).astype(np.int32)

        def decode(model):
            return lambda: generate(model, [prompt], mode="autoregressive", max_new_tokens=args.new).sequences[0]

        states, distinct = {}, {}
        for experts, model in models.items():
            state = model.init_state(1, args.prefix + args.block)
            _, states[experts] = model.extend(state, prefix, logits="none")
        block = np.full((1, args.block), base["vocab_size"] - 1, np.int32)

        def step(experts):
            def run():
                out = models[experts].denoise(states[experts], block)
                jax.block_until_ready(out.logits)
                distinct[experts] = np.asarray(out.distinct_experts)[:, 0]
            return run

        low, high = args.experts
        ar = alternate({e: decode(m) for e, m in models.items()}, args.rounds)
        steps = alternate({e: step(e) for e in models}, args.rounds * 3)
        results = {}
        for experts, model in models.items():
            tokens = len(ar[experts]["last"])
            ar_cost = cost_model.pass_cost(model.config, 1, 0, 96, base["num_experts_per_tok"], 1)
            step_cost = cost_model.pass_cost(model.config, 0, args.block, args.prefix, distinct[experts], args.block)
            results[experts] = {
                "autoregressive_tokens_per_s": tokens / ar[experts]["median"], "response_tokens": tokens,
                "denoise_step_ms": 1e3 * steps[experts]["median"],
                "denoise_distinct_experts_per_layer": float(np.mean(distinct[experts])),
                "autoregressive_bound": cost_model.bound(ar_cost, rates),
                "denoise_bound": cost_model.bound(step_cost, rates)}
        ar_ratio = ratio(results[high]["autoregressive_tokens_per_s"], results[low]["autoregressive_tokens_per_s"])
        step_ratio = ratio(results[low]["denoise_step_ms"], results[high]["denoise_step_ms"])
        ar_bound = ratio(results[low]["autoregressive_bound"]["seconds"],
                         results[high]["autoregressive_bound"]["seconds"])
        step_bound = ratio(results[low]["denoise_bound"]["seconds"], results[high]["denoise_bound"]["seconds"])
        checks = [
            check(f"autoregressive tokens/s, {high} / {low} experts", ar_ratio, 0.85, True, ar_bound),
            check(f"denoising step (coreset) speed, {high} / {low} experts", step_ratio, 0.85, True, step_bound),
        ]
        emit({"benchmark": "expert_scaling", "quick": args.quick, "machine_rates": rates,
              "config": {k: base[k] for k in ("hidden_size", "num_hidden_layers", "num_experts_per_tok",
                                              "moe_intermediate_size", "vocab_size")},
              "experts": args.experts, "rounds": args.rounds, "results": {str(k): v for k, v in results.items()},
              "autoregressive_speed_ratio": ar_ratio, "denoise_speed_ratio": step_ratio, "checks": checks,
              "machine": machine()})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
