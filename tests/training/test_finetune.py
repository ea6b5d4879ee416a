"""`finetune` / `clover-jax train` end to end: a shortened conversion of the bundled autoregressive
base into a Clover, bad data refused before anything compiles, and bitwise resumption after SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from clover_jax.training import FinetuneConfig, finetune
from clover_jax.training.examples import DataError
from clover_jax.training.tiny.recipe import BASE_DIR, Recipe, task_controls, write_task_data

CONVERSION = FinetuneConfig(steps=24, batch_size=8, seq_len=64, block_size=16, learning_rate=3e-3, warmup_steps=4,
                            log_every=4, load_balance_weight=0.0, generation_config=task_controls(Recipe()))


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("task")
    return write_task_data(directory / "train.jsonl", Recipe().task, count=400, seed=0, thinking_fraction=0.8)


REACHED: list[tuple[str, int]] = []  # the fault points the `converted` run reported


@pytest.fixture(scope="module")
def converted(task_data, tmp_path_factory):
    from clover_jax.training import faults

    out = tmp_path_factory.mktemp("converted")
    remove = faults.inject(lambda point, step: REACHED.append((point, step)))
    try:
        return finetune(BASE_DIR, task_data, out, config=CONVERSION, progress=False)
    finally:
        remove()


def test_the_loop_reports_every_step_to_the_fault_seam(converted):
    # no checkpoint_dir, so no saves: the "save" point is killed at in the resumption test below
    assert REACHED == [("step", step) for step in range(1, CONVERSION.steps + 1)]


def test_the_bundled_base_is_a_qwen_model_without_a_mask_token():
    with open(os.path.join(BASE_DIR, "config.json")) as handle:
        config = json.load(handle)
    assert config["model_type"] == "qwen3_5_moe_text" and "mask_token_id" not in config
    with open(os.path.join(BASE_DIR, "tokenizer_config.json")) as handle:
        assert "<|mask|>" not in json.dumps(json.load(handle))


def test_a_short_conversion_lowers_the_loss_and_raises_masked_accuracy(converted):
    first, last = converted.metrics[0], converted.metrics[-1]
    assert last["diffusion_loss"] < 0.5 * first["diffusion_loss"]
    assert last["masked_accuracy"] > first["masked_accuracy"] + 0.2
    assert [record["step"] for record in converted.metrics] == [4, 8, 12, 16, 20, 24]
    for name in ("loss", "diffusion_loss", "next_token_loss", "masked_accuracy", "tokens", "seconds"):
        assert name in last
    lines = open(os.path.join(converted.out, "metrics.jsonl")).read().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8, 12, 16, 20, 24]
    assert os.path.isfile(os.path.join(converted.out, "loss.png"))


def test_the_converted_model_is_a_clover_with_a_mask_token_past_the_tokenizer(converted):
    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import GenerationConfig

    with open(os.path.join(converted.out, "config.json")) as handle:
        config = json.load(handle)
    tokenizer = Tokenizer.from_pretrained(converted.out)
    base = Tokenizer.from_pretrained(BASE_DIR)
    assert config["model_type"] == "clover_moe" and config["vocab_size"] == 128  # no resize: 127 < 128
    assert config["mask_token_id"] == len(base) == 127 and tokenizer.token_to_id("<|mask|>") == 127
    generation = GenerationConfig.from_pretrained(converted.out)
    assert generation.mask_token_id == 127 and generation.block_size == 16 and generation.threshold == 0.9
    model = CloverModel.from_pretrained(converted.out, strict=True, progress=False)
    gdn = model.params["groups"]["layer_0"]["linear_attn"]
    assert np.abs(np.asarray(gdn["conv1d_right_weight"])).max() > 0  # block-mode tensors trained from their defaults


@pytest.mark.parametrize("mode", ["diffusion", "autoregressive", "self_speculative"])
def test_the_converted_model_decodes_in_every_mode(converted, mode):
    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import generate

    model = CloverModel.from_pretrained(converted.out, progress=False, chunk_size=64)
    tokenizer = Tokenizer.from_pretrained(converted.out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "sort 3 1 2 5"}], add_generation_prompt=True,
                                           return_dict=False)
    out = generate(model, [prompt], mode=mode, max_new_tokens=16)
    assert 1 <= len(out.sequences[0]) <= 16 and out.nfe[0] >= 1


def test_bad_data_is_refused_before_anything_compiles(task_data, tmp_path, monkeypatch):
    from clover_jax.training import loop

    monkeypatch.setattr(loop, "train_step", lambda *a, **k: pytest.fail("a step ran"))
    bad = tmp_path / "bad.jsonl"
    lines = open(task_data).read().splitlines()[:5] + ['{"messages": [{"role": "user", "content": 1}]}']
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 6"):
        finetune(BASE_DIR, str(bad), tmp_path / "out", config=CONVERSION, progress=False)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"text": "9 " * 100}) + "\n")
    with pytest.raises(DataError, match=r"long\.jsonl, line 1: the example holds"):
        finetune(BASE_DIR, str(long), tmp_path / "out", config=CONVERSION, progress=False)


RESUMED = ["--steps", "6", "--batch-size", "2", "--seq-len", "64", "--block-size", "16", "--learning-rate", "3e-3",
           "--warmup-steps", "1", "--log-every", "1", "--checkpoint-every", "2", "--no-progress"]


# `clover-jax train` with a fault injected (`clover_jax.training.faults`): "POINT:STEP" first, then the flags.
KILLED_AT = """
import runpy, sys
from clover_jax.training import faults

