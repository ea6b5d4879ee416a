"""What `generate` returns (`GenerateOutput`), and how each mode's final loop state becomes it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from decoding.block_loop import History


@dataclasses.dataclass
class GenerateOutput:
    """Per prompt: response tokens (cut at max_new_tokens and after the first EOS, kept), forward
    passes, denoising steps of each decoded block, response tokens per forward, mean distinct
    experts per MoE layer per step of each block; the wall time of the call; and, with
    `return_trajectory=True`, for every response position the denoising step (1-based, within its
    block) that filled it and its confidence then (diffusion), or each round's `drafts` (B tokens),
    `accepted` (drafts accepted) and `emitted` (tokens emitted) (self-speculative). In
    self-speculative mode a "block" is a round: one denoising pass each."""

    sequences: list[list[int]] = dataclasses.field(default_factory=list)
    nfe: list[int] = dataclasses.field(default_factory=list)
    steps_per_block: list[list[int]] = dataclasses.field(default_factory=list)
    tokens_per_forward: list[float] = dataclasses.field(default_factory=list)
    distinct_experts_per_block: list[list[float]] = dataclasses.field(default_factory=list)
    wall_time: float = 0.0
    trajectory: list[dict[str, list]] | None = None
    history: History | None = None  # with return_history=True: every denoising step, NumPy arrays [b, S, ...]
    # under a constraint: steps (compiled calls), grammar_seconds (host time in the grammar, in all and per
    # step), options (diffusion: how often each option of the commit rule stood), complete (per prompt:
    # the answer is complete under the grammar)
    constraint: dict | None = None


def diffusion_output(final, *, tails: np.ndarray, new: int, eos_token_id: Sequence[int],
                     return_trajectory: bool) -> GenerateOutput:
    """The block loop's results (`decoding.block_loop.Results`, on the host) per prompt."""
    eos = set(eos_token_id)
    output = GenerateOutput(trajectory=[] if return_trajectory else None)
    for i in range(len(tails)):
        closed = int(np.sum(final.steps_per_block[i] > 0))
        flat = lambda array, i=i, closed=closed: np.asarray(array[i, :closed]).reshape(-1)[tails[i]:tails[i] + new]
        response = flat(final.tokens).tolist()
        cut = next((n + 1 for n, token in enumerate(response) if token in eos), len(response))
        steps = final.steps_per_block[i, :closed]
        output.sequences.append(response[:cut])
        output.nfe.append(int(final.nfe[i]))
        output.steps_per_block.append([int(s) for s in steps])
        output.tokens_per_forward.append(cut / max(int(final.nfe[i]), 1))
        output.distinct_experts_per_block.append(
            [float(d) / int(s) for d, s in zip(final.distinct_experts[i, :closed], steps, strict=True)])
        if return_trajectory:
            output.trajectory.append({"step": flat(final.fill_step)[:cut].tolist(),
                                      "confidence": flat(final.fill_confidence)[:cut].tolist()})
    if final.history is not None:
        used = int(np.max(final.history.num_steps))
        output.history = final.history._replace(
            **{name: np.asarray(getattr(final.history, name))[:, :used] for name in History._fields[:-1]},
            num_steps=np.asarray(final.history.num_steps))
    return output


def autoregressive_output(final) -> GenerateOutput:
    """The autoregressive loop's (tokens, generated, nfe), on the host, per prompt."""
    tokens, generated, nfe = final
    output = GenerateOutput()
    for i in range(len(tokens)):
        response = tokens[i, :int(generated[i])].tolist()
        output.sequences.append(response)
        output.nfe.append(int(nfe[i]))
        output.steps_per_block.append([1] * len(response))
        output.tokens_per_forward.append(len(response) / max(int(nfe[i]), 1))
        output.distinct_experts_per_block.append([])
    return output


def self_speculative_output(final, *, lengths: np.ndarray, return_trajectory: bool) -> GenerateOutput:
    """The self-speculative loop's final state, on the host, per prompt: a round is one denoising pass."""
    output = GenerateOutput(trajectory=[] if return_trajectory else None)
    for i in range(len(lengths)):
        response = final.tokens[i, :int(final.lengths[i])].tolist()
        rounds = (int(final.nfe[i]) - int(lengths[i] > 1)) // 2
        output.sequences.append(response)
        output.nfe.append(int(final.nfe[i]))
        output.steps_per_block.append([1] * rounds)  # one denoising pass per round
        output.tokens_per_forward.append(len(response) / max(int(final.nfe[i]), 1))
        output.distinct_experts_per_block.append([float(d) for d in final.distinct_experts[i, :rounds]])
        if return_trajectory:
            output.trajectory.append({"drafts": final.rounds.drafts[i, :rounds].tolist(),
                                      "accepted": final.rounds.accepted[i, :rounds].tolist(),
                                      "emitted": final.rounds.emitted[i, :rounds].tolist()})
    return output
