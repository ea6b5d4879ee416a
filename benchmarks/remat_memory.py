"""The compiler's temporaries of one train step under each `FinetuneConfig.remat` choice.

The step (`clover_jax.training.abstract_step`: both streams with the complementary copy, loss,
backward, AdamW) of a reduced model — Clover's layer pattern (3 GDN + 1 attention per group) at
`--layers` layers, hidden 512, vocabulary 32,768, 16 experts of 256, top-4 — for one device, full
fine-tuning or LoRA, compiled once per remat choice; `memory_analysis()` gives arguments and
temporaries. `--target v5e-1` compiles for a named target in the compile subprocess; the default
is this machine's XLA:CPU compiler (in this process).

Usage: `python benchmarks/remat_memory.py [--target v5e-1] [--seq-len 1024] [--layers 8] [--method full]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import emit, machine, setup_environment  # noqa: E402

setup_environment()

REDUCED = dict(
    model_type="clover_moe", vocab_size=32768, hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_conv_kernel_dim=4, moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16,
    num_experts_per_tok=4, full_attention_interval=4, mask_token_id=32767, eos_token_id=[32766],
    max_position_embeddings=131072, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--method", choices=("full", "lora"), default="full")
    parser.add_argument("--quick", action="store_true", help="4 layers, 256 tokens")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.seq_len = 4, 256

    from clover_jax.core.config import CloverConfig
    from clover_jax.nn.model import REMAT
    from clover_jax.training.config import FinetuneConfig

    config = CloverConfig.from_dict(dict(REDUCED, num_hidden_layers=args.layers))
    rows = []
    for remat in REMAT:
        finetune = FinetuneConfig(method=args.method, batch_size=args.batch, seq_len=args.seq_len, block_size=32,
                                  remat=remat)
        started = time.perf_counter()
        memory = _compile(config, finetune, args.target)
        rows.append({"remat": remat, "seconds": time.perf_counter() - started, "error": memory.error,
                     "argument_bytes": memory.argument_bytes, "temp_bytes": memory.temp_bytes,
                     "total_bytes": memory.total_bytes})
        print(f"remat_memory: {remat}: {memory}", file=sys.stderr)
    emit({"machine": machine(), "compiler": args.target or "XLA:CPU (this machine)", "layers": args.layers,
          "seq_len": args.seq_len, "batch": args.batch, "method": args.method, "rows": rows, "checks": []})


def _compile(config, finetune, target):
    if target is not None:
        import clover_jax

        plan = clover_jax.plan(config, target, task="train", config=finetune, compile=True, seq_lens=(),
                               remat_choices=(finetune.remat,))
        return plan.options[0].compiled["train_step"]
    from clover_jax.api.aot import ProgramMemory
    from clover_jax.core.kernels import choose_kernels
    from clover_jax.parallel.sharding import MeshSharding, make_mesh
    from clover_jax.training.abstract_step import abstract_step

    step = abstract_step(config, finetune, MeshSharding(make_mesh(1, 1, 1), config), choose_kernels("auto"),
                         compute_dtype="float32")
    analysis = step.jitted.lower(*step.args).compile().memory_analysis()
    return ProgramMemory(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes, analysis.output_size_in_bytes,
                         analysis.alias_size_in_bytes)


if __name__ == "__main__":
    main()
