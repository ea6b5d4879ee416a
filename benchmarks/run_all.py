"""Run every benchmark script (each in its own process, one after another) and write
`docs/benchmarks.md`: the machine (CPU model, cores, RAM, load, library versions), the date, a
summary table of the headline figures and ratios, one table per benchmark, and each script's
full JSON output.

Scripts: decoding.py, serving.py (the serving engine against `generate` one request at a time),
serving_burst.py (`clover-jax serve --precompile` with default flags on the bundled and medium
models, then a first burst against later ones), chunked_prefill.py (a long prompt's prefill beside
running requests), serving_http.py (the server in a subprocess under 16 `openai` clients, against the same baseline),
prefix_cache.py (an agent's growing transcript with and without the engine's prefix cache), soak.py
(one server under a thousand mixed requests: memory, leftovers, errors), training.py, lora.py (LoRA
and QLoRA against full fine-tuning), editing_schedules.py (joint_threshold against LowConfidence on the
token-editing variant of the bundled model), constrained_decoding.py (block diffusion's parallelism under a
grammar: the witness and frontier commit rules against no constraint)
(the train step's objectives side by side),
forward_cost.py, expert_scaling.py, context_scaling.py, compile.py, moe_scaling.py, load.py,
load_orbax.py (the last two with their own defaults), roofline.py
(arithmetic only), compile_targets.py (Clover-35B compiled for every named accelerator; about
half an hour on 2 cores), train_compile.py (Clover-35B's train step compiled for the fine-tuning
configurations of docs/training.md, "What fits where"), serve_compile.py (Clover-35B's served set
compiled for the H200, v5e-8 and v6e-1 serving commands). A script that fails is reported in the
document with its exit status and the tail of its stderr; the others still run.

Targets: each script lists its `checks` (a figure, its target, and, where the script can work it
out, the best the figure can be on this machine from its measured bandwidth and matmul rate).
The document opens with all of them; the run exits with status 1, naming every missed figure,
when any target is missed (or a script failed).

Every full-size run also writes each script's result to `docs/benchmarks.json`; a run with
`--only` renders the whole document from its fresh results and, for the other scripts, the saved
ones (each such section says the date it was measured), so one benchmark can be rerun without
the others (the whole set takes about 1.5 hours on 2 cores).

Usage: `python benchmarks/run_all.py [--quick] [--only decoding compile ...] [--out docs/benchmarks.md]
[--results docs/benchmarks.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import REPO_ROOT, machine, setup_environment  # noqa: E402
from benchmarks.sections import RENDER, TITLES, bound_text, f, table  # noqa: E402,F401  (bound_text: run_all's API)

setup_environment()

SCRIPTS = ["decoding", "serving", "serving_burst", "chunked_prefill", "serving_http", "prefix_cache", "soak",
           "training", "lora", "editing_schedules", "constrained_decoding", "forward_cost", "expert_scaling",
           "context_scaling", "compile", "moe_scaling", "load",
           "load_orbax", "roofline", "compile_targets", "train_compile", "serve_compile"]
QUICK_ARGS = {"serving_burst": ["--models", "bundled", "--later", "1", "--new", "16"],
              "load": ["--gigabytes", "0.4", "--repetitions", "1"],
              "load_orbax": ["--gigabytes", "0.4", "--repetitions", "1"]}


def run_script(name: str, quick: bool) -> dict:
    args = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", f"{name}.py")]
    if quick:
        args += QUICK_ARGS.get(name, ["--quick"])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    started = time.perf_counter()
    completed = subprocess.run(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    seconds = time.perf_counter() - started
    print(f"run_all: {name} finished in {seconds:.0f}s (exit {completed.returncode})", file=sys.stderr)
    result = {"name": name, "seconds": seconds, "returncode": completed.returncode}
    text = completed.stdout.strip()
    try:
        result["json"] = json.loads(text)  # load.py prints indented JSON
    except json.JSONDecodeError:
        try:
            result["json"] = json.loads(text.splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            pass
    if completed.returncode != 0:
        result["stderr_tail"] = completed.stderr[-3000:]
        if "json" in result and result["json"].get("checks") and not all(c["passed"] for c in result["json"]["checks"]):
            result["returncode"] = 0  # it ran, and said which of its targets it missed: its checks report them
        else:
            result.pop("json", None)
    return result


# ---------------------------------------------------------------------- rendering
def render(results: list[dict], host: dict, quick: bool, total_seconds: float) -> str:
    v = host["versions"]
    lines = ["# Benchmarks", "",
             f"Generated by `benchmarks/run_all.py`{' --quick (smoke-test sizes: not for reading)' if quick else ''} "
             f"on {host['date']} in {total_seconds / 60:.1f} minutes. Every figure below was measured in that run "
             "(except the roofline, which is arithmetic)" + reused_note(results) + "; methods compared with each "
             "other ran alternately in one process, and figures are medians over rounds (samples in the JSON at "
             "the end).", "",
             "## Machine", "",
             f"- CPU: {host['cpu_model']}, {host['cores']} cores; RAM {host['ram_gib']} GiB; JAX backend "
             f"{host['jax_backend']} ({', '.join(host['devices'])})",
             f"- Load average (1 min) when the run started: {host['load_average_1m']} — the machine was shared "
             "with other jobs, so absolute times are noisy; compare within a row, not across runs.",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), "",
             "How to read it: the decoding benchmark's tokens per forward and accuracy mean something only on "
             "the trained bundled model (random weights decide about one token per denoising step); `transformers` "
             "on CPU runs its reference PyTorch Gated DeltaNet and causal-conv code (no flash-linear-attention / "
             "causal-conv1d kernels on CPU), with torch threads = cores; a ratio below 1 is reported as measured, "
             "with the evidence the script collects (see forward_cost's XLA cost analysis).", "",
             "## Summary", ""]
    summary_rows, sections = [], []
    for result in results:
        name = result["name"]
        date = result.get("json", {}).get("machine", {}).get("date", "an earlier run")
        when = f" Reused from the run of {date}." if result.get("reused") else ""
        wall = f"{result['seconds']:.0f} s" if result.get("seconds") else "not recorded"
        sections += [f"## {TITLES[name]}", "", f"Wall time of the script: {wall}.{when}", ""]
        if result["returncode"] != 0:
            sections += [f"**Failed** (exit {result['returncode']}):", "", "```", result["stderr_tail"], "```", ""]
            summary_rows.append([name, "failed", f"exit {result['returncode']}"])
            continue
        body, summary = RENDER[name](result["json"])
        sections += body
        summary_rows += summary
    lines += table(["benchmark", "measurement", "value"], summary_rows)
    lines += ["## Targets", "", "Each target figure of the issues, as measured in this run. \"At the roofline\" is the "
              "figure this machine would show if every pass in it ran exactly at its roofline bound (bytes over "
              "the measured read bandwidth, FLOPs over the measured matmul rate; `benchmarks/cost_model.py`): "
              "the best value of a time against its bound, and for a ratio of two times the ratio of their "
              "bounds; \"—\" where the script cannot work one out. Where the bound is not a roofline, the "
              "column names it: a ceiling measured by the benchmark (its section says how).", ""]
    lines += table(["figure", "value", "target", "met", "at the roofline", "target met at the roofline"],
                   [[c["name"], f(c["value"]), f"{c['direction']} {f(c['target'])}", f(c["passed"]),
                     bound_text(c), f(c["met_at_roofline"])] for c in all_checks(results)])
    lines += sections
    lines += ["## Raw JSON", ""]
    for result in results:
        if "json" in result:
            lines += [f"<details><summary>{result['name']}</summary>", "", "```json",
                      json.dumps(result["json"], indent=1)[:20000], "```", "", "</details>", ""]
    return "\n".join(lines)


def reused_note(results: list[dict]) -> str:
    reused = [r["name"] for r in results if r.get("reused")]
    return f", except {', '.join(reused)}, reused from earlier runs (dated in their sections)" if reused else ""


def reuse(path: str, ran: list[str]) -> list[dict]:
    """The saved results of the scripts not in `ran` (successful ones only), marked as reused."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        saved = {result["name"]: result for result in json.load(handle)}
    return [dict(saved[name], reused=True) for name in SCRIPTS
            if name not in ran and name in saved and saved[name].get("returncode") == 0 and "json" in saved[name]]


