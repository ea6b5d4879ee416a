"""Chunked prefill beside running requests: a long prompt arriving while others decode.

On the medium random model of `forward_cost.py` (4,096 positions), `--running` block-diffusion
requests decode (block size 16, long responses) in one engine. Measured, in one process:

* the running requests' time per pass without a prompt arriving (the engine's own pass log:
  `Engine.passes`), median over the passes of a window;
* then a prompt of `--prompt` tokens (3,968 by default) arrives, decoded autoregressively so that
  its first token comes with its prefill: the running requests' time per pass while it prefills
  (the passes from its arrival to its first token, each holding its chunk beside their steps), and
  its time to first token;
* the same prompt alone on the idle engine: its time to first token.

The engine precompiles its set first (`Engine.precompile`), so no pass waits on a compile.

Targets (docs/serving.md, "Continuous batching"): the running requests' time per pass while the
prompt prefills at most 2x their time without it, and the prompt's time to first token at most
2.5x its time alone. A CPU's pass costs about its rows, so the engine gives a prompt about as many
rows a pass as the running requests hold (`Engine(balance_prefill=...)`, on by default on a CPU);
both figures follow from that split. `--unbalanced` measures the whole prefill budget a pass beside
them instead (the engine's behaviour on a TPU or GPU), in the same run.

Usage: `python benchmarks/chunked_prefill.py [--running 8] [--prompt 3968] [--quick]`; prints JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, median, ratio, setup_environment, write_random_checkpoint  # noqa: E402

setup_environment()

STEP_TARGET, FIRST_TOKEN_TARGET = 2.0, 2.5


def measure(model, *, running: int, prompt: int, balance: bool, window: int) -> dict:
    """One engine: the running requests' passes without and with the prompt arriving, and the
    prompt's time to first token busy and alone."""
    import numpy as np

    from decoding.engine import Engine, EngineRequest

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    overrides = {"max_new_tokens": 512, "block_size": 16, "dllm_length_penalty": 0.0}
    background = [EngineRequest(rng.integers(2, vocab - 1, 64).tolist(), overrides=overrides, seed=k)
                  for k in range(running)]
    long = EngineRequest(rng.integers(2, vocab - 1, prompt).tolist(), "autoregressive",
                         overrides={"max_new_tokens": 2})
    with Engine(model, max_running=running + 1, block_sizes=[16], balance_prefill=balance) as engine:
        engine.precompile(["diffusion", "autoregressive"])  # no pass below waits on a compile
        handles = [engine.submit(request, lambda event: None) for request in background]
        deadline = time.monotonic() + 3600
        while engine.steps < 2 * window and time.monotonic() < deadline:  # compiled, and in their stride
            time.sleep(0.05)
        first = engine.steps
        while engine.steps < first + window and time.monotonic() < deadline:
            time.sleep(0.05)
        without = [record.seconds for record in list(engine.passes)[-window:] if not record.prompt_rows]
        arrived, first_token = time.monotonic(), threading.Event()
        stamp = {}

        def listen(event):
            if event.tokens and "at" not in stamp:
                stamp["at"] = time.monotonic()
                first_token.set()

        engine.submit(long, listen)
        first_token.wait(3600)
        during = [record for record in list(engine.passes)
                  if arrived <= record.start and record.start + record.seconds <= stamp["at"]]
        for handle in handles:
            handle.cancel()
        while engine.running():
            time.sleep(0.05)
        started = time.monotonic()
        engine.run([long], timeout=3600)
        alone = time.monotonic() - started
        compiled = engine.steps
    busy = stamp["at"] - arrived
    step_without, step_during = median(without), median([record.seconds for record in during])
    return {"balance_prefill": balance, "running": running, "prompt_tokens": prompt,
            "step_without_s": step_without, "step_during_prefill_s": step_during,
            "step_ratio": ratio(step_during, step_without), "passes_during_prefill": len(during),
            "prompt_rows_per_pass": [record.prompt_rows for record in during],
            "first_token_busy_s": busy, "first_token_alone_s": alone, "first_token_ratio": ratio(busy, alone),
            "passes": compiled, "compiled_on_demand": engine.compiled_on_demand}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=3968)
    parser.add_argument("--window", type=int, default=12, help="passes measured without the prompt")
    parser.add_argument("--unbalanced", action="store_true", help="also the whole prefill budget a pass")
    parser.add_argument("--quick", action="store_true", help="the small model, a 960-token prompt")
    args = parser.parse_args(argv)
    from benchmarks.forward_cost import MEDIUM, QUICK
    from clover_jax import CloverModel

    fields = QUICK if args.quick else MEDIUM
    prompt = 960 if args.quick else args.prompt
    with tempfile.TemporaryDirectory() as directory:
        model = CloverModel.from_pretrained(write_random_checkpoint(directory, fields)["clover"], progress=False)
        runs = [measure(model, running=args.running, prompt=prompt, balance=True, window=args.window)]
        if args.unbalanced:
            runs.append(measure(model, running=args.running, prompt=prompt, balance=False, window=args.window))
    balanced = runs[0]
    emit({"benchmark": "chunked_prefill", "model": "quick" if args.quick else "medium", "runs": runs,
          "checks": [check("chunked prefill: running requests' time per pass while a prompt prefills / without it",
                           balanced["step_ratio"], STEP_TARGET, at_least=False),
                     check("chunked prefill: the prompt's time to first token beside them / alone",
                           balanced["first_token_ratio"], FIRST_TOKEN_TARGET, at_least=False)],
          "machine": machine()})


if __name__ == "__main__":
    main()
