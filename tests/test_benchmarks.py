"""Smoke tests of the benchmark scripts, so they cannot rot: the roofline arithmetic against the
model card's public numbers, one timed script end to end in `--quick` mode, and the driver's
rendering of `docs/benchmarks.md` from script output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    completed = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", f"{name}.py"), *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120,
                               cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_roofline_parameter_counts_match_the_model_card():
    from benchmarks.roofline import parameter_counts, step_cost

    counts = parameter_counts()
    assert abs(counts["total"] / 1e9 - 34.7) < 0.2  # model card: 34.7B parameters
    assert abs(counts["active_per_token"] / 1e9 - 3.0) < 0.15  # "~3B active"
    # BF16 weights ~69 GB (the model card): every parameter at 2 bytes.
    assert abs(2 * counts["total"] / 1e9 - 69.3) < 0.5
    fewer, more = step_cost(32, 1, 4096, 32.0), step_cost(32, 1, 4096, 163.0)
    assert fewer["bytes"] < more["bytes"] and fewer["flops"] == more["flops"]


def test_moe_scaling_quick_runs_and_both_implementations_agree():
    result = run_script("moe_scaling", "--quick")
    assert result["benchmark"] == "moe_scaling" and result["results"]
    for entry in result["results"]:
        assert entry["clover_xla_s"]["median"] > 0
        assert entry["max_relative_difference"] < 1e-4


def test_run_all_renders_a_table_from_script_output():
    from benchmarks import run_all
    from benchmarks.roofline import report

    host = {"cpu_model": "test cpu", "cores": 2, "ram_gib": 1.0, "load_average_1m": 0.0, "jax_backend": "cpu",
            "devices": ["cpu:0"], "versions": {"jax": "x"}, "date": "today"}
    results = [{"name": "roofline", "seconds": 0.1, "returncode": 0, "json": report(4096, 32)},
               {"name": "compile", "seconds": 1.0, "returncode": 1, "stderr_tail": "boom"}]
    text = run_all.render(results, host, quick=True, total_seconds=1.0)
    assert "test cpu, 2 cores" in text and "| roofline |" in text and "**Failed** (exit 1)" in text


def test_run_all_keeps_the_saved_results_of_the_scripts_it_did_not_run(tmp_path):
    from benchmarks import run_all
    from benchmarks.roofline import report

    host = {"cpu_model": "test cpu", "cores": 2, "ram_gib": 1.0, "load_average_1m": 0.0, "jax_backend": "cpu",
            "devices": ["cpu:0"], "versions": {"jax": "x"}, "date": "today"}
    saved = [{"name": "roofline", "seconds": 0.1, "returncode": 0,
              "json": dict(report(4096, 32), machine={"date": "yesterday"})},
             {"name": "compile", "seconds": 1.0, "returncode": 1, "stderr_tail": "boom"},  # failed: not kept
             {"name": "load", "seconds": 1.0, "returncode": 0, "json": {}}]                 # rerun now: not kept
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(saved))
    reused = run_all.reuse(str(path), ran=["load"])
    assert [(result["name"], result["reused"]) for result in reused] == [("roofline", True)]
    text = run_all.render(reused, host, quick=False, total_seconds=1.0)
    assert "Reused from the run of yesterday." in text and "except roofline, reused from earlier runs" in text
    assert run_all.reuse(str(tmp_path / "missing.json"), ran=["load"]) == []


def test_the_diffusion_ceiling_charges_each_diffusion_forward_one_autoregressive_step():
    """Per prompt: F = the 1-token autoregressive call, s = (call - F) / (NFE - 1); the ideal diffusion
    call is F + NFE_diffusion * s, plus the diffusion call's measured host time."""
    from benchmarks import run_all
    from benchmarks.common import check
    from benchmarks.decoding import diffusion_ceiling

    ms = 1e-3
    first = {"per_prompt": [{"outside": 0.2 * ms, "inside": 1.0 * ms, "nfe": 1, "tokens": 1}]}
    ar = {"per_prompt": [{"outside": 0.2 * ms, "inside": 2.3 * ms, "nfe": 14, "tokens": 14}]}  # s = 0.1 ms
    diffusion = {"per_prompt": [{"outside": 0.4 * ms, "inside": 3.0 * ms, "nfe": 2, "tokens": 14}]}
    ceiling = diffusion_ceiling(diffusion, ar, first)
    # ideal diffusion: 0.4 + 1.0 + 2 * 0.1 = 1.6 ms for 14 tokens; autoregressive: 2.5 ms for 14 tokens
    assert abs(ceiling["tokens_per_s_ratio"] - 2.5 / 1.6) < 1e-9
    assert abs(ceiling["forward_cost_ratio"] - (1.2 / 2) / (2.3 / 14)) < 1e-9
    assert abs(ceiling["autoregressive_fixed_ms"] - 1.0) < 1e-9 and abs(ceiling["host_ms"] - 0.4) < 1e-9
    missed = check("ratio", 0.8, 2.5, True, bound=ceiling["tokens_per_s_ratio"], bound_kind="fixed-cost ceiling")
    assert not missed["passed"] and missed["met_at_roofline"] is False
    assert run_all.bound_text(missed) == "1.56 (fixed-cost ceiling)"
    assert run_all.bound_text(check("time", 3.0, 1.5, False, bound=1.0)) == "1"