def all_checks(results: list[dict]) -> list[dict]:
    return [dict(c, script=r["name"]) for r in results for c in r.get("json", {}).get("checks", [])]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every script in its smoke-test mode")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, help="run these scripts only")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "docs", "benchmarks.md"))
    parser.add_argument("--results", default=os.path.join(REPO_ROOT, "docs", "benchmarks.json"),
                        help="every script's result (JSON), rewritten by each full-size run; with --only, the "
                             "document keeps the other scripts' results from it, dated as reused")
    args = parser.parse_args(argv)
    host = machine()
    started = time.perf_counter()
    ran = args.only or SCRIPTS
    results = [run_script(name, args.quick) for name in ran]
    seconds = time.perf_counter() - started
    if not args.quick:
        results = sorted(results + reuse(args.results, ran), key=lambda result: SCRIPTS.index(result["name"]))
        with open(args.results, "w") as handle:
            json.dump([{k: v for k, v in result.items() if k != "reused"} for result in results], handle, indent=1)
            handle.write("\n")
    text = render(results, host, args.quick, seconds)
    with open(args.out, "w") as handle:
        handle.write(text + "\n")
    missed = [c for c in all_checks(results) if not c["passed"]]
    failed = [r["name"] for r in results if r["returncode"] != 0]
    print(json.dumps({"out": args.out, "scripts": {r["name"]: {"seconds": round(r["seconds"], 1),
                                                               "returncode": r["returncode"]}
                                                   for r in results if not r.get("reused")},
                      "reused": [r["name"] for r in results if r.get("reused")],
                      "missed_targets": [c["name"] for c in missed], "failed_scripts": failed}))
    for c in missed:
        kind = c.get("bound_kind", "roofline")
        reach = "" if c["met_at_roofline"] is None else (
            f" (at the {kind}: {f(c['at_roofline'])}, which meets the target)" if c["met_at_roofline"] else
            f" (at the {kind}: {f(c['at_roofline'])}, which misses the target too)")
        print(f"run_all: target missed: {c['name']} = {f(c['value'])}, target {c['direction']} {f(c['target'])}"
              f"{reach}", file=sys.stderr)
    for name in failed:
        print(f"run_all: script failed: {name}", file=sys.stderr)
    if (missed or failed) and not args.quick:
        sys.exit(1)


if __name__ == "__main__":
    main()
