"""How a batch of prompts becomes the arguments of each compiled decoding loop, for every mode.

`generate` lays out its prompts here, and so does ahead-of-time compilation
(`clover_jax.api.compile.decode_loops`), which lays out placeholder prompts of a request's shape: the programs it
compiles for an accelerator are the ones `generate` would run there.

Layout (docs/design.md §4). Absolute alignment: sequence i's first `floor(P_i/B)` prompt blocks
are the causal prefix and its prompt tail opens the first decoded block; sequences are
left-padded by whole blocks so that their first decoded blocks line up. Prompt alignment: every
prompt is the whole prefix, left-padded so that all prompts end at the same cache row.
Autoregressive and self-speculative decoding left-pad every prompt to one length.

Compilation is reused across calls by bucketing (policy): the prefix length and the number of
decoded positions are rounded up to powers of two while they are at most one prefill chunk
(2048 tokens by default), and to whole chunks beyond, so prompts and `max_new_tokens` that land
in the same buckets — at the same batch size and block size — share one compiled loop. Extra
padding is masked out (RoPE positions count from each sequence's first token), and extra blocks
are never run: the loops stop when every sequence is finished.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from clover_jax.core.passes import ModelPasses
from decoding.autoregressive import AutoregressiveSpec, LeftPadded, run_autoregressive
from decoding.block_loop import LoopSpec, Request, run_block_decoder
from decoding.controls import Controls, TokenIds
from decoding.generation_config import GenerationConfig
from decoding.modes import MODES, Mode, as_mode
from decoding.schedules import resolve, resolve_params
from decoding.speculative import SpeculativeSpec, run_self_speculative


def bucket(count: int, step: int) -> int:
    """0 stays 0; up to `step`, the next power of two; beyond, the next multiple of `step`
    (so padding never costs more than one chunk of extra prefill on a long prompt)."""
    if count <= 0:
        return 0
    power = 1 << (count - 1).bit_length()
    return power if count <= step else min(power, -(-count // step) * step)


def controls_of(config: GenerationConfig) -> Controls:
    """The traced numeric controls of a generation config (each `Controls` field is the config field
    of its name). NumPy scalars: the compiled loop takes them as traced arguments without a dispatch each."""
    return Controls(**{name: (np.int32 if name == "top_k" else np.float32)(getattr(config, name))
                       for name in Controls._fields})


def token_ids_of(config: GenerationConfig) -> TokenIds:
    """The special token ids of a generation config (-1 where absent)."""
    as_id = lambda value: np.int32(-1 if value is None else value)
    eos = np.asarray(list(config.eos_token_id) or [-1], np.int32)
    return TokenIds(eos, as_id(config.mask_token_id), as_id(config.think_start_token_id),
                    as_id(config.think_end_token_id))


def prompt_thinking(prompt: Sequence[int], config: GenerationConfig) -> bool:
    """Does the prompt end inside an unclosed <think>?"""
    if config.think_start_token_id is None or config.think_end_token_id is None:
        return False
    opened = max((i for i, t in enumerate(prompt) if t == config.think_start_token_id), default=-1)
    closed = max((i for i, t in enumerate(prompt) if t == config.think_end_token_id), default=-1)
    return opened > closed


def coreset_of(config: GenerationConfig, model_config: Any) -> tuple[bool, float]:
    """(coreset on, its top-p): the generation config's, else the model config's defaults."""
    enabled = model_config.moe_block_coreset_enabled if config.coreset is None else bool(config.coreset)
    top_p = model_config.moe_block_coreset_top_p if config.coreset_top_p is None else config.coreset_top_p
    return enabled, top_p


@dataclasses.dataclass(frozen=True)
class LoopCall:
    """One compiled loop and its arguments: `program(*args)` decodes the batch.

    capacity: prefix-state rows the loop allocates; block: rows of its widest pass beyond the
    causal ones (for the memory check); tails: prompt tokens that open the first decoded block,
    per sequence (diffusion with absolute alignment; zeros otherwise); lengths: prompt lengths.
    """

    program: Callable
    args: tuple
    capacity: int
    block: int
    tails: np.ndarray
    lengths: np.ndarray

    def run(self) -> Any:
        return self.program(*self.args)


def diffusion_call(passes: ModelPasses, params: Any, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                   chunk_size: int, *, coreset: bool, coreset_top_p: float, key: jax.Array, thinking: np.ndarray,
                   controls: Controls, ids: TokenIds, history: bool = False) -> LoopCall:
    """The block-diffusion loop (`decoding.block_loop`) over `prompts` (checked token-id lists)."""
    size, new = config.block_size, config.max_new_tokens
    lengths = np.array([len(p) for p in prompts])
    if config.block_alignment == "absolute":
        prefix_blocks = lengths // size
        tails = lengths % size
        blocks_needed = -(-(lengths + new) // size) - prefix_blocks
    else:
        prefix_blocks = -(-lengths // size)  # whole prompts, padded to blocks
        tails = np.zeros_like(lengths)
        blocks_needed = np.full_like(lengths, -(-new // size))
    chunk_blocks = max(1, chunk_size // size)
    prefix_bucket = bucket(int(prefix_blocks.max()), chunk_blocks)
    spec = LoopSpec(block_size=size, prefix_blocks=prefix_bucket,
                    max_blocks=bucket(int(blocks_needed.max()), chunk_blocks), steps_cap=config.steps_cap,
                    do_sample=config.do_sample, schedule=resolve(config.schedule), coreset=coreset, history=history,
                    chunk_size=chunk_size)

    prefix_length = prefix_bucket * size
    prefix_ids = np.zeros((len(prompts), prefix_length), np.int32)
    first_block = np.full((len(prompts), size), config.mask_token_id, np.int32)
    start = np.zeros(len(prompts), np.int32)
    for i, prompt in enumerate(prompts):
        in_prefix = prompt[:len(prompt) - tails[i]]
        start[i] = prefix_length - len(in_prefix)
        prefix_ids[i, start[i]:] = in_prefix
        first_block[i, :tails[i]] = prompt[len(prompt) - tails[i]:]
    fixed = np.arange(size)[None, :] < tails[:, None]
    request = Request(
        prefix_ids=prefix_ids, first_block=first_block, fixed=fixed, start=start,
        response_base=(-tails).astype(np.int32), prompt_length=lengths.astype(np.int32),
        max_new_tokens=np.full(len(prompts), new, np.int32), prompt_thinking=thinking, has_prefix=lengths - tails > 0,
        key=key, coreset_top_p=np.float32(coreset_top_p), threshold=np.float32(config.threshold),
        schedule_params=resolve_params(config.schedule, config.schedule_params, config))
    return LoopCall(run_block_decoder, (passes, params, spec, request, controls, ids),
                    prefix_length + spec.max_blocks * size, size, tails, lengths)


def _left_padded(prompts: Sequence[Sequence[int]], chunk_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt ids int32 [b, bucketed length] left padded, first real row [b], lengths [b])."""
    lengths = np.array([len(p) for p in prompts])
    prompt_length = max(8, bucket(int(lengths.max()), chunk_size))
    prompt_ids = np.zeros((len(prompts), prompt_length), np.int32)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, prompt_length - len(prompt):] = prompt
    return prompt_ids, (prompt_length - lengths).astype(np.int32), lengths


