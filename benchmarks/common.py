"""Helpers shared by the benchmark scripts: environment, side-by-side timing, machine facts,
random checkpoints, JSON output.

Timing policy (every script): methods compared with each other are run in alternation within
one process — round r runs them in an order rotated by r — after an untimed warm-up call that
compiles; the reported figure is the median over rounds, with every sample kept in the JSON.
Compile time is never inside a timed sample (it is measured on its own in `compile.py`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_environment() -> None:
    """Call before importing jax or torch: CPU JAX, repository on the path, torch threads that
    sleep instead of spinning (torch's OpenMP workers spin-wait after each op and starve XLA's
    threads on a small machine, see docs/performance.md, "Notes for CPU users")."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def torch_threads() -> int:
    """Set torch's intra-op threads to the core count (the same cores XLA uses); returns it."""
    import torch

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    return threads


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call; the callee must block until its result is ready."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def alternate(methods: dict[str, Callable[[], Any]], rounds: int, warmup: bool = True) -> dict[str, dict]:
    """Run `methods` side by side: optional untimed warm-up of each, then `rounds` rounds, each
    running every method once in an order rotated by the round number.

    returns {name: {"median": s, "samples": [s, ...], "last": the last call's result}}
    """
    names = list(methods)
    if warmup:
        for name in names:
            methods[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, Any] = {}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, last[name] = timed(methods[name])
            samples[name].append(seconds)
    return {name: {"median": statistics.median(samples[name]), "samples": samples[name], "last": last.get(name)}
            for name in names}


def ratio(numerator: float, denominator: float) -> float | None:
    return None if not denominator else numerator / denominator


def check(name: str, value: float | None, target: float, at_least: bool, bound: float | None = None,
          note: str = "", bound_kind: str = "roofline") -> dict:
    """A target figure of `make bench`: `value` must be >= (`at_least`) or <= `target`.

    bound: the figure this machine would show if every pass in it ran exactly at its roofline
    bound (bytes / measured bandwidth, FLOPs / measured matmul rate), when the benchmark can
    work it out. For a time against its own bound that is the best possible value; for a ratio
    of two times it is the ratio of their bounds, not a limit on the ratio, so a target beyond
    it is reported as "not met at the roofline" (the check still fails when the target is missed).
    bound_kind: what `bound` is when it is not a roofline bound (a measured ceiling, e.g. "batching
    ceiling"); the report names it.
    """
    passed = value is not None and (value >= target if at_least else value <= target)
    met_at_roofline = None if bound is None else (bound >= target if at_least else bound <= target)
    return {"name": name, "value": value, "target": target, "direction": ">=" if at_least else "<=",
            "passed": passed, "at_roofline": bound, "met_at_roofline": met_at_roofline, "note": note,
            "bound_kind": bound_kind}


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, RAM, load, library versions, date."""
    import jax

    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram_bytes = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    ram_bytes = int(line.split()[1]) * 1024
    except OSError:
        pass
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for name in ("jaxlib", "flax", "torch", "transformers", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # not installed: leave it out
            pass
    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "ram_gib": None if ram_bytes is None else round(ram_bytes / 2**30, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def emit(result: dict[str, Any]) -> None:
    """Print the script's one JSON object on stdout (last line, so a driver can parse it)."""
    print(json.dumps(result, default=_jsonable))


def _jsonable(value):
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:
        pass
    return str(value)


def write_random_checkpoint(directory: str, fields: dict[str, Any], seed: int = 0, clover: bool = True,
                            mask_token_id: int | None = None) -> dict[str, str]:
    """A random Qwen3.5-MoE checkpoint written by `transformers`' `save_pretrained` (the tests'
    writer: every weight redrawn so activations are O(1)) in `directory/backbone`, and, with
    `clover`, the same backbone plus random Clover block-mode tensors in `directory/clover`.

    returns {"backbone": path, "clover": path (if clover)}
    """
    from tests.checkpoints import add_clover_tensors, write_hf_checkpoint

    paths = {"backbone": write_hf_checkpoint(os.path.join(directory, "backbone"), fields, seed)}
    if clover:
        mask = fields["vocab_size"] - 1 if mask_token_id is None else mask_token_id
        paths["clover"] = add_clover_tensors(paths["backbone"], os.path.join(directory, "clover"), mask, seed)
    return paths


def backbone_view_for_transformers(clover_dir: str, target: str) -> str:
    """A directory `transformers` loads as `Qwen3_5MoeForCausalLM`: the Clover checkpoint's
    config with `model_type` `qwen3_5_moe_text` (Clover-only fields dropped) and its weight files
    linked, not copied. The Clover block-mode tensors are unexpected keys to transformers and are
    ignored by it (they are not part of the causal backbone)."""
    os.makedirs(target, exist_ok=True)
    from clover_jax.core.config import read_text_model_fields

    config = read_text_model_fields(clover_dir)
    for key in ("mask_token_id", "moe_block_coreset_enabled", "moe_block_coreset_top_p", "architectures",
                "auto_map"):
        config.pop(key, None)
    config["model_type"] = "qwen3_5_moe_text"
    with open(os.path.join(target, "config.json"), "w") as handle:
        json.dump(config, handle)
    for name in os.listdir(clover_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            link = os.path.join(target, name)
            if not os.path.exists(link):
                os.symlink(os.path.abspath(os.path.join(clover_dir, name)), link)
    return target


def median(values) -> float:
    return statistics.median(values)


# The tests' tiny Qwen3.6-like layout (tests/checkpoints.py QWEN36_LIKE, without the context and
# RoPE fields, which each benchmark sets for itself).
TINY_FIELDS = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, eos_token_id=1)
