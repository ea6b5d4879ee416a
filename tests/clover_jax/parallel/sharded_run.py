"""Run the tiny Clover on a mesh and write its results as JSON; started by the sharding tests in a
fresh process, because the number of (fake) devices is fixed when JAX starts.

    python sharded_run.py CHECKPOINT OUT.json --mesh 1,8,1 [--mesh 2,2,2+int4-g16 ...] [--logits-only 1,1,8]
    python sharded_run.py CHECKPOINT OUT.json --mesh 2,2,2 --process 0 --processes 2 --port 12345

Each result holds the forward logits, the denoise logits, the generated tokens (None for a
`--logits-only` mesh: its decoding loop is not compiled), and, per parameter, the shape of the
first addressable shard (proof that the parameter is sharded) and the mesh axis each of its
dimensions is split over.
With several processes (`--processes`), each joins `jax.distributed` on 127.0.0.1 and reports
the bytes it read from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np

PROMPTS = [[5, 9, 17, 33, 2, 70], [44, 3, 8]]
BLOCK = [[12, 127, 127, 40], [127, 127, 7, 127]]
MASK_ID = 127


def generation_config():
    from decoding import GenerationConfig

    return GenerationConfig(max_new_tokens=12, block_size=4, threshold=0.6, eos_token_id=(1,),
                            mask_token_id=MASK_ID, do_sample=False)


def peaked(model):
    """The LM head scaled up, as in tests/decoding/conftest.py, so several tokens fill per step."""
    from clover_jax import CloverModel

    params = dict(model.params)
    params["lm_head"] = model.params["lm_head"] * 4.0
    return CloverModel(model.config, params, model.dtype, model.path, mesh_sharding=model.mesh_sharding, impl="xla")


def results(model, report_bytes: int | None = None, *, decode: bool = True) -> dict:
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    from decoding import generate

    gather = lambda array: np.asarray(multihost_utils.process_allgather(array, tiled=True))
    forward = gather(model.forward(np.asarray(PROMPTS[0])[None].repeat(2, 0)))
    denoise = gather(model.denoise_logits(np.asarray([PROMPTS[0][:4], PROMPTS[1] + [9]]), np.asarray(BLOCK)))
    out = generate(peaked(model), PROMPTS, generation_config(), progress=False) if decode else None
    arrays = {"/".join(path): leaf for path, leaf in _flat(model.params).items() if hasattr(leaf, "addressable_shards")}
    shards = {name: list(leaf.addressable_shards[0].data.shape) for name, leaf in arrays.items()}
    specs = {name: _mesh_axes(leaf) for name, leaf in arrays.items() if isinstance(leaf.sharding, NamedSharding)}
    return {"forward": forward.tolist(), "denoise": denoise.tolist(), "sequences": out and out.sequences,
            "nfe": out and out.nfe, "shard_shapes": shards, "mesh_axes": specs, "bytes_read": report_bytes}


def _mesh_axes(array) -> list:
    """The mesh axis (or None) each dimension of `array` is split over."""
    spec = list(array.sharding.spec)
    return spec + [None] * (array.ndim - len(spec))


def _flat(tree, path=()):
    if isinstance(tree, dict):
        flat = {}
        for key, value in tree.items():
            flat.update(_flat(value, path + (key,)))
        return flat
    return {path: tree}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--mesh", action="append", required=True,
                        help="data,expert,tensor, optionally @inference (the planner's rules, "
                             "clover_jax.parallel.planner.inference_rules) and +QUANTIZE (e.g. 2,2,2+int4-g16)")
    parser.add_argument("--logits-only", action="append", default=[],
                        help="a --mesh whose forward and denoise logits are computed but not its decoding")
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
    from clover_jax import CloverModel, make_mesh
    from clover_jax.parallel.planner import inference_rules
    from weights import loader

    read = {"bytes": 0}
    load_params = loader.load_params

    def counting_load_params(*a, **k):
        params, report = load_params(*a, **k)
        read["bytes"] = report.bytes_read
        return params, report

    loader.load_params = counting_load_params
    output = {}
    for mesh_text in args.mesh:
        shape, _, quantize = mesh_text.partition("+")
        shape, _, rules = shape.partition("@")
        data, expert, tensor = map(int, shape.split(","))
        chosen = inference_rules({"data": data, "expert": expert, "tensor": tensor}) if rules == "inference" else None
        model = CloverModel.from_pretrained(args.checkpoint, progress=False, impl="xla", quantize=quantize or None,
                                            mesh=make_mesh(data, expert, tensor), rules=chosen)
        output[mesh_text] = results(model, read["bytes"], decode=mesh_text not in args.logits_only)
    if args.process == 0 or args.processes > 1:
        with open(args.out if args.processes == 1 else f"{args.out}.{args.process}", "w") as handle:
            json.dump(output, handle)


if __name__ == "__main__":
    main()
