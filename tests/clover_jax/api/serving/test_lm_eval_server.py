"""lm-eval's own OpenAI-API models (`local-chat-completions`, `local-completions`) against the server
on a local task of the bundled model's prompts, offline: every response equals `generate` alone
on the same prompt, and the reported accuracy is the one those responses give."""

from __future__ import annotations

import json

import pytest

from clover_jax.training.tiny.sort_digits import SortDigits
from decoding import generate

COUNT, MAX_GEN_TOKS = 6, 24


@pytest.fixture(scope="module")
def harness(tmp_path_factory, bundled_server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        lm_eval = pytest.importorskip("lm_eval")
        from lm_eval.tasks import TaskManager

        _, service = bundled_server
        task = SortDigits()
        rows = []
        for problem in task.held_out(COUNT):
            message = task.user_message(problem)
            rendered = service.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                             add_generation_prompt=True, tokenize=False)
            rows.append({"prompt": message, "rendered": rendered, "answer": task.answer(problem),
                         "choices": [task.answer(problem), "0 1"]})
        root = tmp_path_factory.mktemp("lm_eval_server_tasks")
        data = root / "sort.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                  f"  cache_dir: {root / 'cache'}\n"
                  "test_split: test\noutput_type: generate_until\ndoc_to_target: '{{answer}}'\n"
                  f"generation_kwargs:\n  until: ['<|im_end|>']\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
                  "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
        (root / "sort_chat.yaml").write_text("task: clover_sort_chat\ndoc_to_text: '{{prompt}}'\n" + common)
        # completions: the prompt already rendered by the chat template; the answer is what follows </think>
        (root / "sort_text.yaml").write_text(
            "task: clover_sort_text\ndoc_to_text: '{{rendered}}'\n" + common
            + "filter_list:\n  - name: answer\n    filter:\n      - function: regex\n"
              "        regex_pattern: '</think>\\s*(.*)'\n      - function: take_first\n")
        (root / "sort_choice.yaml").write_text(  # log-likelihoods: the rendered prompt, then each choice
            "task: clover_sort_choice\ndoc_to_text: '{{rendered}}'\n" + common.split("output_type")[0]
            + "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: 0\n"
              "metric_list:\n  - metric: acc\n")
        yield lm_eval, TaskManager(include_path=str(root), include_defaults=False), rows


def expected_texts(service, rows) -> list[str]:
    texts = []
    for row in rows:
        ids = service.tokenizer.encode(row["rendered"], add_special_tokens=False)
        out = generate(service.model, [ids], max_new_tokens=MAX_GEN_TOKS)
        texts.append(service.tokenizer.decode(out.sequences[0], skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_lm_eval_openai_models_against_the_server(bundled_server, harness, kind):
    lm_eval, tasks, rows = harness
    server, service = bundled_server
    endpoint = "chat/completions" if kind == "chat" else "completions"
    model_args = f"model=tiny-clover,base_url={server.url}/v1/{endpoint},num_concurrent=3,max_retries=1"
    if kind == "text":
        model_args += ",tokenized_requests=False,tokenizer_backend=None"
    results = lm_eval.simple_evaluate(
        model="local-chat-completions" if kind == "chat" else "local-completions", model_args=model_args,
        tasks=[f"clover_sort_{kind}"], task_manager=tasks, apply_chat_template=kind == "chat", log_samples=True)
    samples = sorted(results["samples"][f"clover_sort_{kind}"], key=lambda sample: sample["doc_id"])
    texts = expected_texts(service, rows)
    got = [sample["resps"][0][0] for sample in samples]
    if kind == "chat":  # the server returns the answer as content, the thinking as reasoning_content
        assert got == [text.split("</think>")[-1].lstrip("\n") for text in texts]
    else:  # completions: the model's text itself
        assert got == texts
    metric = "exact_match,none" if kind == "chat" else "exact_match,answer"
    answers = [text.split("</think>")[-1].strip() for text in texts]
    assert results["results"][f"clover_sort_{kind}"][metric] == sum(
        answer == row["answer"] for answer, row in zip(answers, rows, strict=True)) / COUNT


def test_lm_eval_loglikelihoods_through_the_server_equal_the_in_process_models(bundled_server, harness):
    """A multiple-choice task by lm-eval's `local-completions` (echo and logprobs against the server,
    token ids sent) and by the in-process `clover-jax` model: the same log-likelihoods and greediness."""
    import clover_jax
    import clover_jax.api.lm_eval_model  # noqa: F401  (registers "clover-jax")

    lm_eval, tasks, rows = harness
    server, _ = bundled_server
    path = clover_jax.bundled_model_path()
    remote = lm_eval.simple_evaluate(
        model="local-completions", tasks=["clover_sort_choice"], task_manager=tasks, log_samples=True,
        model_args=f"model=tiny-clover,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,"
                   f"tokenizer_backend=huggingface,tokenizer={path}")
    local = lm_eval.simple_evaluate(model="clover-jax", model_args=f"pretrained={path}", tasks=["clover_sort_choice"],
                                    task_manager=tasks, log_samples=True)
    pick = lambda results: [[tuple(response[0]) for response in sample["resps"]] for sample in sorted(
        results["samples"]["clover_sort_choice"], key=lambda sample: sample["doc_id"])]
    got, expected = pick(remote), pick(local)
    assert len(got) == len(rows) and [len(choices) for choices in got] == [2] * len(rows)
    for over_http, in_process in zip(got, expected, strict=True):
        for (value, greedy), (reference, reference_greedy) in zip(over_http, in_process, strict=True):
            assert abs(value - reference) <= 1e-4 * max(1.0, abs(reference)), (value, reference)
            assert greedy == reference_greedy
    assert remote["results"]["clover_sort_choice"]["acc,none"] == local["results"]["clover_sort_choice"]["acc,none"]
