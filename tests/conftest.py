"""Session fixtures: tiny random checkpoints written by transformers' `save_pretrained`.

Every parameter (norm weights, A_log, dt_bias included) is redrawn at a scale that keeps the
activations O(1), so parity tests compare numbers that matter rather than near-zeros.
"""

from __future__ import annotations

import gc
import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# torch's OpenMP workers spin-wait after each op and starve XLA's threads on a 2-core machine
# (the suite slowed down many times over, with half the CPU in the kernel); one torch thread suffices
# for the tiny reference models.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's programs are small and each runs a few times, so XLA:CPU's LLVM optimisation passes cost
# more than they save: without them a test file of the tiny models ran in 2/3 of the time (121 s vs
# 188 s for tests/clover_jax/nn/test_block_mode.py, cold caches; the whole suite ran in 22 min where it
# had taken 54-74 on the same class of machine). Neither level uses fast-math and the order of every
# reduction is fixed before LLVM, so results can differ only in float32's last bits (e.g. where the
# optimiser contracts a multiply-add); every parity bound holds. Subprocesses inherit the flags.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
# One persistent compilation cache for the session, its pytest-xdist workers and its subprocesses
# included: tests never read or fill the user's cache, and workers, CLI and notebook subprocesses
# reuse each other's programs (writes are atomic renames, so workers may share it). The process
# that made it (the controller, or a run without workers) removes it at the end; workers inherit
# the variable.
_SESSION_CACHE = None
if "CLOVER_JAX_CACHE_DIR" not in os.environ:
    import tempfile

    _SESSION_CACHE = os.environ["CLOVER_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="clover-jax-test-cache-")


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
    """After each test module, free the compiled programs it left in memory (they stay in the
    session's cache on disk). Every live XLA:CPU executable holds memory mappings; one process
    running the whole suite reached the kernel's limit (vm.max_map_count, 65530) and XLA aborted
    (SIGABRT in a compile, in the 200-prompt self-speculative test, about 1400 s in)."""
    yield
    from clover_jax.core import executable_cache

    executable_cache.clear_caches()
    gc.collect()


# Seconds each of the longest test files took on one of 2 workers (junit testcase times summed per
# file, setup of its module fixtures included; a clean-clone run of December 2026, the three files cut
# since then scaled by their measured cut), longest first. `make test` hands whole files to the
# workers (--dist loadfile --no-loadscope-reorder) in this order, then the rest in collection order:
# longest-processing-time-first, so that no long file starts late and runs alone while the other
# worker idles (simulated on the 2-worker schedule from the junit times: 1943 s, the sum of all
# files being 3876 s, i.e. 1938 s per worker).
# Re-measure when a file's time changes by tens of seconds or a new long file is added: a missing
# one runs in collection order, i.e. late.
LONGEST_FIRST_SECONDS = {
    "tests/clover_jax/parallel/test_sharding.py": 242,
    "tests/training/test_sharded_training.py": 230,
    "tests/clover_jax/parallel/test_compile_targets.py": 218,
    "tests/decoding/test_schedules.py": 205,
    "tests/decoding/test_generate.py": 201,
    "tests/clover_jax/api/serving/test_server.py": 182,
    "tests/test_notebooks.py": 162,
    "tests/clover_jax/parallel/test_served_set_compile.py": 130,
    "tests/training/test_finetune.py": 162,
    "tests/decoding/test_engine.py": 134,
    "tests/clover_jax/nn/test_long_context.py": 120,
    "tests/training/test_lora.py": 116,
    "tests/training/test_loss.py": 112,
    "tests/clover_jax/parallel/test_train_compile.py": 112,
    "tests/test_soak.py": 111,
    "tests/clover_jax/nn/test_block_mode.py": 108,
    "tests/pallas_kernels/test_compile.py": 108,
    "tests/decoding/test_engine_mesh.py": 106,
    "tests/clover_jax/api/serving/test_openai_conformance.py": 105,
    "tests/decoding/test_speculative.py": 100,
    "tests/clover_jax/api/test_cli.py": 98,
    "tests/decoding/test_constraints_generate.py": 70,
    "tests/clover_jax/api/serving/test_agent_requests.py": 70,
    "tests/decoding/test_constraints_json.py": 68,
}
LONGEST_FIRST = tuple(sorted(LONGEST_FIRST_SECONDS, key=LONGEST_FIRST_SECONDS.get, reverse=True))


def pytest_collection_modifyitems(session, config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath)
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), root), len(rank)))  # stable otherwise


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)

