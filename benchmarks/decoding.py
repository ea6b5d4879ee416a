"""Decoding speed side by side on one checkpoint: clover-jax block diffusion vs clover-jax
self-speculative vs clover-jax autoregressive vs `transformers` `generate` (greedy, with its
cache), on the same prompts.

Default checkpoint: the bundled trained tiny Clover (`clover_jax/bundled/tiny-clover`) with its
task (sorting digits, `clover_jax.training.tiny.sort_digits`), so accuracy is scored too. `--model DIR` takes
any `clover_moe` checkpoint; `--random` (or a missing bundled model) writes a tiny random Clover
checkpoint and uses random prompts (then tokens/s measure per-forward cost only: random weights
decide about one token per denoising step, and there is nothing to score).

Methods, each at batch 1 over every prompt in turn (the launch article's speeds are batch 1):
  * `clover_diffusion`: `decoding.generate(mode="diffusion")` with the checkpoint's
    generation_config.json (block size, threshold, controls);
  * `clover_autoregressive`: `generate(mode="autoregressive")`, greedy, with neutral controls
    (no penalties or biases) so that it does the work `transformers`' greedy search does;
  * `clover_self_speculative`: `generate(mode="self_speculative")` (a denoising pass drafts a
    block of the generation config's size, a causal pass verifies it), with the same neutral
    controls, so that its tokens must equal `clover_autoregressive`'s (it is lossless; checked);
  * `transformers`: `Qwen3_5MoeForCausalLM.from_pretrained` on a view of the same weights (config
    `model_type` `qwen3_5_moe_text`; the Clover block-mode tensors are not part of the causal
    backbone and transformers ignores them), `generate(do_sample=False, use_cache=True)`,
    float32, torch threads = cores. Its forward calls are counted with a forward hook.
All of them stop at the EOS ids and at the same max_new_tokens. One untimed warm-up pass over the
prompts compiles every shape bucket; then `--rounds` rounds alternate the methods (rotated
order) and each method's tokens/s is total response tokens / wall time of its pass; medians of
rounds. The JSON has per method: tokens/s, NFE (mean), tokens per forward (pooled), accuracy
(exact answer, when the task scorer applies), and the ratios between methods. Per mode it also
gives the host time per call outside the compiled program and the compiled call's time per
forward pass (its time over the call's NFE): the ratio of diffusion's to autoregressive's is
what a denoising forward costs against a causal one, fixed overheads included.

The bundled tiny Clover is trained on block diffusion and next-token prediction together
(`docs/tiny_model.md`), so every method's accuracy is scored.

Usage: `python benchmarks/decoding.py [--model DIR | --random] [--prompts 16] [--rounds 3] [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    alternate,
    backbone_view_for_transformers,
    check,
    emit,
    machine,
    ratio,
    setup_environment,
    torch_threads,
    write_random_checkpoint,
)

setup_environment()

import numpy as np  # noqa: E402

from clover_jax import bundled_model_path  # noqa: E402
from decoding.generation_config import NEUTRAL_CONTROLS  # noqa: E402

BUNDLED_DIR = str(bundled_model_path())
RANDOM_FIELDS = dict(vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                     num_experts_per_tok=2, eos_token_id=1, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

CEILING_KIND = "fixed-cost ceiling"
CEILING_NOTE = ("bound: the figure if every diffusion forward cost an autoregressive step (prefill and host time as "
                "measured; `diffusion_ceiling`)")


def host_overhead(generate, model, prompts, config, mode: str, extra: dict, new: int, rounds: int = 3) -> dict:
    """Seconds per one-prompt `generate` call spent outside its compiled decoding program (argument
    preparation, transfers, result conversion): the call's wall time minus the compiled call's; and
    the compiled call's time per forward pass (its time over the call's NFE). `per_prompt` keeps,
    for each prompt, the medians over rounds (seconds) with the call's NFE and response tokens."""
    import time

    import jax

    from decoding import layouts

    name = {"diffusion": "run_block_decoder", "autoregressive": "run_autoregressive",
            "self_speculative": "run_self_speculative"}[mode]
    compiled, inside = getattr(layouts, name), []

    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        result = jax.block_until_ready(compiled(*args, **kwargs))
        inside.append(time.perf_counter() - started)
        return result

    setattr(layouts, name, timed_call)
    samples = [{"outside": [], "inside": []} for _ in prompts]
    try:
        outside, per_forward = [], []
        for _ in range(rounds):
            for prompt, sample in zip(prompts, samples, strict=True):
                started = time.perf_counter()
                out = generate(model, [prompt], config, mode=mode, max_new_tokens=new, **extra)
                outside.append(time.perf_counter() - started - inside[-1])
                per_forward.append(inside[-1] / max(out.nfe[0], 1))
                sample["outside"].append(outside[-1])
                sample["inside"].append(inside[-1])
                sample["nfe"], sample["tokens"] = int(out.nfe[0]), len(out.sequences[0])
    finally:
        setattr(layouts, name, compiled)
    per_prompt = [{"outside": float(np.median(sample["outside"])), "inside": float(np.median(sample["inside"])),
                   "nfe": sample["nfe"], "tokens": sample["tokens"]} for sample in samples]
    return {"median_ms": 1e3 * float(np.median(outside)), "min_ms": 1e3 * float(np.min(outside)),
            "compiled_call_median_ms": 1e3 * float(np.median(inside)),
            "compiled_ms_per_forward": 1e3 * float(np.median(per_forward)), "per_prompt": per_prompt}


