"""decoding.research: AUP against hand computations, sweeps against direct `generate` calls, the
built-in and JSONL tasks, records on disk, and the plot helper."""

from __future__ import annotations

import json
import math
import sys

import pytest

from clover_jax.api.cli import BUNDLED_MODEL
from clover_jax.api.research_tasks import sort_task
from decoding import generate, research
from decoding.research import SweepRecord, aup

EOS = 1
PROMPTS = [list(range(20, 31)), list(range(40, 51))]  # one prefix block each: one compiled shape


# ---------------------------------------------------------------------- AUP
def test_aup_of_one_point_is_its_rectangle():
    assert aup([2.5], [80.0], y_max=80.0) == 2.5 * 80.0


def test_aup_weights_accuracy_below_y_max_and_uses_the_trapezoid_rule():
    w78 = math.exp(-3.0 * (1 - 78 / 80))
    w70 = math.exp(-3.0 * (1 - 76 / 80))
    # rho 1 -> 80 %, 3 -> 78 %, 4 -> 76 % (given out of order)
    expected = 1 * 80 + 0.5 * (3 - 1) * (78 * w78 + 80 * 1.0) + 0.5 * (4 - 3) * (76 * w70 + 78 * w78)
    assert aup([3.0, 1.0, 4.0], [78.0, 80.0, 76.0], y_max=80.0) == pytest.approx(expected, rel=1e-12)
    # alpha and offset as given: alpha 1, and 76 is now more than 3 points below y_1 = 80 and dropped
    w78_alpha1 = math.exp(-1.0 * (1 - 78 / 80))
    assert aup([1.0, 3.0, 4.0], [80.0, 78.0, 76.0], 80.0, alpha=1.0, offset=3.0) == pytest.approx(
        80 + 0.5 * 2 * (78 * w78_alpha1 + 80), rel=1e-12)


def test_aup_drops_points_more_than_offset_below_the_first_and_caps_the_weight_at_one():
    # 74 < 80 - 5 is dropped; 76 stays and joins 80 directly
    w76 = math.exp(-3.0 * (1 - 76 / 90))
    w80 = math.exp(-3.0 * (1 - 80 / 90))
    assert aup([1, 2, 3], [80, 74, 76], y_max=90) == pytest.approx(80 + 0.5 * 2 * (76 * w76 + 80 * w80), rel=1e-12)
    # accuracies above y_max weigh 1, not more
    assert aup([1, 2], [90, 95], y_max=80) == pytest.approx(90 + 0.5 * (95 + 90), rel=1e-12)


@pytest.mark.parametrize("args, message", [
    (([1, 2], [80], 80), "as many accuracies"),
    (([], [], 80), "at least one"),
    (([1], [80], 0), "y_max > 0"),
    (([1], [math.nan], 80), "finite"),
])
def test_aup_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        aup(*args)


def record(schedule, block_size, tpf, accuracy, **params):
    return SweepRecord("t", schedule, params, block_size, accuracy, 10.0, tpf, 100.0, 1.0, 4, 12.0)


def test_aup_by_schedule_takes_y_max_over_every_record_and_one_curve_per_schedule_and_block_size():
    records = [record("a", 8, 2.0, 70.0), record("a", 8, 1.0, 90.0), record("b", 8, 3.0, 60.0),
               record("a", 16, 1.5, 80.0)]
    table = research.aup_by_schedule(records)
    assert table == {"a (B=8)": aup([1.0, 2.0], [90.0, 70.0], 90.0), "b (B=8)": aup([3.0], [60.0], 90.0),
                     "a (B=16)": aup([1.5], [80.0], 90.0)}


# ---------------------------------------------------------------------- sweeps
def ends_with_eos(index, response) -> float:
    return float(bool(response) and response[-1] == EOS)


