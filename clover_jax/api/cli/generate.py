"""`clover-jax generate`: check the flags, the prompt and the checkpoint's config, then load and decode."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from clover_jax.api.cli.common import (
    CliError,
    UsageError,
    check_model_format,
    config_record,
    is_hub_snapshot,
    resolve_model_dir,
    resolve_placement,
    short,
)
from clover_jax.api.cli.flags import FALLBACK_MAX_NEW_TOKENS, explain, flag_name, generation_overrides
from clover_jax.api.cli.render import Status, StreamPrinter, render_rounds, render_steps, summary
from decoding.modes import strategy


def run_generate(args: argparse.Namespace) -> int:
    overrides = generation_overrides(args)
    decoder = strategy(args.mode)  # argparse accepted only mode names
    if args.show_steps and not decoder.decodes_blocks:
        raise UsageError("--show-steps shows diffusion blocks or self-speculative rounds; it does not apply to "
                         "--mode autoregressive")
    prompt = read_prompt(args.prompt)
    system = _utf8(args.system, "--system") if args.system is not None else None
    status = Status(quiet=args.quiet or args.json)
    path = resolve_model_dir(args.model, args.revision, quiet=status.quiet)

    from clover_jax.core.config import CloverConfig
    from clover_jax.text.tokenizer import Tokenizer

    check_model_format(args)
    # With an adapter, the trained model's config, tokenizer and generation config are the adapter's
    described = Path(args.adapter) if args.adapter else path
    config = CloverConfig.from_pretrained(described)
    tokenizer = Tokenizer.from_pretrained(described)
    prompt_ids = encode_prompt(tokenizer, prompt, args, system)
    generation = resolve_generation_config(described, config, overrides)
    context = config.max_position_embeddings
    needed, rule = decoder.positions_needed(len(prompt_ids), generation.max_new_tokens, generation.block_size,
                                            generation.block_alignment)
    if needed > context:  # before the weights load; generate() checks again
        raise CliError(f"the prompt has {len(prompt_ids)} tokens and --max-new-tokens is "
                       f"{generation.max_new_tokens}: {rule} = {needed} positions "
                       f"exceed the model's context of {context} tokens (max_position_embeddings)")

    placement = resolve_placement(config, args, context_length=needed, batch=1)
    if args.target:
        status.say(f"--target {args.target}: {placement.reason}")
    status.say(f"loading {args.model or short(path)} ({placement.describe()}) ...")
    started = time.perf_counter()
    import jax

    from clover_jax.model.clover_model import CloverModel
    from decoding import generate

    formats = dict(dtype=args.dtype, progress=not status.quiet, adapter=args.adapter, **placement.load_options())
    if is_hub_snapshot(args.model):  # the weights of the commit the config and tokenizer came from
        model = CloverModel.from_pretrained(args.model, revision=path.name, **formats)
    else:
        model = CloverModel.from_pretrained(path, **formats)
    load_seconds = time.perf_counter() - started
    status.say(f"loaded in {load_seconds:.1f} s on {jax.devices()[0].platform}; decoding "
               f"({args.mode}, {len(prompt_ids)} prompt tokens; the first call compiles) ...")

    key = jax.random.key(args.seed)
    options = dict(generation_config=generation, key=key, mode=decoder.mode)
    if decoder.decodes_blocks:
        options["return_trajectory"] = args.show_steps or args.json
    stream = None
    if not args.json and not args.show_steps and decoder.whole_blocks:
        stream = StreamPrinter(tokenizer, generation, skip_special=not args.show_special)
        options["on_block"] = stream
    if args.warmup:  # the same call (same compiled loop), its output discarded
        if stream is not None:
            stream.muted = True
        generate(model, [prompt_ids], **options)
        if stream is not None:
            stream.reset()
    output = generate(model, [prompt_ids], **options)

    response = output.sequences[0]
    text = tokenizer.decode(response, skip_special_tokens=not args.show_special)
    frames_out = sys.stderr if args.json else sys.stdout
    if args.show_steps:
        delay = args.step_delay if args.step_delay is not None else (0.1 if frames_out.isatty() else 0.0)
        if decoder.verifies_drafts:
            render_rounds(tokenizer, response, output.trajectory[0], generation, frames_out, delay)
        else:
            render_steps(tokenizer, prompt_ids, response, output.trajectory[0]["step"], output.steps_per_block[0],
                         generation, frames_out, delay)
    metrics = _metrics(output, load_seconds, args.warmup)
    eos = set(generation.eos_token_id)  # resolved with the checkpoint's (`resolve_generation_config`)
    finished = "eos" if response and response[-1] in eos else "max_new_tokens"
    if args.json:
        record = {"model": str(path), "mode": args.mode, "prompt": prompt, "prompt_tokens": len(prompt_ids),
                  "response": text, "response_tokens": len(response), "token_ids": response, "finished_by": finished,
                  "metrics": metrics, "generation_config": config_record(generation)}
        if output.trajectory:
            record["trajectory"] = output.trajectory[0]
        print(json.dumps(record, ensure_ascii=False))
        return 0
    if stream is not None:
        stream.finish(text)
    else:
        if args.show_steps:
            print(file=frames_out)
        print(text)
    status.say(summary(metrics, len(response), finished, decoder.mode))
    return 0


def encode_prompt(tokenizer, prompt: str, args: argparse.Namespace, system: str | None = None) -> list[int]:
    """The prompt's ids: through the chat template (with --system, enable_thinking), or raw."""
    if args.raw:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=args.enable_thinking,
                                         return_dict=False)