def diffusion_ceiling(diffusion: dict, autoregressive: dict, first_token: dict) -> dict:
    """What the two bundled-model ratios would read if every diffusion forward cost no more than an
    autoregressive step, from the calls measured per prompt (`host_overhead`'s `per_prompt`).

    An autoregressive call = its fixed part F (prefill and first token: the call with
    max_new_tokens=1, `first_token`) + (NFE - 1) steps of s = (call - F) / (NFE - 1). The ideal
    diffusion call is F + NFE_diffusion * s: its prefill as cheap as the autoregressive one and
    each of its forwards an autoregressive step; its host time is the measured one. On a model this
    small F and the host time are most of a short response's time, so they bound both ratios,
    however cheap a block forward becomes."""
    ideal_seconds, ideal_per_forward, ar_seconds, ar_per_forward = 0.0, [], 0.0, []
    for d, a, f in zip(diffusion["per_prompt"], autoregressive["per_prompt"], first_token["per_prompt"], strict=True):
        step = (a["inside"] - f["inside"]) / (a["nfe"] - 1) if a["nfe"] > 1 else a["inside"]
        ideal_call = f["inside"] + d["nfe"] * step
        ideal_seconds += d["outside"] + ideal_call
        ideal_per_forward.append(ideal_call / max(d["nfe"], 1))
        ar_seconds += a["outside"] + a["inside"]
        ar_per_forward.append(a["inside"] / max(a["nfe"], 1))
    diffusion_tokens = sum(d["tokens"] for d in diffusion["per_prompt"])
    ar_tokens = sum(a["tokens"] for a in autoregressive["per_prompt"])
    return {"tokens_per_s_ratio": (diffusion_tokens / ideal_seconds) / (ar_tokens / ar_seconds),
            "forward_cost_ratio": float(np.median(ideal_per_forward) / np.median(ar_per_forward)),
            "autoregressive_fixed_ms": 1e3 * float(np.median([f["inside"] for f in first_token["per_prompt"]])),
            "host_ms": 1e3 * float(np.median([d["outside"] for d in diffusion["per_prompt"]]))}


def bundled_ready(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "model.safetensors"))


