"""The `clover-jax` command line, run as a user runs it (subprocesses) on a tiny random Clover with
a real tokenizer and chat template. Each generating subprocess pays the jax import and one
compile, so there are few; the error cases stop before anything is compiled (most before jax is
imported). Ctrl-C is sent at each stage of a run: importing, loading, compiling, streaming."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from clover_jax.api import cli
from clover_jax.text.tokenizer import Tokenizer
from tests.clover_jax.text.test_tokenizer import write_chat_checkpoint

PROMPT = "What is diffusion?"
SCRIPT = os.path.join(os.path.dirname(sys.executable), "clover-jax")


def cli_env(**extra: str) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", **extra)


def run_cli(*args: str | bytes, stdin: str | bytes | None = None, script: bool = False) -> subprocess.CompletedProcess:
    """Run the command; stdout and stderr come back as text, whatever the input was."""
    command = [SCRIPT] if script else [sys.executable, "-m", "clover_jax"]
    data = stdin.encode() if isinstance(stdin, str) else stdin
    result = subprocess.run(command + list(args), input=data, capture_output=True, env=cli_env(), timeout=600)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def default_sigint():
    """The child's SIGINT as a terminal leaves it (a shell running the tests in the background ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_chat_checkpoint(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def json_run(checkpoint):
    result = run_cli("generate", "--model", checkpoint, "--json", "--show-steps", "-n", "12", "--threshold", "0.9",
                     PROMPT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_generate_json_reports_the_response_and_its_metrics(checkpoint, json_run):
    record, _ = json_run
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                               enable_thinking=True, return_dict=False)
    metrics, ids = record["metrics"], record["token_ids"]
    assert record["prompt_tokens"] == len(prompt_ids)
    assert 1 <= record["response_tokens"] == len(ids) <= 12
    assert record["response"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert record["generation_config"]["threshold"] == 0.9 and record["generation_config"]["block_size"] == 8
    # the prompt fills two blocks: one prefill, then one forward per denoising step (docs/design.md §4)
    assert metrics["nfe"] == 1 + sum(metrics["steps_per_block"])
    assert metrics["tokens_per_forward"] == pytest.approx(len(ids) / metrics["nfe"], abs=1e-4)
    # rounded to 2 decimals, so below 1 token/s (a slow machine) the rounding dominates
    assert metrics["tokens_per_second"] == pytest.approx(len(ids) / metrics["seconds"], rel=0.01, abs=0.006)
    assert metrics["includes_compile"] is True
    assert len(record["trajectory"]["step"]) == len(ids)


def test_show_steps_replays_every_denoising_step_of_every_block(json_run):
    record, stderr = json_run
    frames = [line for line in stderr.splitlines() if line.startswith("block ")]
    steps = record["metrics"]["steps_per_block"]
    fill = record["trajectory"]["step"]
    tail = record["prompt_tokens"] % 8
    blocks = (tail + np.arange(len(fill))) // 8
    shown = blocks[-1] + 1
    last_frame = [steps[b] for b in range(shown - 1)] + [max(np.asarray(fill)[blocks == shown - 1])]
    assert len(frames) == sum(last_frame)  # every step; the last block until its shown positions are decided
    assert cli.MASK_GLYPH in frames[0]
    for block in range(shown):
        last = [f for f in frames if f.startswith(f"block {block} step {last_frame[block]:>2}/{steps[block]}")]
        assert len(last) == 1 and cli.MASK_GLYPH not in last[0]  # a decided block has no masks left
    # positions filled at step 1 of block 0 are decided in its first frame, the others are still masked
    first_block_steps = fill[:8 - tail]
    assert frames[0].count(cli.MASK_GLYPH) == sum(1 for s in first_block_steps if s > 1)


def test_generate_streams_the_same_text_as_json(checkpoint, json_run):
    record, _ = json_run
    result = run_cli("generate", "--model", checkpoint, "-n", "12", "--threshold", "0.9", PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == record["response"] + "\n"
    assert f"-- {record['response_tokens']} tokens" in result.stderr


def test_generate_autoregressive_without_thinking(checkpoint):
    result = run_cli("generate", "--model", checkpoint, "--mode", "autoregressive", "--no-think", "--json", "-n", "6",
                     "-", stdin=PROMPT)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    no_think = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             enable_thinking=False, return_dict=False)
    assert record["prompt_tokens"] == len(no_think)
    assert record["metrics"]["nfe"] == record["response_tokens"] <= 6  # one causal forward per token


@pytest.mark.parametrize("args, status, message", [
    (["generate", "--model", "/no/such/dir", "hi"], 1, "checkpoint directory '/no/such/dir' does not exist"),
    (["generate", "--revision", "v2", "hi"], 2, "--revision applies to a Hub id given with --model"),
    (["generate", b"sort \xff\xfe 1"], 2, "the prompt is not valid UTF-8 (at character 5)"),
    (["generate", "--threshold", "1.5", "hi"], 2, "argument --threshold: threshold must be in (0, 1]"),
    (["generate", "--block-size", "two", "hi"], 2, "argument --block-size: expected an integer, got 'two'"),
    (["generate", "--schedule", "fastest", "hi"], 2, "argument --schedule: invalid choice: 'fastest'"),
    (["generate", "--do-sample", "--temperature", "0", "hi"], 2, "--temperature: temperature must be > 0"),
    (["generate", "--eos-token-id", "100000", "-n", "4", "hi"], 2, "--eos-token-id: eos_token_id [100000] is outside"),
    (["generate", "-n", "4", "word " * 600], 1, "exceed the model's context of 512 tokens"),
    (["generate", "--top-k", "100000", "-n", "4", "hi"], 2, "--top-k: top_k 100000 is larger than the vocabulary"),
    (["generate", "--quantize", "int9", "hi"], 2, "--quantize: quantize='int9': expected 'int8' or 'int4'"),
    (["generate", "--adapter", "/no/such/adapter", "hi"], 2, "--adapter '/no/such/adapter' is not a directory"),
    (["serve", "--quantize", "int4-gx"], 2, "--quantize: quantize='int4-gx'"),
    (["serve", "--body-timeout", "0"], 2, "--body-timeout must be > 0 seconds"),
    (["serve", "--prefix-cache-grid", "0"], 2, "--prefix-cache-grid must be >= 1, got 0"),
    (["serve", "--precompile", "diffusion,fastest"], 2, "--precompile takes modes among diffusion, autoregressive"),
])
def test_errors_are_one_line_with_a_nonzero_status(checkpoint, args, status, message):
    if "--model" not in args and "--revision" not in args and args[0] == "generate":
        args = [args[0], "--model", checkpoint] + args[1:]
    result = run_cli(*args)
    assert result.returncode == status
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_precompile_names_the_served_modes():
    """`serve --precompile` alone compiles every mode; with a list, those (the server's set; an
    unknown mode is refused before loading, above)."""
    from clover_jax.api.cli.serve import precompiled_modes
    from decoding.modes import MODES

    assert precompiled_modes(None) == ()
    assert precompiled_modes("all") == MODES == ("diffusion", "autoregressive", "self_speculative")
    assert precompiled_modes("diffusion") == ("diffusion",)
    assert precompiled_modes("self_speculative, diffusion,diffusion") == ("self_speculative", "diffusion")


def test_info_counts_every_checkpoint_tensor_and_estimates_memory(checkpoint):
    from safetensors.numpy import load_file

    result = run_cli("info", checkpoint, "--json", script=os.path.exists(SCRIPT))
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    parameters = record["parameters"]
    assert parameters["total"] == sum(t.size for t in tensors.values())
    routed = parameters["routed_experts"]
    assert parameters["active_per_token"] == parameters["total"] - routed + routed * 2 // 8  # top-2 of 8
    memory = record["memory"]["by_dtype"]
    assert memory["float32"]["parameters"] == 4 * parameters["total"]
    assert memory["bfloat16"]["parameters"] == 2 * parameters["total"]
    assert record["memory"]["context"] == 512 and record["files"]["chat_template"]
    text = cli.format_info(record)
    assert "active per token" in text and "bfloat16" in text


def test_plan_prints_the_api_plan_for_a_named_target(checkpoint):
    import clover_jax

    result = run_cli("plan", checkpoint, "--target", "v5e-4", "--context-length", "4096", "--batch", "2", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    expected = clover_jax.plan(checkpoint, "v5e-4", context_length=4096, batch=2)
    assert [option["weights"] for option in record["options"]] == [option.weights for option in expected.options]
    assert [option["weight_bytes"] for option in record["options"]] == [o.weight_bytes for o in expected.options]
    assert record["options"][0]["mesh"] == {"data": 1, "expert": 4, "tensor": 1}
    assert record["recommendation"] == 0 and record["reason"] == expected.reason
    assert "compiled" not in record["options"][0]  # no --compile: the arithmetic alone
    table = run_cli("plan", checkpoint, "--target", "v5e-4", "--context-length", "4096", "--batch", "2")
    assert table.stdout.strip() == str(expected)


def test_plan_of_a_training_run_prints_the_api_plan(checkpoint):
    import clover_jax
    from clover_jax.training.config import FinetuneConfig

    flags = ["--task", "train", "--method", "lora", "--lora-rank", "8", "--quantize", "int4", "--lora-targets",
             "attention,gdn", "--batch", "4", "--seq-len", "64", "--block-size", "4"]
    result = run_cli("plan", checkpoint, "--target", "v5e-4", *flags, "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    expected = clover_jax.plan(checkpoint, "v5e-4", task="train", block_size=4, config=FinetuneConfig(
        method="lora", lora_rank=8, quantize="int4", lora_targets=("attention", "gdn"), batch_size=4, seq_len=64,
        block_size=4))
    (option,) = record["options"]
    assert option["mesh"] == expected.options[0].mesh == {"data": 4, "expert": 1, "tensor": 1}
    assert option["weight_bytes"] == expected.options[0].weight_bytes and option["remat"] == "none"
    assert option["weights"] == "qlora r8 int4 base" and record["reason"] == expected.reason
    assert option["offload_base"] is False
    offloaded = json.loads(run_cli("plan", checkpoint, "--target", "v5e-4", *flags, "--offload-base", "--json").stdout)
    assert offloaded["options"][0]["offload_base"] and offloaded["options"][0]["remat"] == "layer"
    assert offloaded["options"][0]["weights"] == "qlora r8 int4 base, layers in host memory"
    bad = run_cli("plan", checkpoint, "--target", "v5e-4", "--task", "train", "--method", "full", "--quantize", "int4")
    assert bad.returncode != 0 and "quantize" in bad.stderr


@pytest.mark.parametrize("args, message", [
    (["--target", "v7-1"], "argument --target: unknown target 'v7-1'"),
    (["--target", "v6e-1", "--batch", "0"], "arguments --batch and --context-length must be >= 1"),
    ([], "the following arguments are required: --target"),
])
def test_plan_refuses_bad_arguments_before_reading_anything(args, message):
    result = run_cli("plan", "/no/such/checkpoint", *args)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""


def test_every_generation_config_field_is_a_generate_flag():
    import dataclasses

    from decoding import GenerationConfig

    parser = cli.build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    flags = {option for action in generate._actions for option in action.option_strings}
    missing = [f.name for f in dataclasses.fields(GenerationConfig) if cli.flag_name(f.name) not in flags]
    assert not missing
    args = parser.parse_args(["generate", "--eos-token-id", "1", "2", "--no-coreset", "--threshold", "0.5",
                              "--max-steps-per-block", "3", "--schedule", "margin", "x"])
    assert cli.generation_overrides(args) == {"eos_token_id": (1, 2), "coreset": False, "threshold": 0.5,
                                              "max_steps_per_block": 3, "schedule": "margin"}


def test_show_steps_renders_prompt_tail_masks_and_fills(capsys):
    class Letters:  # a tokenizer whose token i is the letter chr(97 + i)
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i) for i in ids)

    from decoding import GenerationConfig

    config = GenerationConfig(block_size=4, max_new_tokens=5)
    # prompt of 6 tokens: its last 2 open block 0; the response fills 2 + 3 positions over two blocks
    cli.render_steps(Letters(), [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [2, 1, 1, 3, 2], [2, 3], config, sys.stdout)
    lines = capsys.readouterr().out.splitlines()
    glyph = cli.MASK_GLYPH
    assert [line.split("│")[1] for line in lines] == [f"ef{glyph}h", "efgh", f"i{glyph}{glyph}", f"i{glyph}k", "ijk"]
    assert [line.split("│")[2].strip() for line in lines] == ["3/4", "4/4", "1/3", "2/3", "3/3"]
    assert lines[0].startswith("block 0 step  1/2") and lines[2].startswith("block 1 step  1/3")


def test_invalid_utf8_on_standard_input_is_a_usage_error(checkpoint):
    result = run_cli("generate", "--model", checkpoint, "-", stdin=b"sort 3 \xc3\x28 1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "clover-jax generate: error: standard input is not valid UTF-8 (byte 0xc3 at offset 7) "
        "(see clover-jax generate --help)"]


def test_a_hub_id_that_cannot_be_resolved_is_named(tmp_path):
    result = subprocess.run([sys.executable, "-m", "clover_jax", "generate", "--model", "tiny-org/missing", "hi"],
                            capture_output=True, text=True, timeout=300,
                            env=cli_env(HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"clover-jax: error: 'tiny-org/missing' is neither a local directory nor in the Hub cache {tmp_path} "
        "(HF_HUB_OFFLINE=1)"]


def test_a_runaway_chat_template_is_one_line_before_anything_loads(checkpoint, tmp_path):
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name in os.listdir(checkpoint):
        os.symlink(os.path.join(checkpoint, name), hostile / name)
    (hostile / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    result = run_cli("generate", "--model", str(hostile), PROMPT)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "clover-jax: error: chat template stopped: it ran more than 1000000 loop iterations and calls"]


# ---------------------------------------------------------------------- Ctrl-C
# Runs the real `cli.main` after arranging for SIGINT to reach the process at one stage: the signal
# is sent from inside that stage (so the stage is certain), then the stage goes on as if nothing
# happened; the process must end there with one line and status 130.
INTERRUPT_AT = r"""
import os, signal, sys, time

stage = sys.argv[1]


def interrupt(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(120)  # the stage keeps going; the process must end without coming back here
    raise SystemExit("still running after SIGINT")


if stage == "import":  # while jax is being imported
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "jax":
                interrupt()
            return None

    sys.meta_path.insert(0, Finder())
elif stage == "load":  # while the weights load
    import weights.loader

    weights.loader.load_params = interrupt
elif stage == "stream":  # inside the listener of the first decided block, with the decoding loop in flight
    from clover_jax.api import cli

    cli._StreamPrinter.__call__ = interrupt
from clover_jax.api import cli

sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("stage", ["import", "load", "stream"])
def test_ctrl_c_at_any_stage_exits_130_with_one_line(checkpoint, stage):
    command = [sys.executable, "-c", INTERRUPT_AT, stage, "generate", "--model", checkpoint, "--quiet", "-n", "12",
               PROMPT]
    result = subprocess.run(command, capture_output=True, text=True, env=cli_env(), timeout=600,
                            preexec_fn=default_sigint)
    assert (result.returncode, result.stderr) == (130, "clover-jax: interrupted\n")
    assert result.stdout == ""


def test_ctrl_c_from_outside_while_compiling_exits_at_once(checkpoint):
    """As a user presses Ctrl-C: SIGINT from another process while XLA compiles the decoding loop
    (the main thread is inside XLA, where Python cannot run a signal handler until it returns)."""
    process = subprocess.Popen([sys.executable, "-m", "clover_jax", "generate", "--model", checkpoint, "-n", "12",
                                PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                               preexec_fn=default_sigint)
    lines = []
    for line in process.stderr:  # the status line printed once the weights are loaded
        lines.append(line.decode())
        if "decoding (" in lines[-1]:
            break
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    stdout, stderr = process.communicate(timeout=300)
    assert time.perf_counter() - sent < 10  # not once the compilation is over
    assert process.returncode == 130, (lines, stderr)
    assert stderr.decode().splitlines() == ["clover-jax: interrupted"] and stdout == b""


def test_generate_keeps_to_a_constraint_and_names_the_flag_of_a_bad_one():
    import re

    import clover_jax

    answer = r"\n\n(a|bb)( (a|bb))*"
    regex = r"<think>\n[0-9]+ digits\n</think>" + answer
    result = run_cli("generate", "--model", str(clover_jax.bundled_model_path()), "--json", "--constraint",
                     json.dumps({"regex": regex}), "sort 3 1 2")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["generation_config"]["constraint"]["kind"] == "regex"
    assert re.fullmatch(answer, record["response"].split("</think>")[-1]), record["response"]
    bad = run_cli("generate", "--model", str(clover_jax.bundled_model_path()), "--constraint", '{"regex": "("}', "x")
    assert bad.returncode == 2 and "--constraint: the regex cannot be compiled" in bad.stderr, bad.stderr
    assert "loading" not in bad.stderr  # refused before the weights load
