"""Training speed: the one-pass objective against the same objective on one block per example.

Both run the real train step (`clover_jax.training.step.train_step`: forward, backward, AdamW) on
the medium random model (`forward_cost.MEDIUM`: 2 x (3 GDN + 1 attention), hidden 1024, 32 experts
top-8), the same batch of rows (each row one example of `--seq-len` random tokens, every token
trained), block 32:

* one pass (the default objective): the clean stream and every block twice (the masked copy and
  its complement), so every token is a masked diffusion target once and a next-token target;
* one block per example (`max_noisy_blocks=1`, no complementary copy, 1/t weighting): the clean
  stream and one noisy block per example.

The figure is masked diffusion targets per second, medians of `--rounds` alternating rounds after a
compiling warm-up; target: the one pass at least 4x the one-block objective. Its accounting ceiling
is the ratio if a step's time were proportional to the rows it runs (clean + noisy):
(L / 3L) / ((B/2) / (L + B)), about 11 at L = 512, B = 32. (Next-token targets are not counted:
both objectives take the same ones from the same clean stream.) The step's time is also set against
its roofline bound on this machine: the compiled step's FLOPs (XLA's cost analysis) over the
measured matmul rate.

Usage: python benchmarks/training.py [--quick]   (JSON on stdout)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import alternate, check, emit, machine, ratio, setup_environment, write_random_checkpoint  # noqa: E402

setup_environment()

import numpy as np  # noqa: E402

TARGET = 4.0  # masked diffusion targets/s, one pass over one block per example


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small QUICK model, 2 rounds")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.forward_cost import MEDIUM, QUICK
    from benchmarks.machine_rates import matmul_rate
    from clover_jax import CloverModel
    from clover_jax.training.batches import Normalisers, TrainRows, choose_blocks, normalisers
    from clover_jax.training.config import FinetuneConfig
    from clover_jax.training.packing import PackedRows
    from clover_jax.training.state import OptimizerSettings, init_state
    from clover_jax.training.step import StepProgram, train_step
    from clover_jax.training.train_sharding import place
    from clover_jax.training.trainer import placed_state, training_mesh, training_mesh_sharding

    fields = QUICK if args.quick else MEDIUM
    rounds = 2 if args.quick else args.rounds
    length, block = args.seq_len, args.block_size
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as workdir:
        paths = write_random_checkpoint(workdir, fields, seed=0, clover=True, mask_token_id=fields["vocab_size"] - 1)
        model = CloverModel.from_pretrained(paths["clover"], progress=False)
    shape = (args.batch, length)
    ids = rng.integers(0, fields["vocab_size"] - 1, shape).astype(np.int32)
    packed = PackedRows(ids, np.ones(shape, np.int32), ids, np.ones(shape, bool), np.ones(shape, bool),
                        np.ones(args.batch, np.int32))
    mesh_sharding = training_mesh_sharding(training_mesh(FinetuneConfig()), model.config)
    module = model.module.clone(mesh_sharding=mesh_sharding)
    runs = {}
    for name, limit, complementary in (("one_pass", None, True), ("one_block_per_example", 1, False)):
        config = FinetuneConfig(steps=100, batch_size=args.batch, seq_len=length, block_size=block,
                                complementary=complementary, max_noisy_blocks=limit, learning_rate=1e-5)
        program = StepProgram.of(config, module, block_size=block, compute_dtype="float32")
        width = length // block if limit is None else 1
        blocks = choose_blocks(packed, np.arange(args.batch), block_size=block, width=width, max_noisy_blocks=limit,
                               rng=np.random.default_rng(1))
        rows = TrainRows(*packed[:5], blocks)
        norm = normalisers(rows, block)
        # a copy per run: the step donates its state, and the state would otherwise share the model's arrays
        state, layout, _ = placed_state(mesh_sharding, init_state(OptimizerSettings.of(config),
                                                                  jax.tree.map(jnp.copy, model.params)), None, rows)
        placed = (place(rows, layout.rows), jax.jit(lambda: jax.random.key(0), out_shardings=layout.replicated)(),
                  place(norm, Normalisers(layout.replicated, layout.replicated)),
                  place(np.float32(model.config.moe_block_coreset_top_p), layout.replicated))
        step = train_step(program, layout)
        holder = {"state": state}

        def run(step=step, placed=placed, holder=holder):
            holder["state"], metrics = step(holder["state"], *placed, None)
            return jax.block_until_ready(metrics)

        compiled = step.lower(holder["state"], *placed, None).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        masked_targets = float(norm.loss_tokens)  # once per pair with the complement; ~t of them without
        runs[name] = {"run": run, "flops": float(cost.get("flops", 0.0)), "next_token_targets": float(norm.next_tokens),
                      "noisy_rows": int(blocks.shape[1]) * block * (2 if complementary else 1),
                      "loss_tokens": masked_targets}
    timings = alternate({name: spec["run"] for name, spec in runs.items()}, rounds)
    rate = matmul_rate()
    report = {}
    for name, spec in runs.items():
        metrics = jax.device_get(timings[name]["last"])
        seconds = timings[name]["median"]
        masked = float(metrics["masked_tokens"])
        # masked diffusion targets of the timed step: every loss token with the complement; the drawn
        # fraction t of one block's without it (its mean, t ~ U, is half the block)
        diffusion = spec["loss_tokens"] if name == "one_pass" else masked
        report[name] = {"seconds_median": seconds, "samples": timings[name]["samples"], "flops": spec["flops"],
                        "roofline_seconds": spec["flops"] / rate, "noisy_rows": spec["noisy_rows"],
                        "diffusion_targets": diffusion, "next_token_targets": spec["next_token_targets"],
                        "diffusion_targets_per_second": diffusion / seconds}
    one, base = report["one_pass"], report["one_block_per_example"]
    clean = args.batch * length
    ceiling = (clean / (clean + one["noisy_rows"] * args.batch)) / (
        (args.batch * block / 2) / (clean + base["noisy_rows"] * args.batch))
    speedup = ratio(one["diffusion_targets_per_second"], base["diffusion_targets_per_second"])
    checks = [check("training: masked diffusion targets/s, one pass / one block per example", speedup, TARGET, True,
                    bound=ceiling, bound_kind="accounting ceiling")]
    emit({"benchmark": "training", "machine": machine(), "model": "QUICK" if args.quick else "MEDIUM",
          "seq_len": length, "block_size": block, "batch": args.batch, "rounds": rounds, "matmul_rate": rate,
          "runs": report, "step_over_roofline": one["seconds_median"] / one["roofline_seconds"],
          "diffusion_targets_ratio": speedup,
          "checks": checks})


if __name__ == "__main__":
    main()
