"""The `clover-jax` lm-eval model: `lm_eval.simple_evaluate` on a local task YAML over a JSONL of the
bundled model's prompts (no network), against direct `generate` calls; log-likelihoods against a
plain causal forward; bad model_args refused before loading."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from clover_jax.api.cli import BUNDLED_MODEL

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").is_file(),
                                reason="the bundled model is not in this checkout")
COUNT, MAX_GEN_TOKS = 6, 24


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval imported offline, and a task directory with a generate_until and a multiple-choice task."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is first imported
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield from _harness(tmp_path_factory)


def _harness(tmp_path_factory):
    lm_eval = pytest.importorskip("lm_eval")
    import clover_jax.api.lm_eval_model  # noqa: F401  (registers "clover-jax")
    from clover_jax.training.tiny.sort_digits import SortDigits

    root = tmp_path_factory.mktemp("lm_eval_tasks")
    task = SortDigits()
    problems = task.held_out(COUNT)
    rows = [{"prompt": task.user_message(p), "answer": task.answer(p), "choices": [task.answer(p), "0"]}
            for p in problems]
    data = root / "sort.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {root / 'cache'}\n"
              "test_split: test\ndoc_to_text: '{{prompt}}'\n")
    (root / "clover_sort.yaml").write_text(
        "task: clover_sort\n" + common + "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: ['<|im_end|>']\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (root / "clover_sort_choice.yaml").write_text(
        "task: clover_sort_choice\n" + common + "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: 0\nmetric_list:\n  - metric: acc\n")
    from lm_eval.tasks import TaskManager

    yield lm_eval, TaskManager(include_path=str(root), include_defaults=False), rows, root


def test_simple_evaluate_answers_generate_until_with_generate(harness):
    lm_eval, tasks, rows, _ = harness
    from clover_jax import CloverModel
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import generate

    results = lm_eval.simple_evaluate(model="clover-jax", model_args=f"pretrained={BUNDLED_MODEL},batch_size=4",
                                      tasks=["clover_sort"], task_manager=tasks, apply_chat_template=True,
                                      log_samples=True)
    samples = sorted(results["samples"]["clover_sort"], key=lambda sample: sample["doc_id"])
    got = [sample["resps"][0][0] for sample in samples]

    # the same prompts through the chat template and `generate`, the thinking and the stop string cut by hand
    tokenizer, model = Tokenizer.from_pretrained(BUNDLED_MODEL), CloverModel.from_pretrained(BUNDLED_MODEL,
                                                                                             progress=False)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for row in rows]
    expected = []
    for first in range(0, COUNT, 4):
        batch = prompts[first:first + 4]
        out = generate(model, batch + [batch[-1]] * (4 - len(batch)), max_new_tokens=MAX_GEN_TOKS)
        for sequence in out.sequences[:len(batch)]:
            text = tokenizer.decode(sequence, skip_special_tokens=True)
            expected.append(text.split("</think>")[-1].lstrip().split("<|im_end|>")[0])
    assert got == expected
    accuracy = results["results"]["clover_sort"]["exact_match,none"]
    assert accuracy == sum(text == row["answer"] for text, row in zip(expected, rows, strict=True)) / COUNT


def test_loglikelihoods_are_those_of_a_plain_causal_forward(harness):
    """A multiple-choice task scored in process: each choice's log-likelihood is the sum, over its
    tokens, of log_softmax of one plain causal forward over context + choice (the mask token
    excluded), and `is_greedy` says whether each of them is the likeliest; rolling too."""
    import numpy as np

    lm_eval, tasks, rows, _ = harness
    from clover_jax.api.lm_eval_model import CloverLM

    model = CloverLM(pretrained=str(BUNDLED_MODEL))
    results = lm_eval.simple_evaluate(model=model, tasks=["clover_sort_choice"], task_manager=tasks, log_samples=True)
    samples = sorted(results["samples"]["clover_sort_choice"], key=lambda sample: sample["doc_id"])
    mask = model._special.mask_token_id

    def log_softmax(ids: list[int]) -> np.ndarray:
        """One plain causal forward (right-padded to a power of two, as the scorer pads, so that the
        compiled forward is shared; causal, so the padding changes no earlier row), the mask token
        excluded, in float64."""
        padded = np.zeros((1, max(16, 1 << (len(ids) - 1).bit_length())), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.asarray(model.model.forward(padded)[0, :len(ids)], np.float64)
        logits[:, mask] = -np.inf
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

    def reference(context: str, continuation: str) -> tuple[float, bool]:
        head = model.tokenizer.encode(context, add_special_tokens=False)  # lm-eval's split: the context
        tail = model.tokenizer.encode(context + continuation, add_special_tokens=False)[len(head):]  # has no
        logp = log_softmax(head + tail)
        rows_ = np.arange(len(head) - 1, len(head) + len(tail) - 1)
        return float(logp[rows_, tail].sum()), bool((logp[rows_].argmax(-1) == tail).all())

    assert len(samples) == len(rows)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            value, greedy = response[0] if isinstance(response[0], (list, tuple)) else response
            expected, expected_greedy = reference(context, continuation)
            assert abs(value - expected) <= 1e-4 * max(1.0, abs(expected)), (value, expected)
            assert greedy == expected_greedy
    [rolling] = model.loglikelihood_rolling([type("R", (), {"args": ("sort 3 1 2",)})()])
    eos = model._special.eos_token_id[0]
    ids = [eos] + model.tokenizer.encode("sort 3 1 2", add_special_tokens=False)
    logp = log_softmax(ids)
    assert abs(rolling - logp[np.arange(len(ids) - 1), ids[1:]].sum()) <= 1e-4 * abs(rolling)


def test_unknown_model_args_are_refused_before_the_checkpoint_is_read(harness):
    from clover_jax.api.lm_eval_model import CloverLM

    with pytest.raises(ValueError, match=r"model_args \['bogus'\] are unknown"):
        CloverLM.create_from_arg_string("pretrained=/nonexistent,bogus=1")
    with pytest.raises(ValueError, match="needs model_args='pretrained=PATH'"):
        CloverLM.create_from_arg_string("block_size=8")


def test_the_readme_snippet_evaluates_by_model_name_in_a_fresh_interpreter(harness):
    """README's Python lm-eval example as written, in a new process (so that nothing this test
    session imported registers the model for it), with one change: the task is the local one (no
    network), passed with its task manager."""
    from tests.test_readme import python_block_after

    _, _, rows, root = harness
    code = python_block_after("in Python the import comes first")
    assert "import clover_jax.api.lm_eval_model" in code and 'model="clover-jax"' in code
    local = (f'tasks=["clover_sort"], task_manager=__import__("lm_eval.tasks").tasks.TaskManager('
             f'include_path={str(root)!r}, include_defaults=False)')
    code, replaced = re.subn(r'tasks=\["gsm8k"\]', local, code)
    assert replaced == 1
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                            cwd=BUNDLED_MODEL.parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'clover_sort'" in result.stdout and "exact_match,none" in result.stdout