def task_prompts(path: str, count: int):
    """(prompts, scorer) for the bundled task, or (None, None) when the checkpoint has no tokenizer
    or the task module is missing."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None, None
    try:
        from tokenizers import Tokenizer

        from clover_jax.training.tiny.recipe import Recipe
    except ImportError:
        return None, None
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    task = Recipe().task
    problems = task.held_out(count)
    prompts = [task.encode(tokenizer, problem).prompt for problem in problems]

    def score(sequences):
        texts = [tokenizer.decode(seq, skip_special_tokens=False) for seq in sequences]
        return float(np.mean([task.is_correct(problem, text) for problem, text in zip(problems, texts, strict=True)]))

    return prompts, score


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=BUNDLED_DIR, help="a clover_moe checkpoint directory")
    parser.add_argument("--random", action="store_true", help="use a tiny random Clover checkpoint")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: the checkpoint's generation_config.json, else 32")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.rounds = 2, 1

    import jax
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    from clover_jax import CloverModel
    from decoding import GenerationConfig, generate
    from decoding.modes import MODES, strategy

    threads = torch_threads()
    workdir = tempfile.mkdtemp(prefix="clover-bench-decoding-")
    notes = []
    try:
        path = args.model
        if args.random or not bundled_ready(path):
            if not args.random:
                notes.append(f"{path} has no checkpoint yet: ran on a tiny random Clover checkpoint instead")
            path = write_random_checkpoint(workdir, RANDOM_FIELDS, seed=0)["clover"]
        prompts, score = task_prompts(path, args.prompts)
        if prompts is None:
            rng = np.random.default_rng(0)
            vocab = CloverModel.from_pretrained(path, progress=False).config.vocab_size
            prompts = [rng.integers(2, vocab - 1, int(rng.integers(12, 40))).tolist() for _ in range(args.prompts)]

        model = CloverModel.from_pretrained(path, progress=False)
        config = GenerationConfig.from_pretrained(path)
        new = args.max_new_tokens or config.max_new_tokens or 32
        eos = list(config.eos_token_id or model.config.eos_token_id or [])
        hf = Qwen3_5MoeForCausalLM.from_pretrained(backbone_view_for_transformers(path, os.path.join(workdir, "hf")),
                                                   dtype=torch.float32).eval()
        forward_calls = [0]
        hf.register_forward_hook(lambda *_: forward_calls.__setitem__(0, forward_calls[0] + 1))

        def run_clover(mode):
            def run():
                out = {"sequences": [], "nfe": []}
                for prompt in prompts:
                    extra = {} if strategy(mode).whole_blocks else NEUTRAL_CONTROLS
                    result = generate(model, [prompt], config, mode=mode, max_new_tokens=new, **extra)
                    out["sequences"].append(result.sequences[0])
                    out["nfe"].append(result.nfe[0])
                return out
            return run

        def run_transformers():
            out = {"sequences": [], "nfe": []}
            with torch.inference_mode():
                for prompt in prompts:
                    forward_calls[0] = 0
                    ids = torch.tensor([prompt])
                    generated = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                            do_sample=False, use_cache=True, eos_token_id=eos or None,
                                            pad_token_id=eos[0] if eos else 0)
                    response = generated[0, len(prompt):].tolist()
                    cut = next((n + 1 for n, token in enumerate(response) if token in eos), len(response))
                    out["sequences"].append(response[:cut])
                    out["nfe"].append(forward_calls[0])
            return out

        methods = {"clover_diffusion": run_clover("diffusion"), "clover_autoregressive": run_clover("autoregressive"),
                   "clover_self_speculative": run_clover("self_speculative"), "transformers": run_transformers}
        timings = alternate(methods, args.rounds)
        results = {}
        for name, timing in timings.items():
            last = timing["last"]
            tokens = sum(len(s) for s in last["sequences"])
            per_round = [tokens / seconds for seconds in timing["samples"]]
            results[name] = {
                "tokens_per_s": float(np.median(per_round)), "tokens_per_s_samples": per_round,
                "seconds_per_pass": timing["median"], "response_tokens": tokens,
                "mean_response_tokens": tokens / len(prompts),
                "mean_nfe": float(np.mean(last["nfe"])),
                "tokens_per_forward": tokens / max(sum(last["nfe"]), 1),
                "accuracy": score(last["sequences"]) if score else None,
            }
        overhead = {mode: host_overhead(generate, model, prompts, config, mode,
                                        {} if strategy(mode).whole_blocks else NEUTRAL_CONTROLS, new)
                    for mode in MODES}
        first_token = host_overhead(generate, model, prompts, config, "autoregressive", NEUTRAL_CONTROLS, 1)
        ceiling = diffusion_ceiling(overhead["diffusion"], overhead["autoregressive"], first_token)
        ar, tf = timings["clover_autoregressive"]["last"], timings["transformers"]["last"]
        agreement = float(np.mean([a == b for a, b in zip(ar["sequences"], tf["sequences"], strict=True)]))
        speculative = timings["clover_self_speculative"]["last"]
        lossless = float(np.mean([a == b for a, b in zip(speculative["sequences"], ar["sequences"], strict=True)]))
        speed = {name: value["tokens_per_s"] for name, value in results.items()}
        forward_cost_ratio = ratio(overhead["diffusion"]["compiled_ms_per_forward"],
                                   overhead["autoregressive"]["compiled_ms_per_forward"])
        emit({
            "benchmark": "decoding", "quick": args.quick, "checkpoint": path if path.startswith(REPO_ROOT) else
            ("random tiny Clover (" + ", ".join(
                f"{k}={RANDOM_FIELDS[k]}" for k in ("hidden_size", "num_hidden_layers", "num_experts", "vocab_size"))
             + ")"),
            "task_scored": score is not None, "prompts": len(prompts), "rounds": args.rounds, "max_new_tokens": new,
            "generation_config": {"block_size": config.block_size, "threshold": config.threshold},
            "dtype": str(model.dtype), "torch_threads": threads, "results": results,
            "ratios": {
                "diffusion_over_clover_autoregressive_tokens_per_s": ratio(speed["clover_diffusion"],
                                                                           speed["clover_autoregressive"]),
                "diffusion_over_transformers_tokens_per_s": ratio(speed["clover_diffusion"], speed["transformers"]),
                "clover_autoregressive_over_transformers_tokens_per_s": ratio(speed["clover_autoregressive"],
                                                                              speed["transformers"]),
                "self_speculative_over_clover_autoregressive_tokens_per_s": ratio(speed["clover_self_speculative"],
                                                                                  speed["clover_autoregressive"]),
                "diffusion_forward_over_autoregressive_forward_ms": forward_cost_ratio,
            },
            "clover_autoregressive_equals_transformers_fraction": agreement,
            "self_speculative_equals_clover_autoregressive_fraction": lossless,
            "host_overhead_per_call": {mode: {key: value for key, value in figures.items() if key != "per_prompt"}
                                       for mode, figures in overhead.items()},
            "ceiling_if_a_diffusion_forward_cost_an_autoregressive_step": ceiling,
            "checks": [
                check("bundled model: diffusion / clover autoregressive tokens/s",
                      ratio(speed["clover_diffusion"], speed["clover_autoregressive"]), 2.5, True,
                      bound=ceiling["tokens_per_s_ratio"], note=CEILING_NOTE,
                      bound_kind=CEILING_KIND),
                check("bundled model: diffusion accuracy", results["clover_diffusion"]["accuracy"], 0.95, True,
                      note="the quality gate of the bundled model"),
                check("bundled model: diffusion forward / autoregressive forward (compiled call time / NFE)",
                      forward_cost_ratio, 2.0, False, bound=ceiling["forward_cost_ratio"],
                      note=CEILING_NOTE, bound_kind=CEILING_KIND),
                check("host time per one-prompt generate call outside the compiled loop, ms (diffusion)",
                      overhead["diffusion"]["median_ms"], 1.0, False),
                check("bundled model: self-speculative tokens/s is reported", speed["clover_self_speculative"], 0.0,
                      True),
                check("bundled model: self-speculative tokens == clover autoregressive tokens (fraction of prompts)",
                      lossless, 1.0, True, note="lossless: greedy self-speculative decoding emits the autoregressive "
                                                "tokens"),
            ] if score else [],
            "notes": notes, "jax_devices": [str(d) for d in jax.devices()], "machine": machine(),
        })
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
