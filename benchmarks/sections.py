"""One section of `docs/benchmarks.md` per benchmark script: its JSON result as tables and
sentences (`RENDER[name]`), under its title (`TITLES[name]`); `run_all.py` assembles the document."""

from __future__ import annotations

import statistics


def f(value, digits=3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return str(value)
    return f"{value:.{digits}g}"


def bound_text(check: dict) -> str:
    """A check's bound for the targets table, named when it is not a roofline bound."""
    kind = check.get("bound_kind", "roofline")
    value = f(check["at_roofline"])
    return value if kind == "roofline" or check["at_roofline"] is None else f"{value} ({kind})"


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render_decoding(j: dict) -> tuple[list[str], list[list]]:
    r = j["results"]
    lines = [f"Checkpoint: {j['checkpoint']}; {j['prompts']} prompts at batch 1, max_new_tokens "
             f"{j['max_new_tokens']}, diffusion block {j['generation_config']['block_size']} threshold "
             f"{j['generation_config']['threshold']}; {j['rounds']} rounds, medians; dtype {j['dtype']}, "
             f"torch threads {j['torch_threads']}."]
    for note in j.get("notes", []):
        lines.append(f"**Note:** {note}.")
    lines.append("")
    lines += table(["method", "tokens/s", "mean NFE", "tokens / forward", "mean response tokens", "accuracy"],
                   [[name, f(v["tokens_per_s"]), f(v["mean_nfe"]), f(v["tokens_per_forward"]),
                     f(v["mean_response_tokens"]), f(v["accuracy"])] for name, v in r.items()])
    ratios = j["ratios"]
    lines += table(["ratio", "value"], [[k, f(v)] for k, v in ratios.items()]
                   + [["clover autoregressive tokens == transformers tokens (fraction of prompts)",
                       f(j["clover_autoregressive_equals_transformers_fraction"])]]
                   + ([["self-speculative tokens == clover autoregressive tokens (fraction of prompts)",
                        f(j["self_speculative_equals_clover_autoregressive_fraction"])]]
                      if "self_speculative_equals_clover_autoregressive_fraction" in j else []))
    overhead = j.get("host_overhead_per_call")
    if overhead:
        lines += [f"Host time per one-prompt `generate` call outside the compiled loop: diffusion "
                  f"{f(overhead['diffusion']['median_ms'])} ms, autoregressive "
                  f"{f(overhead['autoregressive']['median_ms'])} ms (the compiled calls take "
                  f"{f(overhead['diffusion']['compiled_call_median_ms'])} and "
                  f"{f(overhead['autoregressive']['compiled_call_median_ms'])} ms)"
                  + (f"; self-speculative {f(overhead['self_speculative']['median_ms'])} ms (compiled call "
                     f"{f(overhead['self_speculative']['compiled_call_median_ms'])} ms)"
                     if "self_speculative" in overhead else "") + ".", ""]
    ceiling = j.get("ceiling_if_a_diffusion_forward_cost_an_autoregressive_step")
    if ceiling:
        lines += [f"Fixed-cost ceiling (`diffusion_ceiling`): an autoregressive call spends "
                  f"{f(ceiling['autoregressive_fixed_ms'])} ms on its prefill and first token; if every "
                  f"diffusion forward cost one autoregressive step after that, diffusion / clover AR "
                  f"tokens/s would be {f(ceiling['tokens_per_s_ratio'])} and the forward cost ratio "
                  f"{f(ceiling['forward_cost_ratio'])}.", ""]
    summary = [["decoding", "diffusion / clover AR tokens/s",
                f(ratios["diffusion_over_clover_autoregressive_tokens_per_s"])],
               ["decoding", "diffusion / transformers tokens/s", f(ratios["diffusion_over_transformers_tokens_per_s"])],
               ["decoding", "clover AR / transformers tokens/s",
                f(ratios["clover_autoregressive_over_transformers_tokens_per_s"])],
               ["decoding", "diffusion tokens per forward", f(r["clover_diffusion"]["tokens_per_forward"])]]
    if "clover_self_speculative" in r:
        summary += [["decoding", "self-speculative / clover AR tokens/s",
                     f(ratios.get("self_speculative_over_clover_autoregressive_tokens_per_s"))],
                    ["decoding", "self-speculative tokens per forward",
                     f(r["clover_self_speculative"]["tokens_per_forward"])]]
    if r["clover_diffusion"]["accuracy"] is not None:
        summary.append(["decoding", "accuracy " + " / ".join(m.replace("clover_", "").replace("_", "-") for m in r),
                        " / ".join(f(r[m]["accuracy"]) for m in r)])
    return lines, summary


def render_rates(rates: dict) -> str:
    return (f"this machine: read {rates['read_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
            f"{rates['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s (float32)")


def render_serving(j: dict):
    names = {"bundled": "the bundled tiny Clover (its task's prompts, chat template, shipped controls)",
             "medium": "the medium random model (random prompts)"}
    lines = [f"Greedy block diffusion, max_new_tokens {j['max_new_tokens']}; the same requests through `generate` "
             f"one at a time and through the serving engine with {'/'.join(map(str, j['concurrency']))} clients in "
             f"a closed loop (each submits its next request when its last one finishes); {j['rounds']} rounds, "
             "medians. tokens/s: response tokens of all requests over the run's wall time; latencies: medians over "
             "the requests of the last round (time to first block: submit to the first decided tokens; `generate` "
             "alone hands over its tokens all at once, at the end).", ""]
    summary = []
    for model, result in j["models"].items():
        config = result.get("config")
        lines += [f"**{model}**: {names.get(model, model)}, {result['requests']} requests"
                  + (f"; {', '.join(f'{k} {v}' for k, v in config.items())}" if config else "") + ".", ""]
        base = result["results"]["generate_one_at_a_time"]["tokens_per_s"]
        lines += table(["method", "tokens/s", "× one at a time", "mean NFE", "time to first block ms",
                        "time per token ms", "request latency ms", "tokens equal to generate alone"],
                       [[method, f(v["tokens_per_s"]), f(v["tokens_per_s"] / base if base else None),
                         f(v["mean_nfe"]), f(v["time_to_first_block_ms"]), f(v["time_per_token_ms"]),
                         f(v["request_latency_ms"]), f(v["equal_to_generate_alone"])]
                        for method, v in result["results"].items()])
        summary.append(["serving", f"{model}: tokens/s at concurrency 16 / generate one at a time",
                        f(result["ratios"]["concurrency_16_over_one_at_a_time"])])
        if "concurrency_16_over_ceiling" in result["ratios"]:
            summary.append(["serving", f"{model}: that gain / the forward's batching ceiling",
                            f(result["ratios"]["concurrency_16_over_ceiling"])])
        kv = result.get("kv_cache")
        if kv:
            over = kv["page_positions_over_positions_held"]
            lines += [f"K/V in use at concurrency 16 ({kv['passes']} passes): the running requests' pages hold "
                      f"{f(over['median'])}x the positions their states hold (median; at most {f(over['max'])}: "
                      f"each request's last page and the block it denoises), pages of {kv['page_size']} positions "
                      f"({kv['page_bytes']} bytes over the attention layers); at most {kv['max_pages_in_use']} of "
                      f"the pool's {kv['pool_pages']} pages in use, the prefix cache's included.", ""]
    return lines, summary


def render_serving_burst(j: dict):
    rows = [[r["model"], r["precompiled_programs"], r["planned_with_a_forward"], f(r["precompile_seconds"]),
             f"{r['memory_mappings']['held']:,} / {r['memory_mappings']['limit']:,}" if r["memory_mappings"] else "—",
             f(r["first_burst_s"]), ", ".join(f(t) for t in r["later_bursts_s"]), f(r["one_by_one_s"]),
             f(r["first_over_later"]), r["programs_compiled_after_precompile"]] for r in j["records"]]
    lines = table(["model", "programs precompiled", "with a forward", "precompile s", "memory mappings / limit",
                   "first burst s", "later bursts s", "one by one s", "first / later", "compiled after"], rows)
    first = j["records"][0]
    lines += [f"The engine `clover-jax serve` starts with default flags ({first['max_running']} running, block sizes "
              f"{'/'.join(map(str, first['block_sizes']))}, the model's whole context, prefix cache on), "
              f"`--precompile` (every mode), in a fresh process with an empty compilation cache; bursts of "
              f"{first['burst']} concurrent requests of {first['max_new_tokens']} new tokens, distinct prompts.", ""]
    summary = [["serving_burst", f"{r['model']}: first burst after serve --precompile / a later burst",
                f(r["first_over_later"])] for r in j["records"]]
    return lines, summary


def render_chunked_prefill(j: dict):
    rows = [["balanced" if r["balance_prefill"] else "whole prefill budget", r["running"], r["prompt_tokens"],
             f(1e3 * r["step_without_s"]), f(1e3 * r["step_during_prefill_s"]), f(r["step_ratio"]),
             r["passes_during_prefill"], f(r["first_token_busy_s"]), f(r["first_token_alone_s"]),
             f(r["first_token_ratio"]), r["compiled_on_demand"]] for r in j["runs"]]
    lines = table(["prefill rows a pass", "running", "prompt tokens", "pass ms without", "pass ms during prefill",
                   "ratio", "passes to first token", "first token s beside them", "first token s alone", "ratio",
                   "compiled on demand"], rows)
    lines += [f"The {j['model']} model; the running requests decode block diffusion (block 16) while the prompt "
              "arrives, decoded autoregressively so that its first token comes with its prefill.", ""]
    balanced = j["runs"][0]
    return lines, [["chunked_prefill", "running requests' pass while a prompt prefills / without it",
                    f(balanced["step_ratio"])],
                   ["chunked_prefill", "the prompt's first token beside them / alone",
                    f(balanced["first_token_ratio"])]]


def render_editing_schedules(j: dict):
    rows = []
    for model, scores in j["aup"].items():
        joint = max((score, curve) for curve, score in scores.items() if curve != "low_confidence")
        rows.append([model, f(scores["low_confidence"]), f(joint[0]), joint[1]])
    lines = table(["model", "LowConfidence AUP", "best joint_threshold AUP", "its setting"], rows)
    lines += [f"Held-out lists of {j['digits'][0]}-{j['digits'][1]} digits, block {j['block_size']}, {j['prompts']} "
              f"prompts; y_max {f(j['y_max'])}% (the best cell of any model). Every cell is in the JSON below.", ""]
    editing = j["aup"]["editing"]
    best = max(score for curve, score in editing.items() if curve != "low_confidence")
    return lines, [["editing_schedules", "editing model: best joint_threshold AUP / LowConfidence AUP",
                    f(best / editing["low_confidence"])]]


def render_constrained_decoding(j: dict):
    rows = []
    for cell in j["cells"]:
        setting = cell["schedule"] + (f" k={cell['tokens_per_step']}" if "tokens_per_step" in cell else "")
        options = cell.get("options") or {}
        rows.append([setting, cell["constraint"] or "none", f(100 * cell["accuracy"]), f(cell["tokens_per_forward"]),
                     f(cell["grammar_ms_per_step"]) if "grammar_ms_per_step" in cell else "",
                     " ".join(f"{k} {f(100 * v)}%" for k, v in options.items())])
    lines = table(["schedule", "constraint (gap rule)", "accuracy %", "tokens / forward", "grammar ms / step",
                   "commit rule's options"], rows)
    lines += [f"{j['prompts']} held-out lists of {j['digits']} digits, block {j['block_size']}; the constraint is the "
              "answer line as a regular expression of digits (\"foreign answer\": letters, which the model never "
              "writes). The grammar's host time is per step of the whole batch.", ""]
    return lines, [["constrained_decoding", check["name"].split(": ")[0].replace("constrained diffusion ", "")
                     + ": witness tokens/forward vs none", f(check["value"])] for check in j["checks"]]


def render_serve_compile(j: dict):
    rows = [[r["set"], r["target"], r["quantize"] or "bfloat16", "/".join(map(str, r["block_sizes"])),
             r["max_running"], r["max_context"], r["programs"], r["with_a_forward"],
             f(r["compile_seconds"] / 60), f"{r['slowest'][0]} ({f(r['slowest'][1])} s)",
             f"{r['peak_bytes'][0]} ({f(r['peak_bytes'][1] / 2**30)} GiB)", len(r["refused"])] for r in j["runs"]]
    lines = table(["set", "target", "weights", "block sizes", "running", "context", "programs", "with a forward",
                   "compile minutes", "slowest program", "most bytes per device", "refused"], rows)
    lines += ["Every program of the served set compiled by the target's own compiler from this host, with no device "
              "(a cold cache: nothing reused).", ""]
    return lines, [["serve_compile", f"{r['set']}: served set compile minutes", f(r["compile_seconds"] / 60)]
                   for r in j["runs"]]


def render_serving_http(j: dict):
    lines = [f"The server in its own process (prefix cache off, the model's whole context) under "
             f"{j['concurrency']} threads of the `openai` client in a closed loop "
             f"(`/v1/completions`, prompts as token ids, greedy, max_tokens {j['max_tokens']}); the same requests "
             "through `generate` one at a time and through the engine in-process; the forward's batching ceiling "
             f"measured in the same run; {j['rounds']} rounds, medians.", ""]
    rows, summary = [], []
    for model, result in j["models"].items():
        base = result["results"]["generate_one_at_a_time"]["tokens_per_s"]
        server = result["server"]
        for method, v in result["results"].items():
            equal = v.get("text_equal_to_generate_alone", v.get("equal_to_generate_alone"))
            rows.append([model, method, f(v["tokens_per_s"]), f(v["tokens_per_s"] / base if base else None),
                         f(equal) if method != "generate_one_at_a_time" else "—"])
        in_process = result["ratios"].get("engine_over_ceiling")
        lines.append(f"- {model}: {result['requests']} requests; server: {server['log_line']}; "
                     f"{server.get('compiled_on_demand_in_rounds')} programs compiled in the timed rounds; ceiling "
                     f"{f(result['batching_ceiling']['ceiling'])}x; through HTTP "
                     f"{f(result['ratios']['http_over_ceiling'])} of it"
                     + ("" if in_process is None else f", in-process {f(in_process)}") + ".")
        summary.append(["serving_http", f"{model}: HTTP gain at concurrency 16 / the forward's batching ceiling",
                        f(result["ratios"]["http_over_ceiling"])])
    lines.append("")
    lines += table(["model", "method", "tokens/s", "× one at a time", "responses equal to generate alone"], rows)
    return lines, summary


def render_prefix_cache(j: dict):
    lines = [f"An agent's conversation on the random model ({', '.join(f'{k} {v}' for k, v in j['config'].items())}): "
             f"turn 1's prompt {j['base']} tokens, each later turn adding {j['step']} (the previous reply and a tool "
             f"result), max_new_tokens {j['max_new_tokens']}; one engine with the prefix cache (default budget and "
             f"grid), one without, in one process; {j['rounds']} rounds of fresh transcripts, medians. Time to first "
             "token: submit to the first response tokens the engine hands back. Load average before/after: "
             f"{', '.join(f(x, 2) for x in j['load_average_before'])} / "
             f"{', '.join(f(x, 2) for x in j['load_average_after'])}.", ""]
    summary = []
    for mode, result in j["modes"].items():
        with_cache, without = result["per_turn"]["with_cache"], result["per_turn"]["without_cache"]
        lines += [f"**{mode}** (replies equal with and without the cache: {f(result['replies_equal_fraction'])} of "
                  "turns)", ""]
        lines += table(["turn", "prompt tokens", "restored from the cache", "first token s, with", "without",
                        "without / with"],
                       [[t + 1, a["prompt_tokens"], f(a["cached_tokens"]), f(a["first_token_s"]),
                         f(b["first_token_s"]), f(b["first_token_s"] / a["first_token_s"])]
                        for t, (a, b) in enumerate(zip(with_cache, without, strict=True))])
        summary.append(["prefix_cache", f"{mode}: turn {j['turns']} time to first token, without / with the cache",
                        f(result["last_turn_speedup"])])
    return lines, summary


def render_forward_cost(j: dict):
    g, s, a = j["generate"], j["step"], j["autoregressive_steady"]
    lines = [f"Random model: {j['config']}, {j['parameters'] / 1e6:.0f} M parameters, {j['dtype']}, torch threads "
             f"{j['torch_threads']}; {render_rates(j['machine_rates'])}. Generate: prompt {g['prompt_tokens']}, "
             f"max_new_tokens {g['max_new_tokens']}, {g['rounds']} rounds; steps: prefix {s['prefix_tokens']}, "
             f"block {s['block']}, {s['rounds']} rounds.", ""]
    lines += table(["autoregressive generate", "tokens/s", "response tokens", "NFE"],
                   [[m, f(g[m]["tokens_per_s"]), g[m]["response_tokens"], g[m]["nfe"]]
                    for m in ("clover_autoregressive", "transformers")])
    lines += [f"clover / transformers tokens/s: **{f(g['clover_over_transformers_tokens_per_s'])}** (same tokens: "
              f"{f(g['same_tokens'])}). Steady state: {f(1e3 * a['seconds_per_token'])} ms per token against a "
              f"bandwidth bound of {f(1e3 * a['bound']['seconds'])} ms ({f(a['bytes_per_token'] / 1e6)} MB per token): "
              f"**{f(a['fraction_of_bound'])}** of the bound.", ""]
    rows = []
    for name in ("denoise_step", "commit_and_denoise_step", "autoregressive_step"):
        step = s[name]
        cost, limit = step["cost"], step["bound"]
        rows.append([name, f(step["median_ms"]), f(cost["bytes"] / 1e6), f(cost["flops"] / 1e9),
                     f(cost["distinct_experts_per_layer"]), f(1e3 * limit["seconds"]), limit["limited_by"],
                     f(step["over_bound"])])
    lines += table(["one step", "median ms", "MB read", "GFLOP", "distinct experts / layer", "bound ms", "bound by",
                    "time / bound"], rows)
    lines += [f"denoising step / autoregressive step: **{f(s['denoise_over_autoregressive_step'])}** (the ratio of "
              f"their bounds: {f(s['bound_ratio_denoise_over_autoregressive'])}).", ""]
    traffic = s.get("xla_cost_analysis")
    if traffic:
        lines += [f"XLA's cost analysis (static; counts a dynamic slice of an expert as a read of the whole stacked "
                  f"array and a loop body once): autoregressive step "
                  f"{f(traffic['autoregressive_step']['bytes_accessed'] / 1e9)} GB, denoising step "
                  f"{f(traffic['denoise_step']['bytes_accessed'] / 1e9)} GB accessed.", ""]
    summary = [["forward_cost", "clover AR / transformers tokens/s (medium random model)",
                f(g["clover_over_transformers_tokens_per_s"])],
               ["forward_cost", "clover AR steady tokens/s / bandwidth bound", f(a["fraction_of_bound"])],
               ["forward_cost", "denoise step / its roofline bound", f(s["denoise_step"]["over_bound"])],
               ["forward_cost", "denoise step / AR step time (break-even tokens per forward)",
                f(s["denoise_over_autoregressive_step"])]]
    return lines, summary


def render_expert_scaling(j: dict):
    r = j["results"]
    lines = [f"Random models {j['config']} with {j['experts'][0]} and {j['experts'][1]} experts; "
             f"{render_rates(j['machine_rates'])}; {j['rounds']} rounds.", ""]
    lines += table(["experts", "AR tokens/s", "AR bound ms/token", "denoise step ms", "distinct experts / layer",
                    "denoise bound ms"],
                   [[e, f(v["autoregressive_tokens_per_s"]), f(1e3 * v["autoregressive_bound"]["seconds"]),
                     f(v["denoise_step_ms"]), f(v["denoise_distinct_experts_per_layer"]),
                     f(1e3 * v["denoise_bound"]["seconds"])] for e, v in r.items()])
    low, high = j["experts"]
    return lines, [["expert_scaling", f"AR tokens/s, {high} / {low} experts", f(j["autoregressive_speed_ratio"])],
                   ["expert_scaling", f"denoise step speed (coreset), {high} / {low} experts",
                    f(j["denoise_speed_ratio"])]]


def render_context(j: dict):
    lines = [f"Tiny random Clover {j['config']} ({j['layers']}), block {j['block']}, {j['rounds']} rounds, "
             f"prefill chunk {j['chunk_size']}.", ""]
    lines += table(["prefix tokens", "denoising step ms", "× shortest", "K/V MB read", "K/V GB/s", "bound ms",
                    "bound by", "prefill s", "prefill tokens/s"],
                   [[c["prefix"], f(c["denoise_step_ms"]), f(c["over_shortest"]), f(c["kv_bytes_read"] / 1e6),
                     f(c["kv_read_gb_per_s"]), f(1e3 * c["bound"]["seconds"]), c["bound"]["limited_by"],
                     f(c["prefill"]["seconds"]), f(c["prefill"]["tokens_per_s"])] for c in j["curve"]])
    lines += [f"{render_rates(j['machine_rates'])}; the ratio of the bounds, longest / shortest: "
              f"{f(j['bound_ratio_longest_over_shortest'])}.", ""]
    a, b = j["lengths"]
    return lines, [["context_scaling", f"denoise step time {b}/{a} prefix", f(j["step_ratio_longest_over_shortest"])]]


def render_compile(j: dict):
    lines = [f"`generate` on a tiny random Clover, call {j['call']}; first calls in fresh processes, "
             f"{j['rounds']} rounds, medians.", ""]
    lines += table(["", "first call s", "backend compiles", "answered by persistent cache", "warm call s"],
                   [[k, f(j[k]["first_call_s"]), j[k]["first_call_compiles"], j[k]["first_call_cache_hits"],
                     f(j[k]["warm_call_s"])] for k in ("cold", "persistent_cache")])
    if "triggers" in j:
        lines += table(["change from the base call", "backend compiles", "decoder loop recompiled", "call s"],
                       [[t["change"], t["backend_compiles"], t["decoder_loop_compiled"], f(t["call_s"])]
                        for t in j["triggers"]])
    cli = j.get("cli_show_steps")
    if cli:
        lines += [f"`clover-jax generate --show-steps` in a new process: first run (empty cache) "
                  f"{f(statistics.median(cli['first_s']))} s, second run {f(statistics.median(cli['second_s']))} s: "
                  f"**{f(cli['second_over_first'])}**.", ""]
    summary = [["compile", "first call: persistent cache / cold", f(j["persistent_over_cold_first_call"])],
               ["compile", "cold first call s / warm call s",
                f"{f(j['cold']['first_call_s'])} / {f(j['cold']['warm_call_s'])}"]]
    return lines, summary


def render_moe(j: dict):
    s = j["shape"]
    lines = [f"{j['layer']}; hidden {s['hidden']}, expert intermediate {s['intermediate']}, top-{s['top_k']}, "
             f"{s['dtype']}; {j['rounds']} rounds, medians.", ""]
    lines += table(["rows", "experts", "distinct experts used", "clover XLA ms", "bound ms", "clover / bound",
                    "ragged_dot ms", "ragged_dot / clover"],
                   [[e["rows"], e["experts"], e["distinct_experts_used"], f(1e3 * e["clover_xla_s"]["median"]),
                     f(1e3 * e["bound_s"]) if "bound_s" in e else "—", f(e.get("clover_over_bound")),
                     f(None if e["ragged_dot_s"]["median"] is None else 1e3 * e["ragged_dot_s"]["median"]),
                     f(e["ragged_over_clover"])] for e in j["results"]])
    summary = []
    for rows, sc in j["time_ratio_most_over_fewest_experts"].items():
        low, high = sc["experts"]
        summary.append(["moe_scaling", f"{rows} rows: time at {high} / {low} experts, clover; ragged_dot",
                        f"{f(sc['clover_xla_time_ratio'])}; {f(sc['ragged_dot_time_ratio'])}"])
    return lines, summary


def render_load(j: dict):
    lines = table(["checkpoint GB", "load GB/s", "raw read GB/s", "raw into fresh memory GB/s", "load / raw",
                   "load / raw fresh", "peak RSS / checkpoint"],
                  [[j["checkpoint_gigabytes"], f(j["load_gbps"]["median"]), f(j["raw_read_gbps"]["median"]),
                    f(j["raw_read_into_fresh_memory_gbps"]["median"]), f(j["load_vs_raw"]),
                    f(j["load_vs_raw_into_fresh_memory"]), f(j["peak_rss_over_checkpoint"])]])
    return lines, [["load", "safetensors load / raw read into fresh memory", f(j["load_vs_raw_into_fresh_memory"])]]


def render_load_orbax(j: dict):
    rows = []
    for kind in ("hf", "orbax"):
        entry = j.get(kind) or j.get("formats", {}).get(kind) or {}
        rows.append([kind, f(_median(entry.get("seconds"))), f(_median(entry.get("gbps"))),
                     f(entry.get("peak_rss_over_checkpoint"))])
    lines = table(["format", "load s", "GB/s", "peak RSS / checkpoint"], rows)
    return lines, [["load_orbax", "Orbax / safetensors load time", f(j.get("orbax_over_hf_seconds"))]]


def _median(value):
    if isinstance(value, dict):
        return value.get("median")
    return value


def render_roofline(j: dict):
    rows = [r for r in j["rows"] if r["batch"] == 1]
    lines = [f"Clover-35B-A3B on paper (prefix {j['prefix']}, block {j['block']}, batch 1); full tables and "
             "assumptions in docs/performance.md.", ""]
    lines += table(["step", "distinct experts / layer", "GB read", "H200 ms", "H200 tok/s at T=2/3/4",
                    "T needed for 515 tok/s (H200)"],
                   [[r["name"], f(r["cost"]["distinct_experts_per_layer"]), f(r["cost"]["bytes"] / 1e9),
                     f(r["bounds"]["1.0"]["H200"]["step_ms"]),
                     "/".join(f(r["bounds"][t]["H200"]["tokens_per_s"]) for t in ("2.0", "3.0", "4.0"))
                     if r["block"] > 1 else f(r["bounds"]["1.0"]["H200"]["tokens_per_s"]),
                     f(r["tokens_per_forward_needed_for_reported"]["H200"]) if r["block"] > 1 else "—"]
                    for r in rows])
    plain = next(r for r in rows if r["name"] == "denoise, plain top-8")
    return lines, [["roofline", "H200 tokens per forward needed for 515 tok/s, plain top-8 (arithmetic)",
                    f(plain["tokens_per_forward_needed_for_reported"]["H200"])]]


def render_compile_targets(j: dict):
    gb = lambda n: f"{n / 1e9:.2f}"
    lines = [f"{j['model']}, context {j['context_length']}, batch {j['batch']}, bfloat16 activations; each loop "
             "compiled from this CPU host by the target's own compiler (libtpu; XLA's CUDA compiler with Triton "
             "and ptxas) with abstract parameters, on the mesh the plan chooses. Bytes are per device, from "
             "`memory_analysis()`; \"of device\" is the total over the memory a program may use (TPU: the HBM the "
             "runtime reports; GPU: JAX's preallocated 75%); \"estimate\" is the plan's arithmetic, and its error "
             "is against the compiler's total.", ""]
    lines += table(["target", "weights", "mesh (d,e,t)", "loop", "compile s", "arguments GB", "temporaries GB",
                    "total GB", "of device", "estimate GB", "estimate error", "fits"],
                   [[r["target"], r["weights"], ",".join(str(v) for v in r["mesh"].values()), r["loop"],
                     f(r["compile_s"]), gb(r["argument_bytes"]), gb(r["temp_bytes"]), gb(r["total_bytes"]),
                     "refused" if r["error"] else f"{100 * r['fraction_of_device']:.0f}%", gb(r["estimate_bytes"]),
                     "—" if r["estimate_error"] is None else f"{100 * r['estimate_error']:+.0f}%", f(r["fits"])]
                    for r in j["rows"]])
    if j["refused"]:
        lines += ["Refused by the compiler:", ""] + [f"- {line}" for line in j["refused"]] + [""]
    lines += ["Recommendation per target (by the compiler where it ran): " + "; ".join(
        f"{target}: {weights or 'nothing fits'}" for target, weights in j["recommendations"].items()) + ".", ""]
    worst = max((abs(r["estimate_error"]) for r in j["rows"] if r["estimate_error"] is not None), default=None)
    return lines, [["compile_targets", "loops compiled / refused",
                    f"{sum(1 for r in j['rows'] if not r['error'])} / {len(j['refused'])}"],
                   ["compile_targets", "worst absolute (estimate − compiler) / compiler", f(worst)]]


def render_train_compile(j: dict):
    gib = lambda n: f"{n / 2**30:.2f}"
    lines = [f"{j['model']}: the whole train step (both streams, complementary copy on, block size 32; loss, "
             "backward, AdamW) compiled from this CPU host by each target's compiler with abstract sharded "
             "arguments, on the planner's mesh and remat. GiB per chip, from `memory_analysis()`; \"max tokens\": "
             "the longest sequence tried whose step fits; \"host\": host memory per chip (a LoRA base's layers "
             "offloaded there, `offload_base`).", ""]
    lines += table(["row", "target", "run", "batch x tokens", "mesh (d,e,t)", "remat", "arguments", "temporaries",
                    "total", "of chip", "host", "fits", "max tokens", "compile s"],
                   [[r["row"], r["target"], r["run"], f"{r['batch']} x {r['seq_len']}",
                     ",".join(str(v) for v in r["mesh"].values()), r["remat"], gib(r["argument_bytes"]),
                     gib(r["temp_bytes"]), gib(r["total_bytes"]),
                     "refused" if r["error"] else f"{100 * r['total_bytes'] / r['device_bytes']:.0f}%",
                     gib(r["host_bytes"]) if r.get("host_bytes") else "—", f(r["fits"]),
                     r["max_seq_len"] or "—", f(r["seconds"])] for r in j["rows"]])
    refused = [f"- {r['row']}: {r['error']}" for r in j["rows"] if r["error"]]
    if refused:
        lines += ["Refused by the compiler:", ""] + refused + [""]
    for entry in j["logits"]:
        lines.append(f"- {entry['seq_len']} tokens: temporaries {gib(entry['temp_bytes'])} GiB; float32 logits of "
                     f"every row of the three streams would be {gib(entry['streams_logits_bytes'])} GiB")
    return lines + [""], [["train_compile", "rows that fit / compiled",
                           f"{sum(1 for r in j['rows'] if r['fits'])} / {len(j['rows'])}"]]


def render_training(j: dict):
    rows = []
    for name, run in j["runs"].items():
        rows.append([name.replace("_", " "), f(run["seconds_median"]), run["noisy_rows"], f(run["diffusion_targets"]),
                     f(run["next_token_targets"]), f(run["diffusion_targets_per_second"]),
                     f(run["seconds_median"] / run["roofline_seconds"])])
    lines = table(["objective", "step s", "noisy rows / row", "masked targets", "next-token targets",
                   "masked targets/s", "step / roofline"], rows)
    lines.append("")
    lines.append(f"{j['model']} model, batch {j['batch']} x {j['seq_len']} tokens, block {j['block_size']}; "
                 f"masked diffusion targets/s ratio {f(j['diffusion_targets_ratio'])}.")
    lines.append("")
    return lines, [["training", "one pass / one block per example, masked diffusion targets/s",
                    f(j["checks"][0]["value"])],
                   ["training", "one-pass step / its roofline bound", f(j["step_over_roofline"])]]


def render_soak(j: dict):
    def row(when, phase):
        cache = phase["prefix_cache"]
        without = phase.get("rss_without_programs_bytes")
        return [when, phase["requests"], f(phase["rss_bytes"] / 2**30), f((phase["rss_trimmed_bytes"] or 0) / 2**30),
                f(without / 2**30 if without else None), phase["programs"], phase["live_arrays"], cache["bytes"],
                cache["hits"], cache["evicted"]]

    rows, done = [row("after the warm-up", j["after_warmup"])], j["warmup"]
    for phase in j["phases"]:
        done += phase["requests"]
        rows.append(row(f"after {done} requests", phase))
    lines = table(["when", "requests in the phase", "resident GiB", "after malloc_trim", "without the programs",
                   "engine programs",
                   "live arrays", "prefix cache bytes", "cache hits", "evictions"], rows)
    lines.append("")
    cache = j["prefix_cache"]
    lines.append(f"Concurrency {j['concurrency']}; phases: {j['traffic']}; 5xx or transport failures "
                 f"{j['server_errors']}; left in the engine {j['left_in_engine']}; prefix cache {cache['bytes']} of "
                 f"{cache['budget']} bytes, counted afresh {cache['counted']}; resident "
                 f"{f((j['rss_loaded_bytes'] or 0) / 2**30)} GiB with the model loaded, "
                 f"{f(j['rss_without_programs_bytes'] / 2**30)} GiB at the end with the compiled programs dropped.")
    lines.append("")
    return lines, [["soak", f"resident memory growth after the warm-up ({j['rss_growth_measured_on']})",
                    f(j["rss_growth"])]]


def render_lora(j: dict):
    rows = [[r["method"], r["trainable_parameters"], f(r["step_seconds"]), f(r["final_loss"]), f(r["full_match"]),
             f(r["answer_match"])] for r in j["results"]]
    lines = table(["method", "trainable parameters", "step s", "final loss", "exact match", "answer match"], rows)
    lines.append("")
    lines.append(f"{j['steps']} steps, {j['problems']} held-out problems of {j['task']['min_digits']}-"
                 f"{j['task']['max_digits']} digits, from the bundled tiny Clover.")
    lines.append("")
    return lines, [["lora", f"{r['method']}: held-out exact match", f(r["full_match"])] for r in j["results"]]


RENDER = {"decoding": render_decoding, "serving": render_serving, "serving_burst": render_serving_burst,
          "chunked_prefill": render_chunked_prefill, "serve_compile": render_serve_compile,
          "editing_schedules": render_editing_schedules,
          "constrained_decoding": render_constrained_decoding,
          "serving_http": render_serving_http,
          "prefix_cache": render_prefix_cache,
          "training": render_training,
          "soak": render_soak, "lora": render_lora,
          "forward_cost": render_forward_cost,
          "expert_scaling": render_expert_scaling, "context_scaling": render_context,
          "compile": render_compile, "moe_scaling": render_moe, "load": render_load, "load_orbax": render_load_orbax,
          "roofline": render_roofline, "compile_targets": render_compile_targets,
          "train_compile": render_train_compile}
TITLES = {"decoding": "Decoding: diffusion vs self-speculative vs autoregressive vs transformers "
                      "(`benchmarks/decoding.py`)",
          "serving": "Serving: the continuous-batching engine vs `generate` one request at a time "
                     "(`benchmarks/serving.py`)",
          "serving_burst": "Serving: `clover-jax serve --precompile` with default flags, then a first burst "
                           "(`benchmarks/serving_burst.py`)",
          "chunked_prefill": "Chunked prefill beside running requests (`benchmarks/chunked_prefill.py`)",
          "editing_schedules": "Token editing: LowConfidence against joint_threshold on the shipped, editing and "
                               "control models (`benchmarks/editing_schedules.py`)",
          "constrained_decoding": "Block diffusion under a grammar: the commit rules' parallelism "
                                  "(`benchmarks/constrained_decoding.py`)",
          "serve_compile": "Clover-35B's served set compiled for its accelerators (`benchmarks/serve_compile.py`)",
          "serving_http": "Serving through HTTP: the server under 16 `openai` clients vs `generate` one at a time "
                          "(`benchmarks/serving_http.py`)",
          "prefix_cache": "Prefix cache: an agent's growing transcript with and without it "
                          "(`benchmarks/prefix_cache.py`)",
          "training": "Training: the one-pass objective vs one block per example (`benchmarks/training.py`)",
          "soak": "Soak: one server under mixed requests (`benchmarks/soak.py`)",
          "lora": "LoRA and QLoRA vs full fine-tuning on a new task variant (`benchmarks/lora.py`)",
          "forward_cost": "Per-forward cost on a medium random model (`benchmarks/forward_cost.py`)",
          "expert_scaling": "8 vs 64 experts, same model otherwise (`benchmarks/expert_scaling.py`)",
          "context_scaling": "Denoising step vs prefix length (`benchmarks/context_scaling.py`)",
          "compile": "Compilation (`benchmarks/compile.py`)",
          "moe_scaling": "MoE layer vs number of experts (`benchmarks/moe_scaling.py`)",
          "load": "Checkpoint load (`benchmarks/load.py`)",
          "load_orbax": "Safetensors vs Orbax load (`benchmarks/load_orbax.py`)",
          "compile_targets": "Clover-35B compiled for TPU and GPU targets (`benchmarks/compile_targets.py`)",
          "roofline": "Roofline arithmetic (`benchmarks/roofline.py`)",
          "train_compile": "Clover-35B's train step compiled for TPU and GPU targets (`benchmarks/train_compile.py`)"}