point, step = sys.argv[1].split(":")
faults.inject(faults.kill_at(point, int(step)))
sys.argv = ["clover-jax", *sys.argv[2:]]
runpy.run_module("clover_jax", run_name="__main__")
"""


def train_command(data, out, checkpoints=None, kill_at=None, dry=False):
    """Run `clover-jax train` on the resumption settings, killed at `kill_at` ("POINT:STEP") when
    given (`dry`: return the command instead)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "clover_jax", "train", "--model", BASE_DIR, "--data", data, "--out", str(out),
               *RESUMED]
    if checkpoints:
        command += ["--checkpoint-dir", str(checkpoints)]
    if dry:
        return command
    if kill_at:
        command = [sys.executable, "-c", KILLED_AT, kill_at, *command[3:]]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


def test_a_run_killed_inside_a_step_and_during_a_save_resumes_to_the_same_checkpoint_bit_for_bit(task_data, tmp_path):
    straight = train_command(task_data, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    steps = [json.loads(line)["step"] for line in straight.stdout.splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]
    checkpoints = tmp_path / "checkpoints"
    for kill_at in ("step:3", "save:4"):  # inside step 3 (after step 2's checkpoint); while saving step 4's
        killed = train_command(task_data, tmp_path / "resumed", checkpoints, kill_at)
        assert killed.returncode == -9, killed.stderr
        assert not (tmp_path / "resumed").exists()
    resumed = train_command(task_data, tmp_path / "resumed", checkpoints)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in resumed.stdout.splitlines() if '"loss"' in line]
    # step 4's save never finished: the run resumed from step 2's checkpoint, and logs from step 3
    assert [record["step"] for record in records] == [3, 4, 5, 6]
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    assert [json.loads(line)["loss"] for line in open(tmp_path / "resumed" / "metrics.jsonl")] == \
        [json.loads(line)["loss"] for line in open(tmp_path / "straight" / "metrics.jsonl")]


FULL_DISK_AT_SAVE = """
import resource, runpy, signal, sys
from clover_jax.training import checkpointing

save = checkpointing.Saver.maybe_save


def maybe_save(self, step, *args, **kwargs):
    if step == LIMIT_STEP:  # the disk fills just before this save, once the earlier ones are written
        self.manager.wait_until_finished()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    return save(self, step, *args, **kwargs)


checkpointing.Saver.maybe_save = maybe_save
sys.argv = ["clover-jax", *sys.argv[1:]]
runpy.run_module("clover_jax", run_name="__main__")
"""


def test_a_full_disk_during_a_checkpoint_save_fails_the_run_and_it_resumes_from_the_previous_one(task_data,
                                                                                                 tmp_path):
    """The disk fills (RLIMIT_FSIZE, reaching TensorStore's writes) just before step 4's save: the run
    fails with an error, step 2's checkpoint stays whole, and the same command afterwards resumes
    from it and writes what an uninterrupted run writes."""
    straight = train_command(task_data, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    checkpoints = tmp_path / "checkpoints"
    command = train_command(task_data, tmp_path / "resumed", checkpoints, dry=True)
    script = FULL_DISK_AT_SAVE.replace("LIMIT_STEP", "4")
    full = subprocess.run([sys.executable, "-c", script, *command[3:]], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900)
    assert full.returncode == 1, full.stdout
    # the run's own error: one line naming the directory and the checkpoint a rerun resumes from (Orbax
    # logs the failure of each of its writer threads above it too)
    errors = [line for line in full.stderr.splitlines() if line.startswith("clover-jax: error:")]
    assert len(errors) == 1, full.stderr[-6000:]
    assert f"saving a training checkpoint in {checkpoints} failed: File too large" in errors[0] and \
        "the checkpoint of step 2 is whole" in errors[0], errors[0]
    assert not (tmp_path / "resumed" / "model.safetensors").exists()
    resumed = train_command(task_data, tmp_path / "resumed", checkpoints)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in resumed.stdout.splitlines() if '"loss"' in line]
    assert [record["step"] for record in records] == [3, 4, 5, 6]  # from step 2's checkpoint
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name


def test_a_save_whose_failure_orbax_only_logs_is_still_reported_before_the_next_save(tmp_path):
    """Orbax's save finalizer may catch a writer thread's error and only log it; the run must not go
    on as if the checkpoint existed: the next save (and `close`) finds the step unpublished on disk and
    fails with the logged OS error, naming the checkpoint a rerun resumes from."""
    from absl import logging as absl_logging

    from clover_jax.training.batches import DataPosition
    from clover_jax.training.checkpointing import Saver

    state = {"w": np.arange(6, dtype=np.float32)}
    saver = Saver(tmp_path / "checkpoints", every=2)
    saver.maybe_save(2, state, DataPosition(2, ()), [], final=False)

    def swallowed(step, **kwargs):  # what a finalizer that caught the failure leaves: nothing published
        try:
            raise ValueError("OUT_OF_RANGE: Failed to write 64 bytes to file 7: No space left on device "
                             "[os_error_code='28']")
        except ValueError:
            absl_logging.error("Checkpointer failed: one or more items may not be finalized", exc_info=True)
        return True

    published = saver.manager.save
    saver.manager.save = swallowed
    saver.maybe_save(4, state, DataPosition(4, ()), [], final=False)
    saver.manager.save = published
    with pytest.raises(OSError, match="the checkpoint of step 2 is whole") as raised:
        saver.maybe_save(6, state, DataPosition(6, ()), [], final=True)
    assert raised.value.errno == 28 and "No space left on device" in str(raised.value)
    assert not (tmp_path / "checkpoints" / "6").exists()  # nothing newer was published over the gap
    saver.close()