def autoregressive_call(passes: ModelPasses, params: Any, prompts: Sequence[Sequence[int]],
                        config: GenerationConfig, chunk_size: int, *, key: jax.Array, thinking: np.ndarray,
                        controls: Controls, ids: TokenIds) -> LoopCall:
    """The autoregressive loop (`decoding.autoregressive`) over `prompts`."""
    prompt_ids, start, lengths = _left_padded(prompts, chunk_size)
    spec = AutoregressiveSpec(prompt_ids.shape[1], bucket(config.max_new_tokens, chunk_size), config.do_sample,
                              chunk_size)
    rows = LeftPadded(prompt_ids=prompt_ids, start=start, prompt_thinking=thinking,
                      max_new_tokens=np.full(len(prompts), config.max_new_tokens, np.int32))
    args = (passes, params, spec, rows, key, controls, ids)
    return LoopCall(run_autoregressive, args, spec.prompt_length + spec.max_new_tokens, 1,
                    np.zeros_like(lengths), lengths)


def self_speculative_call(passes: ModelPasses, params: Any, prompts: Sequence[Sequence[int]],
                          config: GenerationConfig, chunk_size: int, *, coreset: bool, coreset_top_p: float,
                          thinking: np.ndarray, controls: Controls, ids: TokenIds,
                          trajectory: bool = False) -> LoopCall:
    """The self-speculative loop (`decoding.speculative`) over `prompts`."""
    size = config.block_size
    prompt_ids, start, lengths = _left_padded(prompts, chunk_size)
    spec = SpeculativeSpec(prompt_ids.shape[1], bucket(config.max_new_tokens, chunk_size), size, coreset,
                           trajectory, chunk_size)
    rows = LeftPadded(prompt_ids=prompt_ids, start=start, prompt_thinking=thinking,
                      max_new_tokens=np.full(len(prompts), config.max_new_tokens, np.int32))
    args = (passes, params, spec, rows, np.float32(coreset_top_p), controls, ids)
    return LoopCall(run_self_speculative, args, spec.prompt_length + spec.max_new_tokens + size, size,
                    np.zeros_like(lengths), lengths)


# The loop each mode runs, as a function of the prompts and the options every mode's call takes.
LOOP_CALLS: dict[Mode, Callable[..., LoopCall]] = {
    Mode.DIFFUSION: lambda passes, params, prompts, config, chunk_size, *, coreset, coreset_top_p, key, **common:
        diffusion_call(passes, params, prompts, config, chunk_size, coreset=coreset, coreset_top_p=coreset_top_p,
                       key=key, **common),
    Mode.AUTOREGRESSIVE: lambda passes, params, prompts, config, chunk_size, *, coreset, coreset_top_p, key, **common:
        autoregressive_call(passes, params, prompts, config, chunk_size, key=key, **common),
    Mode.SELF_SPECULATIVE: lambda passes, params, prompts, config, chunk_size, *, coreset, coreset_top_p, key,
        **common: self_speculative_call(passes, params, prompts, config, chunk_size, coreset=coreset,
                                        coreset_top_p=coreset_top_p, **common),
}


def placeholder_calls(passes: ModelPasses, params: Any, config: GenerationConfig, batch: int, prompt_length: int,
                      chunk_size: int, modes: Sequence[str] = MODES) -> dict[str, LoopCall]:
    """The loop of each mode for `batch` prompts of `prompt_length` tokens and `config` (its
    `max_new_tokens`, block size, schedule, sampling), as `generate` lays them out: for compiling
    ahead of time (the token values are placeholders; only shapes and dtypes matter)."""
    model_config = passes.config
    prompts = [[0] * prompt_length] * batch
    coreset, top_p = coreset_of(config, model_config)
    thinking = np.zeros(batch, bool)
    controls, ids, key = controls_of(config), token_ids_of(config), jax.random.key(0)
    return {mode: LOOP_CALLS[as_mode(mode)](passes, params, prompts, config, chunk_size, coreset=coreset,
                                            coreset_top_p=top_p, key=key, thinking=thinking, controls=controls,
                                            ids=ids)
            for mode in modes}