from tests.checkpoints import (  # noqa: E402
    QWEN36_LIKE,
    TIED_ONE_TO_ONE,
    TWO_LAYERS,
    add_clover_tensors,
    rewrite_fused_multimodal,
    write_hf_checkpoint,
)

MASK_ID = QWEN36_LIKE["vocab_size"] - 1


@pytest.fixture(scope="session")
def qwen36_checkpoint(tmp_path_factory) -> str:
    """Qwen3.6 ratios scaled down: 2 groups of (3 GDN + 1 attention), value heads = 2 x key heads."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen36_like"), QWEN36_LIKE, seed=0)


@pytest.fixture(scope="session")
def tied_checkpoint(tmp_path_factory) -> str:
    """A second shape: 1 GDN : 1 attention, tied embeddings, one K/V head, rotary 0.5."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("tied"), TIED_ONE_TO_ONE, seed=1)


@pytest.fixture(scope="session")
def fused_checkpoint(qwen36_checkpoint, tmp_path_factory) -> str:
    """The qwen36_like weights as a sharded multimodal checkpoint with fused experts."""
    return rewrite_fused_multimodal(qwen36_checkpoint, str(tmp_path_factory.mktemp("fused")))


@pytest.fixture(scope="session")
def clover_checkpoint(qwen36_checkpoint, tmp_path_factory) -> str:
    """The qwen36_like backbone with random Clover block-mode tensors and a clover_moe config."""
    return add_clover_tensors(qwen36_checkpoint, str(tmp_path_factory.mktemp("clover")), mask_token_id=MASK_ID)


@pytest.fixture(scope="session")
def small_clover_checkpoint(tmp_path_factory) -> str:
    """A two-layer random Clover (TWO_LAYERS with block-mode tensors): the serving tests' model."""
    backbone = write_hf_checkpoint(tmp_path_factory.mktemp("two_layers"), TWO_LAYERS, seed=2)
    return add_clover_tensors(backbone, str(tmp_path_factory.mktemp("small_clover")), mask_token_id=MASK_ID)


@pytest.fixture(scope="session")
def qwen_vocab_checkpoint(tmp_path_factory) -> str:
    """A two-layer random Clover with Qwen3.5/3.6's real vocabulary and a chat template with tools
    (scripts/make_qwen_vocab_model.py): a model that can write JSON."""
    from scripts.make_qwen_vocab_model import write

    return write(str(tmp_path_factory.mktemp("qwen_vocab")))


@pytest.fixture(scope="session")
def clover(clover_checkpoint):
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(clover_checkpoint, progress=False)


@pytest.fixture(scope="session")
def hf_model(qwen36_checkpoint):
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    torch.set_num_threads(1)
    return Qwen3_5MoeForCausalLM.from_pretrained(qwen36_checkpoint).eval()


@pytest.fixture(scope="session")
def clover_model(qwen36_checkpoint):
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(qwen36_checkpoint, progress=False)


@pytest.fixture
def checkpoint_copy(qwen36_checkpoint, tmp_path):
    """A writable copy of the qwen36_like checkpoint, for tests that damage it."""
    target = tmp_path / "copy"
    shutil.copytree(qwen36_checkpoint, target)
    return str(target)


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle)


def token_ids(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype(np.int32)