def test_sweep_records_equal_direct_generate_calls_and_go_to_jsonl_and_csv(peaked, controls_config, tmp_path):
    """Two named schedules share one compiled decoder (a ScheduleSwitch); the low_confidence cells
    equal `generate` with that schedule alone."""
    task = research.Task("toy", PROMPTS, ends_with_eos, max_new_tokens=12)
    records = research.sweep(peaked, {"low_confidence": {"threshold": [0.9, 0.4]}, "fixed_k": [{"tokens_per_step": 3}]},
                             block_sizes=[8], task=task, generation_config=controls_config, progress=False,
                             output=[tmp_path / "sweep.jsonl", tmp_path / "sweep.csv"])
    assert [(r.schedule, r.params, r.block_size) for r in records] == [
        ("low_confidence", {"threshold": 0.9}, 8), ("low_confidence", {"threshold": 0.4}, 8),
        ("fixed_k", {"tokens_per_step": 3}, 8)]
    for threshold, result in zip((0.9, 0.4), records, strict=False):
        out = generate(peaked, PROMPTS, controls_config, max_new_tokens=12, schedule_params={"threshold": threshold})
        assert result.accuracy == 100.0 * sum(ends_with_eos(i, s) for i, s in enumerate(out.sequences)) / 2
        assert result.mean_nfe == sum(out.nfe) / 2
        assert result.tokens_per_forward == sum(map(len, out.sequences)) / sum(out.nfe)
        assert result.mean_response_tokens == sum(map(len, out.sequences)) / 2
        assert result.prompts == 2 and result.wall_time > 0
        assert result.tokens_per_second == pytest.approx(result.mean_response_tokens * 2 / result.wall_time)
    assert research.read_records(tmp_path / "sweep.jsonl") == records
    assert research.read_records(tmp_path / "sweep.csv") == records
    first = json.loads((tmp_path / "sweep.jsonl").read_text().splitlines()[0])
    assert first["schedule"] == "low_confidence" and first["params"] == {"threshold": 0.9}


def test_sweep_batches_pad_the_last_batch_and_give_the_unbatched_records(peaked, controls_config):
    task = research.Task("toy", PROMPTS + PROMPTS[:1], ends_with_eos, max_new_tokens=12)
    batched = research.sweep(peaked, ["low_confidence"], task=task, generation_config=controls_config,
                             batch_size=2, progress=False, warmup=False)[0]
    out = generate(peaked, PROMPTS, controls_config, max_new_tokens=12)  # the third prompt is the first again
    assert batched.mean_nfe == (2 * out.nfe[0] + out.nfe[1]) / 3 and batched.prompts == 3
    assert batched.mean_response_tokens == (2 * len(out.sequences[0]) + len(out.sequences[1])) / 3
    assert batched.params == {"threshold": controls_config.threshold}  # defaults are recorded


def test_schedule_switch_decides_as_each_named_rule(controls_config):
    """On random steps, the switch with `params(name, ...)` returns the named rule's decision."""
    import jax
    import numpy as np

    from decoding import schedules
    from tests.decoding.test_schedules import batched_view, random_steps, run_batched

    names = ["low_confidence", "fast_dllm_factor", "dream", "eb_sampler", "joint_threshold"]
    switch = research.ScheduleSwitch(names)
    assert switch == research.ScheduleSwitch(names) and hash(switch) == hash(research.ScheduleSwitch(names))
    p, decided, entropy, margin = random_steps(64, seed=21)
    steps = batched_view(p, decided, entropy, margin, step=np.arange(64) % 4)
    config = controls_config.replace(block_size=8)
    for name, given in [("low_confidence", {"threshold": 0.5}), ("fast_dllm_factor", None),
                        ("dream", {"alg": "entropy", "steps": 4}), ("eb_sampler", {"gamma": 0.3}),
                        ("joint_threshold", None)]:
        batched = lambda params: jax.tree_util.tree_map(lambda x: np.broadcast_to(x, (64,) + np.shape(x)), params)
        mine = run_batched(switch, steps, batched(switch.params(name, given, config)))
        theirs = run_batched(schedules.BY_NAME[name].rule, steps,
                             batched(schedules.resolve_params(name, given, config)))
        for field in ("decided", "edit", "keep_open"):
            assert np.array_equal(getattr(mine, field), getattr(theirs, field)), (name, field)


