"""Training data: JSONL readers, loss tokens, errors naming file and line, packing, the batch order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clover_jax.text.tokenizer import Tokenizer
from clover_jax.training.batches import BatchIterator, DataPosition, choose_blocks
from clover_jax.training.examples import DataError, read_examples
from clover_jax.training.packing import fit_examples, pack
from clover_jax.training.tiny.recipe import BUNDLED_DIR

IM_END, PAD = 2, 0


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(BUNDLED_DIR)


def write_lines(path, *records) -> str:
    with open(path, "w") as handle:
        for record in records:
            handle.write(record if isinstance(record, str) else json.dumps(record))
            handle.write("\n")
    return str(path)


def chat(*turns, reasoning=None):
    """user, assistant, user, assistant, ... messages."""
    messages = []
    for index, text in enumerate(turns):
        message = {"role": "user" if index % 2 == 0 else "assistant", "content": text}
        if reasoning is not None and index % 2:
            message["reasoning_content"] = reasoning
        messages.append(message)
    return {"messages": messages}


def test_a_chat_trains_exactly_its_assistant_turn_through_the_end_of_turn_token(tokenizer, tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", chat("sort 3 1 2", "1 2 3", reasoning="sorting"))
    [example] = read_examples(path, tokenizer, end_of_turn=[IM_END])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "sort 3 1 2"}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    turn = tokenizer.decode(example.ids[example.loss].tolist(), skip_special_tokens=False)
    assert example.ids[:len(prompt_ids)].tolist() == prompt_ids and not example.loss[:len(prompt_ids)].any()
    assert example.loss[len(prompt_ids):].all()  # nothing after the turn: the template's newline is dropped
    assert turn == "<think>\nsorting\n</think>\n\n1 2 3<|im_end|>"
    assert example.turn_ends == (len(example.ids),) and example.source == f"{path}, line 1"


def test_two_assistant_turns_are_two_trained_spans_with_the_user_turn_between_untrained(tokenizer, tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", chat("sort 2 1", "1 2", "sort 4 3", "3 4"))
    [example] = read_examples(path, tokenizer, end_of_turn=[IM_END])
    trained = np.flatnonzero(example.loss)
    first_end, second_end = example.turn_ends
    assert example.ids[first_end - 1] == IM_END and example.ids[second_end - 1] == IM_END
    gap = np.setdiff1d(np.arange(trained[0], second_end), trained)
    text = tokenizer.decode(example.ids[gap].tolist(), skip_special_tokens=False)
    assert "user\nsort 4 3" in text and gap[0] == first_end


def test_prompt_completion_and_text_lines_end_with_an_end_of_turn_token(tokenizer, tmp_path):
    path = write_lines(tmp_path / "mixed.jsonl", {"prompt": "sort 2 1:", "completion": " 1 2"}, {"text": "abc"})
    completion, text = read_examples(path, tokenizer, end_of_turn=[IM_END])
    prompt_length = len(tokenizer.encode("sort 2 1:", add_special_tokens=False))
    assert not completion.loss[:prompt_length].any() and completion.loss[prompt_length:].all()
    assert completion.ids[-1] == IM_END and text.ids[-1] == IM_END and text.loss.all()


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "a", "completion": "b", "weight": 2}', "unknown key 'weight'"),
    ('{"txt": "a"}', "got keys \\['txt'\\]"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"prompt": "a"}', "needs 'completion'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": ["x"]}]}', "'content' must be a string"),
    ('{"messages": [{"role": "user", "content": "x", "extra": 1}]}', "unknown key 'extra'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "at least one assistant message"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}', "'tools' must be a list"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line(tokenizer, tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", {"text": "fine"}, "", line)
    with pytest.raises(DataError, match=message) as caught:
        read_examples(path, tokenizer, end_of_turn=[IM_END])
    assert caught.value.file == path and caught.value.line == 3 and f"{path}, line 3" in str(caught.value)


def test_a_turn_the_template_renders_differently_later_asks_for_split_turns(tokenizer, tmp_path):
    # The template keeps an assistant turn's reasoning only after the last user message: the
    # second turn's prompt (rendered as at inference) shows the first turn's reasoning, the whole
    # chat does not.
    think = lambda text: {"role": "assistant", "content": text, "reasoning_content": "thinking"}
    messages = [{"role": "user", "content": "sort 2 1"}, think("1 2"), think("so 1 2"),
                {"role": "user", "content": "sort 4 3"}, think("3 4")]
    path = write_lines(tmp_path / "chat.jsonl", {"messages": messages})
    with pytest.raises(DataError, match="split_turns=True") as caught:
        read_examples(path, tokenizer, end_of_turn=[IM_END])
    assert caught.value.line == 1
    examples = read_examples(path, tokenizer, end_of_turn=[IM_END], split_turns=True)
    assert len(examples) == 3
    for example, before in zip(examples, (1, 2, 4), strict=True):
        prompt = tokenizer.apply_chat_template(messages[:before], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)  # as at inference
        assert example.ids[:len(prompt_ids)].tolist() == prompt_ids and example.loss[len(prompt_ids):].all()
        assert "thinking" in tokenizer.decode(example.ids[example.loss].tolist())


def test_an_example_longer_than_seq_len_is_refused_naming_its_line_or_cut_with_truncate(tokenizer, tmp_path):
    path = write_lines(tmp_path / "long.jsonl", {"text": "a b"}, {"text": "word " * 40})
    examples = read_examples(path, tokenizer, end_of_turn=[IM_END])
    with pytest.raises(DataError, match="seq_len=32") as caught:
        fit_examples(examples, seq_len=32, block_size=8, truncate=False)
    assert caught.value.line == 2
    fitted = fit_examples(examples, seq_len=32, block_size=8, truncate=True)
    assert len(fitted[1].ids) == 32 and fitted[0].ids.tolist() == examples[0].ids.tolist()


def test_packing_starts_each_example_at_a_block_and_pads_its_last_block_as_a_diffusion_target(tokenizer, tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", *[chat(f"sort {i} 1", "1 2 3 4") for i in range(6)],
                       chat("sort 2 1", "1 2", "sort 4 3", "3 4"))
    examples = read_examples(path, tokenizer, end_of_turn=[IM_END])
    block = 8
    packed = pack(examples, seq_len=64, block_size=block, pad_id=PAD, seed=0)
    placed = 0
    for row in range(packed.num_rows):
        segment = packed.segment[row]
        for number in range(1, packed.examples[row] + 1):
            rows = np.flatnonzero(segment == number)
            assert rows[0] % block == 0 and len(rows) % block == 0 and np.all(np.diff(rows) == 1)
            example = next(e for e in examples if len(e.ids) <= len(rows) and
                           packed.clean_ids[row, rows[:len(e.ids)]].tolist() == e.ids.tolist())
            length = len(example.ids)
            tail = rows[length:]
            assert np.all(packed.targets[row, tail] == PAD) and packed.maskable[row, tail].all()
            assert not packed.next_token[row, tail].any() and not packed.next_token[row, rows[0]]
            for end in example.turn_ends[:-1]:  # inside a multi-turn example: pad targets to the block's end
                after = rows[end:-(-end // block) * block]
                assert np.all(packed.targets[row, after] == PAD) and packed.maskable[row, after].all()
                assert np.all(packed.clean_ids[row, after] == example.ids[end:end + len(after)])  # the real transcript
            placed += 1
    assert placed == len(examples)
    again = pack(examples, seq_len=64, block_size=block, pad_id=PAD, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(packed, again, strict=True))


def test_the_batch_order_is_a_function_of_seed_and_position_and_resumes_from_a_saved_position(tokenizer, tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", *[chat(f"sort {i} {i + 1}", "x") for i in range(40)])
    examples = read_examples(path, tokenizer, end_of_turn=[IM_END])
    packings = {size: pack(examples, seq_len=32, block_size=size, pad_id=PAD, seed=0) for size in (4, 8)}
    make = lambda: BatchIterator(packings, block_sizes=(4, 8), weights=(1, 3), batch_size=3, seed=5,
                                 max_noisy_blocks=None)
    first, second = make(), make()
    run = [first.next() for _ in range(12)]
    assert {batch.block_size for batch in run} == {4, 8}
    second.position = DataPosition(7, tuple(sum(b.block_size == s for b in run[:7]) for s in (4, 8)))
    for batch in run[7:]:
        again = second.next()
        assert again.block_size == batch.block_size
        assert all(np.array_equal(a, b) for a, b in zip(again.rows, batch.rows, strict=True))


def test_max_noisy_blocks_keeps_at_most_that_many_blocks_of_each_example(tokenizer, tmp_path):
    path = write_lines(tmp_path / "text.jsonl", *[{"text": "word " * n} for n in (9, 14, 3)])
    examples = read_examples(path, tokenizer, end_of_turn=[IM_END])
    packed = pack(examples, seq_len=128, block_size=4, pad_id=PAD, seed=0)
    rng = np.random.default_rng(0)
    everything = choose_blocks(packed, np.arange(packed.num_rows), block_size=4, width=32, max_noisy_blocks=None,
                               rng=rng)
    one = choose_blocks(packed, np.arange(packed.num_rows), block_size=4, width=32, max_noisy_blocks=1, rng=rng)
    for row in range(packed.num_rows):
        used = one[row][one[row] < 32]
        per_example = packed.segment[row, used * 4]
        assert len(np.unique(per_example)) == len(per_example) == packed.examples[row]
        assert set(used) <= set(everything[row][everything[row] < 32])
        with_loss = packed.maskable[row].reshape(-1, 4).any(-1)
        assert sorted(everything[row][everything[row] < 32]) == np.flatnonzero(with_loss).tolist()


def test_tokenised_data_is_kept_and_read_again_only_when_data_or_tokenizer_change(tokenizer, tmp_path, monkeypatch):
    import shutil

    from clover_jax.training import example_cache

    path = write_lines(tmp_path / "chat.jsonl", chat("sort 3 1", "1 3"), {"text": "abc"})
    shards = tmp_path / "shards"
    first = example_cache.cached_examples(path, tokenizer, end_of_turn=[IM_END], split_turns=False,
                                          directory=str(shards))
    monkeypatch.setattr(example_cache, "read_examples", lambda *a, **k: pytest.fail("read again"))
    again = example_cache.cached_examples(path, tokenizer, end_of_turn=[IM_END], split_turns=False,
                                          directory=str(shards))
    assert [(e.ids.tolist(), e.loss.tolist(), e.turn_ends, e.source) for e in again] == \
        [(e.ids.tolist(), e.loss.tolist(), e.turn_ends, e.source) for e in first]
    copy = tmp_path / "tokenizer"
    shutil.copytree(BUNDLED_DIR, copy)
    with open(copy / "tokenizer_config.json", "a") as handle:
        handle.write(" ")
    changed = Tokenizer.from_pretrained(copy)
    key = lambda tok, turns: example_cache.data_key([path], tok.path, end_of_turn=[IM_END], split_turns=turns)
    assert len({key(tokenizer, False), key(changed, False), key(tokenizer, True)}) == 3
    with open(path, "a") as handle:
        handle.write(json.dumps({"text": "more"}) + "\n")
    with pytest.raises(pytest.fail.Exception, match="read again"):
        example_cache.cached_examples(path, tokenizer, end_of_turn=[IM_END], split_turns=False, directory=str(shards))
