"""Roofline on paper for Clover-35B-A3B: bytes and FLOPs of one denoising step, and the bound on
tokens/s that follows. Pure arithmetic from the config below (a `CloverConfig`, its parameters
counted from the parameter table `clover_jax.core.params`); nothing is timed.

Model (the model card, and docs/design.md §1): 40 layers, 3 Gated DeltaNet : 1 full attention
(30 GDN + 10 attention), hidden 2048, 256 routed experts, top-8, expert intermediate 512, one
gated shared expert (intermediate 512), GDN 16 key heads / 32 value heads of 128, conv kernel 4,
attention 16 query / 2 K/V heads of 256 with an output gate (q_proj gives 2 × heads × 256),
untied embeddings, and each GDN layer's Clover block-mode tensors (the right convolution and three
per-head scalars, docs/design.md §2). The vocabulary (248,320) is Qwen3.5/3.6's `vocab_size`; the
model card does not state it. Weights bf16 (2 bytes), K/V cache bf16, GDN recurrent state float32
(the dtypes the model card states).

One denoising step of a block of B tokens for each of `batch` sequences reads, at least once:
  * every non-expert weight (attention / GDN projections, norms, router, shared experts, the LM
    head; only the `batch·B` embedding rows);
  * the weights of every *distinct* routed expert the step uses, per layer — the quantity the
    coreset (docs/design.md §5) cuts;
  * each sequence's K/V cache of the prefix (10 attention layers) and GDN state (30 layers).
Writes (logits, activations) are small and left out. FLOPs: 2 × active parameters per token
(dense, shared, 8 routed experts, the LM head) + attention scores / values over the prefix + the
GDN block mode (memory readout Sᵀq and the in-block softmax). A step takes at least
max(bytes / bandwidth, FLOPs / peak); tokens/s ≤ tokens per forward × batch / step time.

Distinct experts per layer per block is not public; the tables take it as a parameter:
  * "union, independent routing": 256 · (1 − (1 − 8/256)^(32·batch)) — every token picks its 8
    independently and uniformly, an upper estimate for plain top-8 (real routing is correlated
    across neighbouring tokens, so fewer);
  * fixed counts (coreset sizes) 16, 32, 64, 96: what a coreset at top_p 0.9 might keep (an
    assumption; the model card says only "a shared subset covering 90% of the aggregated mass").
For batch > 1 the coreset is per sequence, so the step's distinct experts are the union of the
sequences' coresets (estimated with the same independence assumption).

Usage: `python benchmarks/roofline.py [--markdown]` (JSON by default; --markdown prints the
tables of docs/performance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from clover_jax.core.config import CLOVER_35B_A3B, CloverConfig
from clover_jax.core.params import STACK_EXPERTS, param_rows

MODEL = CloverConfig.from_dict(CLOVER_35B_A3B)
# Bytes per element: weights and K/V cache bf16, GDN recurrent state float32.
DTYPE_BYTES = dict(weight_bytes=2, kv_bytes=2, state_bytes=4)
CONFIG = {**dataclasses.asdict(MODEL), **DTYPE_BYTES}  # what the report records

# Dense bf16 FLOP/s and HBM bytes/s from vendor data sheets (GB300: approximate, not in the issue).
DEVICES = {
    "H200": {"bytes_per_s": 4.8e12, "flops": 989e12, "reported_tokens_per_s": 515},
    "GB300": {"bytes_per_s": 8.0e12, "flops": 2.5e15, "reported_tokens_per_s": 680},
    "TPU v5e": {"bytes_per_s": 819e9, "flops": 197e12, "reported_tokens_per_s": None},
    "TPU v6e": {"bytes_per_s": 1.64e12, "flops": 918e12, "reported_tokens_per_s": None},
}
GB = 1e9


def _kind(path: tuple[str, ...], row) -> str:
    if row.transform == STACK_EXPERTS:
        return "routed_experts"
    if path[0] in ("embed_tokens", "lm_head"):
        return "embedding" if path[0] == "embed_tokens" else "lm_head"
    if "linear_attn" in path:
        return "gdn"
    if "self_attn" in path:
        return "attention"
    if "shared_expert" in path or "shared_expert_gate" in path:
        return "shared_experts"
    if path[-2:] == ("mlp", "gate"):
        return "routers"
    return "norms"  # the layers' input / post-attention norms and the final norm


def parameter_counts(config: CloverConfig = MODEL) -> dict:
    """Parameters by kind (per model), from the parameter table."""
    counts = dict.fromkeys(("embedding", "lm_head", "gdn", "attention", "routed_experts", "shared_experts", "routers",
                            "norms"), 0)
    for path, row in param_rows(config).items():
        counts[_kind(path, row)] += math.prod(row.leaf_shape(config))
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    counts["total"] = sum(counts.values())
    counts["one_expert"] = expert
    counts["active_per_token"] = (counts["lm_head"] + counts["gdn"] + counts["attention"] + counts["shared_experts"]
                                  + counts["routers"] + counts["norms"]
                                  + config.num_hidden_layers * config.num_experts_per_tok * expert)
    return counts


def union_distinct(tokens: int, config: CloverConfig = MODEL) -> float:
    """Expected distinct experts when `tokens` tokens each pick top_k of E independently and uniformly."""
    experts = config.num_experts
    return experts * (1 - (1 - config.num_experts_per_tok / experts) ** tokens)


def union_of_coresets(per_sequence: float, batch: int, config: CloverConfig = MODEL) -> float:
    return config.num_experts * (1 - (1 - per_sequence / config.num_experts) ** batch)


def step_cost(block: int, batch: int, prefix: int, distinct_experts: float, config: CloverConfig = MODEL,
              dtype_bytes: dict = DTYPE_BYTES) -> dict:
    """Bytes and FLOPs of one denoising step (or, with block=1 and distinct=top_k·batch-union, one
    autoregressive step)."""
    c = config
    p = parameter_counts(c)
    tokens = block * batch
    w = dtype_bytes["weight_bytes"]
    attention_layers = c.layer_types.count("full_attention")
    gdn_layers = c.num_hidden_layers - attention_layers
    dense_params = p["lm_head"] + p["gdn"] + p["attention"] + p["shared_experts"] + p["routers"] + p["norms"]
    weight_bytes = w * (dense_params + tokens * c.hidden_size
                        + c.num_hidden_layers * distinct_experts * p["one_expert"])
    kv_bytes = batch * attention_layers * prefix * 2 * c.num_key_value_heads * c.head_dim * dtype_bytes["kv_bytes"]
    gdn_state_bytes = batch * gdn_layers * (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * dtype_bytes["state_bytes"]
        + (c.linear_conv_kernel_dim - 1) * c.conv_dim * w)
    matmul_flops = 2 * tokens * p["active_per_token"]
    attention_flops = tokens * attention_layers * 4 * c.num_attention_heads * c.head_dim * (prefix + block)
    key, value = c.linear_key_head_dim, c.linear_value_head_dim
    gdn_flops = tokens * gdn_layers * c.linear_num_value_heads * (2 * key * value + 2 * (key + value) * block)
    total_bytes = weight_bytes + kv_bytes + gdn_state_bytes
    flops = matmul_flops + attention_flops + gdn_flops
    return {"block": block, "batch": batch, "prefix": prefix, "distinct_experts_per_layer": distinct_experts,
            "weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes, "gdn_state_bytes": gdn_state_bytes,
            "bytes": total_bytes, "flops": flops, "flops_per_byte": flops / total_bytes}


def bounds(cost: dict, tokens_per_forward: float) -> dict:
    out = {}
    for name, device in DEVICES.items():
        memory_s = cost["bytes"] / device["bytes_per_s"]
        compute_s = cost["flops"] / device["flops"]
        step_s = max(memory_s, compute_s)
        out[name] = {"step_ms": 1e3 * step_s, "bound": "memory" if memory_s >= compute_s else "compute",
                     "tokens_per_s": tokens_per_forward * cost["batch"] / step_s}
    return out


def scenarios(block: int = 32, prefix: int = 4096) -> list[dict]:
    """The rows of the tables: AR step, denoising step without / with coreset, per batch."""
    rows = []
    for batch in (1, 4, 16):
        rows.append(dict(name="autoregressive step", batch=batch, block=1,
                         distinct=union_distinct(batch), distinct_rule="union of top-8 over the batch"))
        rows.append(dict(name="denoise, plain top-8", batch=batch, block=block,
                         distinct=union_distinct(block * batch),
                         distinct_rule=f"union, independent routing over {block * batch} tokens"))
        for coreset in (16, 32, 64, 96):
            rows.append(dict(name=f"denoise, coreset {coreset}", batch=batch, block=block,
                             distinct=union_of_coresets(coreset, batch) if batch > 1 else float(coreset),
                             distinct_rule=f"{coreset} per sequence" + (", union over the batch" if batch > 1 else "")))
    for row in rows:
        row["cost"] = step_cost(row["block"], row["batch"], prefix, min(row["distinct"], MODEL.num_experts))
    return rows


def tokens_per_forward_needed(cost: dict, tokens_per_s: float, device: str) -> float:
    step_s = max(cost["bytes"] / DEVICES[device]["bytes_per_s"], cost["flops"] / DEVICES[device]["flops"])
    return tokens_per_s * step_s / cost["batch"]


def report(prefix: int, block: int) -> dict:
    rows = scenarios(block, prefix)
    tpf_values = (1.0, 2.0, 3.0, 4.0)
    for row in rows:
        row["bounds"] = {str(t): bounds(row["cost"], t if row["block"] > 1 else 1.0) for t in tpf_values}
        row["tokens_per_forward_needed_for_reported"] = {
            d: tokens_per_forward_needed(row["cost"], DEVICES[d]["reported_tokens_per_s"], d)
            for d in DEVICES if DEVICES[d]["reported_tokens_per_s"]} if row["batch"] == 1 else None
    return {"benchmark": "roofline", "config": CONFIG, "devices": DEVICES, "parameters": parameter_counts(),
            "prefix": prefix, "block": block, "rows": rows,
            "assumptions": ["weights and K/V bf16, GDN state float32", "every byte read once per step",
                            "distinct experts per layer as each row states",
                            "100% of peak bandwidth / FLOP/s (an upper bound)"]}


# ---------------------------------------------------------------------- markdown
def _g(x, digits=3):
    return f"{x:.{digits}g}"


def markdown(prefixes=(4096, 32768), block: int = 32) -> str:
    p = parameter_counts()
    lines = ["### Parameters (from the config)", "", "| part | parameters |", "|---|---:|"]
    for key in ("embedding", "lm_head", "gdn", "attention", "routed_experts", "shared_experts", "routers", "norms",
                "total", "one_expert", "active_per_token"):
        lines.append(f"| {key} | {p[key] / 1e9:.3f} B |" if p[key] > 1e8 else f"| {key} | {p[key] / 1e6:.2f} M |")
    lines.append("")
    for prefix in prefixes:
        rep = report(prefix, block)
        lines += [f"### Prefix {prefix} tokens, block {block}", "",
                  "| step | batch | distinct experts / layer | weights GB | K/V GB | GDN state GB | total GB | "
                  "GFLOP | FLOP/byte |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in rep["rows"]:
            c = row["cost"]
            lines.append(f"| {row['name']} | {row['batch']} | {c['distinct_experts_per_layer']:.1f} | "
                         f"{c['weight_bytes'] / GB:.2f} | {c['kv_cache_bytes'] / GB:.3f} | "
                         f"{c['gdn_state_bytes'] / GB:.3f} | {c['bytes'] / GB:.2f} | {c['flops'] / 1e9:.0f} | "
                         f"{c['flops_per_byte']:.1f} |")
        lines += ["", f"Step time bound (ms) and tokens/s bound at prefix {prefix} "
                  "(AR rows: 1 token per forward; denoise rows: tokens per forward T = 2 / 3 / 4):", "",
                  "| step | batch | " + " | ".join(f"{d} ms" for d in DEVICES) + " | "
                  + " | ".join(f"{d} tok/s (T=2/3/4)" for d in DEVICES) + " |",
                  "|---|---:|" + "---:|" * (2 * len(DEVICES))]
        for row in rep["rows"]:
            ms = [row["bounds"]["1.0"][d]["step_ms"] for d in DEVICES]
            if row["block"] == 1:
                rates = [f"{row['bounds']['1.0'][d]['tokens_per_s']:.0f}" for d in DEVICES]
            else:
                rates = ["/".join(f"{row['bounds'][t][d]['tokens_per_s']:.0f}" for t in ("2.0", "3.0", "4.0"))
                         for d in DEVICES]
            lines.append(f"| {row['name']} | {row['batch']} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
                         + " | ".join(rates) + " |")
        lines += ["", f"Tokens per forward needed at the roofline for DiffuSpace's batch-1 figures "
                  f"(prefix {prefix}):", "", "| step | H200 for 515 tok/s | GB300 for 680 tok/s |", "|---|---:|---:|"]
        for row in rep["rows"]:
            if row["batch"] == 1 and row["block"] > 1:
                need = row["tokens_per_forward_needed_for_reported"]
                lines.append(f"| {row['name']} | {need['H200']:.2f} | {need['GB300']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/performance.md")
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry with the other scripts")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(block=args.block))
    else:
        print(json.dumps(report(args.prefix, args.block)))


if __name__ == "__main__":
    main()