@pytest.mark.parametrize("schedules, message", [
    ({"dream": {"steps": [4, 0]}}, "'dream': steps must be >= 1"),
    ({"dream": {"alg": ["entropy"], "temperature": [1.0]}}, r"schedule 'dream' has no parameter \['temperature'\]"),
    (["nonesuch"], "unknown schedule 'nonesuch'"),
    ({"eb_sampler": 0.3}, "the grid of 'eb_sampler' must be"),
])
def test_a_bad_cell_anywhere_is_refused_before_anything_is_decoded(peaked, controls_config, monkeypatch, schedules,
                                                                   message):
    def never(*args, **kwargs):
        raise AssertionError("decoded before checking every cell")

    monkeypatch.setattr(research, "generate", never)
    task = research.Task("toy", PROMPTS, ends_with_eos, max_new_tokens=12)
    with pytest.raises(ValueError, match=message):
        research.sweep(peaked, {"low_confidence": None, **schedules} if isinstance(schedules, dict) else schedules,
                       task=task, generation_config=controls_config, progress=False)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        research.sweep(peaked, ["low_confidence"], block_sizes=[8, 0], task=task, generation_config=controls_config)
    with pytest.raises(ValueError, match="must end in .jsonl or .csv"):
        research.sweep(peaked, ["low_confidence"], task=task, generation_config=controls_config, output="x.txt")


# ---------------------------------------------------------------------- tasks
needs_bundled = pytest.mark.skipif(not (BUNDLED_MODEL / "tokenizer.json").is_file(),
                                   reason="the bundled model's tokenizer is not in this checkout")


@pytest.fixture(scope="module")
def tokenizer():
    from clover_jax.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(BUNDLED_MODEL)


@needs_bundled
def test_sort_task_prompts_are_the_chat_formatted_problems_and_it_scores_the_reference_response(tokenizer):
    from clover_jax.training.tiny.sort_digits import SortDigits

    task = sort_task(tokenizer, count=5, min_digits=9, max_digits=12)
    problems = SortDigits(9, 12).held_out(5)
    assert task.name == "sort9-12" and len(task.prompts) == 5
    for index, problem in enumerate(problems):
        assert 9 <= len(problem) <= 12
        assert tokenizer.decode(task.prompts[index]) == SortDigits(9, 12).prompt_text(problem)
        assert "sort " + " ".join(map(str, problem)) in tokenizer.decode(task.prompts[index])
        reference = tokenizer.encode(SortDigits(9, 12).response_text(problem), add_special_tokens=False)
        assert task.score(index, reference) == 1.0
        assert task.score(index, reference[:-1]) == 0.0  # no <|im_end|>
    assert task.max_new_tokens == len(tokenizer.encode(SortDigits(9, 12).response_text((9,) * 12),
                                                       add_special_tokens=False))


@needs_bundled
def test_jsonl_task_chat_formats_each_prompt_and_scores_the_text_after_thinking(tokenizer, tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"prompt": "sort 3 1 2", "answer": "1 2 3"}) + "\n\n" +
                    json.dumps({"prompt": "sort 5 4", "answer": "4 5"}) + "\n")
    task = research.jsonl_task(path, tokenizer, max_new_tokens=16)
    assert task.name == "tiny" and task.max_new_tokens == 16
    assert task.prompts[0] == tokenizer.apply_chat_template([{"role": "user", "content": "sort 3 1 2"}],
                                                            add_generation_prompt=True, return_dict=False)
    right = tokenizer.encode("<think>\n3 digits\n</think>\n\n1 2 3<|im_end|>", add_special_tokens=False)
    assert task.score(0, right) == 1.0 and task.score(1, right) == 0.0
    raw = research.jsonl_task(path, tokenizer, chat=False)
    assert raw.prompts[1] == tokenizer.encode("sort 5 4", add_special_tokens=False)
    path.write_text('{"prompt": "sort 1"}\n')
    with pytest.raises(ValueError, match="tiny.jsonl:1 must be an object with a string 'prompt' and an 'answer'"):
        research.jsonl_task(path, tokenizer)


# ---------------------------------------------------------------------- plot
def test_plot_tradeoff_draws_one_line_per_schedule_and_block_size():
    import matplotlib

    matplotlib.use("Agg")
    records = [record("a", 8, 2.0, 70.0, threshold=0.5), record("a", 8, 1.0, 90.0, threshold=0.9),
               record("b", 16, 3.0, 60.0)]
    ax = research.plot_tradeoff(records, title="t")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {"a (B=8)": ([1.0, 2.0], [90.0, 70.0]), "b (B=16)": ([3.0], [60.0])}
    assert sorted(text.get_text() for text in ax.texts) == ["0.5", "0.9"]  # the varying parameter


def test_plot_tradeoff_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        research.plot_tradeoff([record("a", 8, 1.0, 50.0)])
