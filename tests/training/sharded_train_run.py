"""Train the tiny Clover on meshes of fake CPU devices and on one device, and save what each run
computed; started by tests/training/test_sharded_training.py in a fresh process, because the
number of devices is fixed when JAX starts.

    python sharded_train_run.py CHECKPOINT OUT --run one+curve --run 1,8,1 --run 2,2,2+curve --run 2,2,2+lora
    python sharded_train_run.py CHECKPOINT OUT --run 2,2,2+curve+nograds --process 0 --processes 2 --port 12345

OUT.npz holds, per run ("one": one device, else the mesh; "+lora": a LoRA run): the loss and the
gradient of every trained leaf at the first state (`step.batch_gradients`); with "+curve" also
the loss curve of `--steps` optimizer steps through the trainer's loop (`loop.run_loop`) and the
parameters after them ("+nograds": the curve alone). OUT.json: the mesh axes of each parameter
and AdamW moment. With several processes, each joins `jax.distributed` on 127.0.0.1 and writes
OUT.<process>.npz.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging

import numpy as np

MASK_ID = 127
BATCH, LENGTH, BLOCK = 8, 16, 4


def batch_rows(step: int):
    """A batch of 8 packed rows of 16 tokens: two examples in the even rows, one in the odd ones;
    prompts (the first 3 tokens of each example) untrained."""
    from clover_jax.training.batches import TrainRows

    rng = np.random.RandomState(step)
    clean = rng.randint(2, MASK_ID, (BATCH, LENGTH)).astype(np.int32)
    segment = np.ones((BATCH, LENGTH), np.int32)
    segment[::2, 8:] = 2
    maskable = np.ones((BATCH, LENGTH), bool)
    maskable[:, :3] = False
    maskable[::2, 8:11] = False
    blocks = np.tile(np.arange(LENGTH // BLOCK, dtype=np.int32), (BATCH, 1))
    return TrainRows(clean, segment, clean.copy(), maskable, maskable.copy(), blocks)


class Batches:
    """The trainer's batch source (`dataset.BatchIterator`'s interface), one fixed batch per step."""

    def __init__(self):
        from clover_jax.training.batches import DataPosition

        self.position = DataPosition(0, (0,))

    def next(self):
        from clover_jax.training.batches import Batch, DataPosition

        step = self.position.step
        self.position = DataPosition(step + 1, (0,))
        return Batch(BLOCK, batch_rows(step))


def run(model, mesh_sizes, *, lora: bool, steps: int, gradients: bool = True,
        offload: bool = False) -> tuple[dict, dict]:
    """(arrays, mesh axes) of one run: on one device (`mesh_sizes` None: a 1x1x1 mesh) or on a mesh;
    `offload`: the LoRA base's layers in host memory (with "layer" remat, as `offload_base` needs)."""
    import jax

    from clover_jax.adapters import lora as lora_params
    from clover_jax.training import trainer
    from clover_jax.training.batches import Normalisers, normalisers
    from clover_jax.training.config import FinetuneConfig
    from clover_jax.training.loop import LoopRun, run_loop
    from clover_jax.training.outputs import on_host
    from clover_jax.training.state import OptimizerSettings, compute_base, init_state
    from clover_jax.training.step import StepProgram, batch_gradients
    from clover_jax.training.train_sharding import place

    config = FinetuneConfig(method="lora" if lora else "full", steps=max(steps, 1), batch_size=BATCH, seq_len=LENGTH,
                            block_size=BLOCK, learning_rate=1e-3, warmup_steps=0, log_every=1, mesh=mesh_sizes,
                            lora_rank=8, lora_alpha=16.0,
                            lora_targets=("attention", "gdn", "shared_expert", "routed_experts"),
                            offload_base=offload, remat="layer" if offload else "none")
    mesh_sharding = trainer.training_mesh_sharding(trainer.training_mesh(config), model.config)
    program = StepProgram.of(config, model.module.clone(mesh_sharding=mesh_sharding), block_size=BLOCK,
                             compute_dtype="float32")
    # a copy: the step donates the state, and every run starts from the model's parameters
    spec, frozen, trained = program.lora, None, jax.tree_util.tree_map(np.array, model.params)
    if lora:
        trained = lora_params.init_trainable(model.params, model.config, spec, jax.random.key(0))
        # B starts at zero; a drawn B makes the adapters' gradients depend on both factors
        trained = jax.tree_util.tree_map_with_path(
            lambda path, leaf: leaf + 0.05 * jax.random.normal(jax.random.key(len(str(path))), leaf.shape)
            if str(path).endswith("['b']") else leaf, trained)
        frozen = compute_base(model.params, "float32")
    rows = batch_rows(0)
    state, layout, frozen = trainer.placed_state(mesh_sharding, init_state(OptimizerSettings.of(config), trained),
                                                 frozen, rows, offload_base=offload)
    replicated = layout.replicated
    gradient_step = jax.jit(functools.partial(batch_gradients, program=program),
                            in_shardings=(layout.state.params, replicated, layout.rows, replicated, replicated,
                                          replicated, layout.frozen),
                            out_shardings=(layout.state.params, replicated))
    key = jax.jit(lambda: jax.random.key(config.seed), out_shardings=replicated)()
    norm = place(normalisers(rows, BLOCK), Normalisers(replicated, replicated))
    top_p = place(np.float32(model.config.moe_block_coreset_top_p), replicated)
    arrays = {}
    if gradients:
        grads, parts = gradient_step(state.params, state.step, place(rows, layout.rows), key, norm, top_p, frozen)
        arrays["loss"] = on_host(parts.loss)
        arrays.update({f"grad/{name}": value for name, value in _flat(on_host(grads)).items()})
    if steps:
        config = dataclasses.replace(config, steps=steps)
        state, history = run_loop(state, Batches(), LoopRun({BLOCK: program}, layout, frozen,
                                                            model.config.moe_block_coreset_top_p), config,
                                  progress=False)
        arrays["curve"] = np.asarray([record["loss"] for record in history])
        arrays["grad_norms"] = np.asarray([record["grad_norm"] for record in history])
        arrays.update({f"param/{name}": value for name, value in _flat(on_host(state.params)).items()})
    axes = {}
    if mesh_sizes is not None:
        for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]:
            spec = list(leaf.sharding.spec) + [None] * (leaf.ndim - len(leaf.sharding.spec))
            axes[jax.tree_util.keystr(path)] = [list(a) if isinstance(a, tuple) else a for a in spec]
        if frozen is not None:
            axes["frozen memory"] = {jax.tree_util.keystr(path): leaf.sharding.memory_kind
                                     for path, leaf in jax.tree_util.tree_flatten_with_path(frozen)[0]}
    return arrays, axes


def _flat(tree) -> dict:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--run", action="append", required=True,
                        help="'one' or data,expert,tensor; +lora: a LoRA run; +curve: also --steps steps; "
                             "+nograds: no gradients at the first state; +offload: the LoRA base in host memory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--process", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import jax

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                                   process_id=args.process)
    from clover_jax import CloverModel

    model = CloverModel.from_pretrained(args.checkpoint, progress=False, impl="xla")
    arrays, axes = {}, {}
    for name in args.run:
        where, *options = name.split("+")
        sizes = None if where == "one" else tuple(map(int, where.split(",")))
        result, axes[name] = run(model, sizes, lora="lora" in options, steps=args.steps if "curve" in options else 0,
                                 gradients="nograds" not in options, offload="offload" in options)
        arrays.update({f"{name}|{key}": value for key, value in result.items()})
    out = args.out if args.processes == 1 else f"{args.out}.{args.process}"
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as handle:
        json.dump(axes, handle)


if __name__ == "__main__":
    main()
