"""`scripts/device_check.py` runs in one command: here on CPU at small shapes (the kernels in
interpret mode against their oracles, a random model decoding), as it will on the first GPU or
TPU at the real shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_runs_and_every_kernel_equals_its_oracle(tmp_path):
    out, report = tmp_path / "check.json", tmp_path / "check.md"
    completed = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "scripts", "device_check.py"), "--small", "--groups", "1",
         "--repeats", "1", "--out", str(out), "--markdown", str(report)],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["all_passed"] and result["small"]
    kernels = {row["kernel"] for row in result["kernels"]}
    assert {"gdn_chunk", "grouped_matmul gate_up", "grouped_matmul (coreset) down", "paged_attention"} <= kernels
    # the same bfloat16 inputs, float32 accumulation; paged attention weighs bfloat16 values with
    # bfloat16 attention weights, as flash attention does
    assert all(row["relative_error"] < (2e-2 if row["kernel"] == "paged_attention" else 1e-4)
               for row in result["kernels"])
    assert result["decoding"]["autoregressive_tokens_per_s"] > 0 and result["decoding"]["layers"] == 4
    assert result["engine"]["pass_ms_1_slots"] > 0 and result["engine"]["pass_ms_16_slots"] > 0
    assert "Device check on" in report.read_text()
