"""The `FinetuneConfig` flags of `clover-jax train` and `clover-jax plan --task train`: one per field,
each with its help line, the same names and defaults in both commands, argparse's choices where a
field's values are a closed set. Parsed in process (nothing runs)."""

from __future__ import annotations

import dataclasses

import pytest

from clover_jax.api.cli import build_parser
from clover_jax.api.cli.info import _finetune_config
from clover_jax.api.cli.train import config_from_flags
from clover_jax.training.config import FinetuneConfig

TRAIN = ["train", "--model", "m", "--data", "d.jsonl", "--out", "o"]
PLAN = ["plan", "--target", "v5e-4", "--task", "train"]
FIELDS = {field.name: field for field in dataclasses.fields(FinetuneConfig)}
CLOSED = [name for name, field in FIELDS.items() if field.metadata["choices"]]


def command(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def flags_of(name: str) -> dict:
    return {action.dest: action for action in command(name)._actions}


@pytest.mark.parametrize("name, left_out", [("train", {"generation_config"}),
                                            ("plan", {"generation_config", "batch_size"})])
def test_every_field_is_a_flag_with_a_help_line(name, left_out):
    flags = flags_of(name)
    for field in FIELDS:
        if field in left_out:
            continue
        assert field in flags, field
        assert FIELDS[field].metadata["help"] in flags[field].help, field
    assert "(default: none)" in flags["quantize"].help and "(default: 2048)" in flags["seq_len"].help


def test_the_closed_sets_are_the_ones_the_issue_names():
    assert set(CLOSED) == {"method", "loss_weighting", "param_dtype", "remat", "lora_targets", "quantize",
                           "edit_substitutes"}
    assert flags_of("train")["method"].choices == ("full", "lora")
    assert flags_of("plan")["quantize"].choices == ("int8", "int4", "none")  # none: the default, a float base
    assert "layer_offload" in flags_of("train")["remat"].choices


@pytest.mark.parametrize("prefix", [TRAIN, PLAN], ids=["train", "plan"])
@pytest.mark.parametrize("field", CLOSED)
def test_a_value_outside_a_closed_set_is_an_argparse_error_naming_the_choices(prefix, field, capsys):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*prefix, flag, "attention,dora" if field == "lora_targets" else "dora"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'dora'" in error
    assert all(choice in error for choice in FIELDS[field].metadata["choices"]), error


def test_plan_builds_the_run_as_train_does_with_the_same_defaults():
    given = ["--method", "lora", "--lora-rank", "8", "--lora-targets", "attention,gdn", "--quantize", "int4",
             "--seq-len", "64", "--block-size", "4", "--no-complementary", "--grad-accum-steps", "2"]
    trained = config_from_flags(build_parser().parse_args([*TRAIN, *given, "--batch-size", "4"]))
    planned = _finetune_config(build_parser().parse_args([*PLAN, *given, "--batch", "4"]))
    assert planned == trained == FinetuneConfig(method="lora", lora_rank=8, lora_targets=("attention", "gdn"),
                                                quantize="int4", seq_len=64, block_size=4, complementary=False,
                                                grad_accum_steps=2, batch_size=4)
    # nothing given: FinetuneConfig's own defaults (method "full", 2,048 tokens, batch 8), as `train` has them
    assert _finetune_config(build_parser().parse_args(PLAN)) == FinetuneConfig() == \
        config_from_flags(build_parser().parse_args(TRAIN))
    # an offloaded base without --remat: the first remat that copies each layer in again (the planner's choice)
    offloaded = _finetune_config(build_parser().parse_args([*PLAN, "--method", "lora", "--offload-base"]))
    assert offloaded.offload_base and offloaded.remat == "layer"


def test_a_training_flag_is_refused_when_planning_decoding(tmp_path):
    from clover_jax.api.cli.common import UsageError
    from clover_jax.api.cli.info import run_plan

    args = build_parser().parse_args(["plan", str(tmp_path), "--target", "v5e-4", "--seq-len", "64"])
    with pytest.raises(UsageError, match="--seq-len: a fine-tuning run's, for --task train"):
        run_plan(args)


def test_plan_refuses_an_option_of_the_other_task_before_reading_the_model():
    import clover_jax

    with pytest.raises(TypeError, match=r"plan\(task='decode'\) takes no seq_lens: its options are context_length"):
        clover_jax.plan("/no/such/checkpoint", "v5e-4", seq_lens=(4096,))
    with pytest.raises(TypeError, match=r"plan\(task='train'\) takes no context_length: its options are config"):
        clover_jax.plan("/no/such/checkpoint", "v5e-4", task="train", context_length=4096)