def resolve_generation_config(path: Path, config, overrides: dict[str, Any]):
    """The checkpoint's generation_config.json with the flags applied, checked before the weights load.

    Its special token ids are the checkpoint's where neither the flags nor generation_config.json
    set them (`decoding.generation_config.resolve_token_ids`)."""
    from clover_jax.core.errors import FieldError
    from decoding.generation_config import TOKEN_ID_FIELDS, GenerationConfig
    from decoding.validation import check_vocabulary

    generation = GenerationConfig.from_pretrained(path)
    if generation.max_new_tokens is None and "max_new_tokens" not in overrides:
        overrides = {**overrides, "max_new_tokens": FALLBACK_MAX_NEW_TOKENS}
    try:
        generation = generation.replace(**overrides)
    except ValueError as error:  # a combination of flags and stored values (e.g. temperature 0 with sampling)
        raise UsageError(explain(error)) from None
    try:
        check_vocabulary(generation, config.vocab_size)  # generate()'s check, before the weights load
    except FieldError as error:  # the flag's wording: the token ids that are out, or top_k
        value = getattr(generation, error.field)
        if error.field in TOKEN_ID_FIELDS:
            bad = [i for i in (value if isinstance(value, tuple) else [value]) if not 0 <= i < config.vocab_size]
            raise UsageError(f"{flag_name(error.field)}: {error.field} {bad} is outside the vocabulary "
                             f"[0, {config.vocab_size})") from None
        raise UsageError(f"{flag_name(error.field)}: {error.field} {value} is larger than the vocabulary "
                         f"({config.vocab_size}); 0 turns top-k off") from None
    if generation.constraint is not None:  # compiled once against the tokenizer: a bad grammar before the weights
        from decoding.constraints import compile_constraint

        try:
            compile_constraint(generation.constraint, tokenizer_path=path / "tokenizer.json",
                               vocab_size=config.vocab_size, eos_token_ids=generation.eos_token_id)
        except FieldError as error:
            raise UsageError(explain(error)) from None
    return generation


def read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no prompt: pass it as an argument, or '-' to read standard input")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(f"standard input is not valid UTF-8 (byte 0x{data[error.start]:02x} at offset "
                             f"{error.start})") from None
    else:
        prompt = _utf8(prompt, "the prompt")
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def _utf8(text: str, what: str) -> str:
    """`text` from the command line, refused if it held bytes that are not UTF-8 (Python keeps
    them as lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UsageError(f"{what} is not valid UTF-8 (at character {error.start})") from None
    return text


def _metrics(output, load_seconds: float, warm: bool) -> dict[str, Any]:
    tokens = len(output.sequences[0])
    steps = output.steps_per_block[0]
    return {
        "nfe": output.nfe[0],
        "tokens_per_forward": round(output.tokens_per_forward[0], 4),
        "steps_per_block": steps,
        "mean_steps_per_block": round(sum(steps) / len(steps), 3) if steps else None,
        "seconds": round(output.wall_time, 4),
        "tokens_per_second": round(tokens / output.wall_time, 2) if output.wall_time > 0 else None,
        "includes_compile": not warm,
        "load_seconds": round(load_seconds, 3),
        "distinct_experts_per_block": [round(d, 2) for d in output.distinct_experts_per_block[0]],
    }
