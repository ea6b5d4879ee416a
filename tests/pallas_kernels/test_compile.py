"""Every Pallas kernel compiles — not only lowers — for TPU v6e and an H200 (sm_90), at
Clover-35B-A3B's shapes and with the arguments the model passes: the GDN chunk scan (a prefill
chunk and a block commit, and differentiated with its block states, as the training pass runs
it), the routed experts' grouped matmul in bfloat16 (megablox on TPU), int8 and int4 (our
kernel, dequantising tile by tile), and with `active_groups` (a coreset); and the grouped
matmul's backward pass as training differentiates it (d lhs and d rhs for bfloat16 weights —
megablox gmm/tgmm on TPU, our Triton kernels on the H200 — d lhs through int8 / int4); and the
serving engine's attention over K/V pages (head dim 256, pages of 16, a pass of 1,024 tokens).

Deviceless ahead-of-time compilation runs the real compilers here (Mosaic's layout passes,
Triton + ptxas), so a kernel that lowers but that the compiler refuses fails here — as Mosaic
once refused the grouped matmul's HIGHEST-precision dot on bfloat16 operands ("Bad lhs type").
The compilers live beside the environment (`clover_jax.parallel.compilers`; `make test` installs
them) and run in a subprocess (`compile_kernels_run.py`, which also compiles for TPU v5e when
run by hand; `make bench` compiles v5e's kernels inside the whole decoding loops and train step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.pallas_kernels import compile_kernels_run as run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from clover_jax.parallel.compilers import compilers_dir, installed, subprocess_environment

    assert installed(), (f"the TPU/GPU compilers are not installed in {compilers_dir()}: "
                         "python -m clover_jax.parallel.compilers install (make test does)")
    out = str(tmp_path_factory.mktemp("kernels") / "compiled.json")
    command = [sys.executable, "-m", "tests.pallas_kernels.compile_kernels_run", out, *run.SUITE_TARGETS]
    subprocess.run(command, check=True, env=subprocess_environment(dict(os.environ, CLOVER_JAX_CACHE_DIR="")),
                   timeout=2400, cwd=ROOT, capture_output=True)
    with open(out) as handle:
        return json.load(handle)


def expected_cases() -> list[str]:
    """Every target × case the runner compiles (its case list, read without importing JAX's compilers)."""
    names = []
    for fmt in run.FORMATS:
        for matmul in run.MATMULS:
            names += [f"experts/{fmt or 'bf16'}/{matmul}/{rows}" for rows in (run.TOKENS * run.TOP_K, 32 * run.TOP_K)]
            names.append(f"experts_active_groups/{fmt or 'bf16'}/{matmul}")
        names.append(f"experts_backward/{fmt or 'bf16'}/gate_up")
    return [f"{target}/{name}" for target in run.SUITE_TARGETS
            for name in [f"gdn_chunk/{tokens}" for tokens in run.GDN_TOKENS[run.PLATFORMS[target]]] + names
            + ["paged_attention"]]


def gdn_backward_cases() -> list[str]:
    """The differentiated GDN training rule's cases (`compile_kernels_run.gdn_backward_cases`)."""
    return [f"{target}/gdn_chunk_backward/{run.TOKENS}" for target in run.SUITE_TARGETS]


def test_every_kernel_case_was_compiled(compiled):
    assert sorted(compiled) == sorted(expected_cases() + gdn_backward_cases())


@pytest.mark.parametrize("case", gdn_backward_cases())
def test_the_gdn_training_rule_compiles_with_its_backward_pass(compiled, case):
    """value_and_grad through the block-state kernel: the forward is the Pallas custom call, and the
    gradients come back in the inputs' dtypes (bf16 values and betas get bf16 gradients)."""
    result = compiled[case]
    assert "error" not in result, result["error"]
    assert result["custom_call"]
    qk = [[1, run.TOKENS, run.KEY_HEADS, run.HEAD_DIM], "float32"]
    per_token = [1, run.TOKENS, run.VALUE_HEADS]
    assert result["out"] == [[[], "float32"], qk, qk, [[1, run.TOKENS, run.VALUE_HEADS, run.HEAD_DIM], "bfloat16"],
                             [per_token, "float32"], [per_token, "bfloat16"]]


@pytest.mark.parametrize("case", expected_cases())
def test_the_kernel_compiles_for_the_target(compiled, case):
    result = compiled[case]
    assert "error" not in result, result["error"]
    assert result["custom_call"]  # the Pallas kernel itself, not an XLA fallback
    name = case.split("/")
    if name[1] == "gdn_chunk":
        tokens = int(name[2])
        assert result["out"] == [[[1, tokens, run.VALUE_HEADS, run.HEAD_DIM], "float32"],
                                 [[1, run.VALUE_HEADS, run.HEAD_DIM, run.HEAD_DIM], "float32"]]
    elif name[1] == "experts_backward":
        check_expert_backward(name[2], name[3], result)
    elif name[1] == "paged_attention":
        paged = run.PAGED
        assert result["out"] == [[[paged["tokens"], paged["heads"], paged["head_dim"]], "bfloat16"]]
    else:
        cols = run.MATMULS[name[3]][1]
        rows = int(name[4]) if name[1] == "experts" else 32 * run.TOP_K
        assert result["out"] == [[[rows, cols], "bfloat16"]]
        # Quantised experts are dequantised per tile inside the kernel: no [experts, out, in] float
        # copy of the weights exists among the program's temporaries.
        depth = run.MATMULS[name[3]][0]
        assert result["temp_bytes"] < run.EXPERTS * cols * depth * 2 // 16


def check_expert_backward(fmt: str, matmul: str, result: dict) -> None:
    """The vjp of one routed-expert matmul: d lhs, and for bfloat16 weights d rhs (a frozen quantised
    base gets none); neither a transposed nor a dequantised copy of the stack among the temporaries."""
    depth, cols = run.MATMULS[matmul]
    d_lhs = [[run.BACKWARD_ROWS, depth], "bfloat16"]
    assert result["out"] == ([d_lhs, [[run.EXPERTS, cols, depth], "bfloat16"]] if fmt == "bf16" else [d_lhs])
    assert result["temp_bytes"] < run.EXPERTS * cols * depth * 2 // 16
