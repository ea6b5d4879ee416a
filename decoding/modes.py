"""The decoding modes, written once, and what each one means to the code that runs it.

A mode is a `Mode` (a `StrEnum`: `mode="diffusion"` as a string still works, and the CLI flag and
the HTTP field send the string); `strategy(mode)` converts it once at a public boundary and
returns the mode's `ModeStrategy`, which answers what callers would otherwise compute by
comparing mode names: which options it takes, how many positions and cache rows a request
needs, and what the engine's slots hold for it. The loop each mode runs is
`decoding.layouts.LOOP_CALLS[mode]`; its decisions in the serving engine are
`decoding.engine.decisions`.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from clover_jax.core.errors import UNSUPPORTED, FieldError


class Mode(enum.StrEnum):
    DIFFUSION = "diffusion"                # block diffusion (docs/design.md §4)
    AUTOREGRESSIVE = "autoregressive"      # token by token through the causal backbone
    SELF_SPECULATIVE = "self_speculative"  # a denoising pass drafts a block, a causal pass verifies it (§8)


MODES: tuple[str, ...] = tuple(mode.value for mode in Mode)


@dataclasses.dataclass(frozen=True)
class ModeStrategy:
    """What one mode decodes and needs.

    decodes_blocks: the block size matters (a denoised block, or a drafted one) and the mask
    token is needed; whole_blocks: the response is decided block by block and the cache holds
    whole blocks (diffusion: listeners, step records and schedules apply); greedy_only: sampling
    is refused (self-speculation verifies drafts against the greedy causal choice)."""

    mode: Mode
    decodes_blocks: bool
    whole_blocks: bool
    greedy_only: bool

    @property
    def verifies_drafts(self) -> bool:
        """A drafted block checked by a causal pass, round by round (self-speculative)."""
        return self.decodes_blocks and not self.whole_blocks

    @property
    def label(self) -> str:
        """The mode as prose names it ("self-speculative")."""
        return self.mode.value.replace("_", "-")

    # ------------------------------------------------------------------ options
    def check_options(self, *, trajectory: bool, history: bool, listening: bool) -> None:
        """Refuse the recording and listening options this mode has no use for."""
        if not self.decodes_blocks and (trajectory or history or listening):
            raise FieldError("mode", "return_trajectory, return_history, on_block, streamer, on_step and progress "
                                     "are for diffusion decoding", code=UNSUPPORTED)
        if self.verifies_drafts and (history or listening):
            raise FieldError("mode", "return_history, on_block, streamer, on_step and progress are for diffusion "
                                     "decoding; self-speculative decoding records its rounds with "
                                     "return_trajectory=True", code=UNSUPPORTED)

    def check_sampling(self, do_sample: bool) -> None:
        if do_sample and self.greedy_only:
            raise FieldError("do_sample", "self-speculative decoding is greedy: do_sample=True is not supported in "
                                          "this mode (sample with mode='autoregressive' or 'diffusion')",
                             code=UNSUPPORTED)

    def check_mask_token(self, mask_token_id: int | None) -> None:
        if self.decodes_blocks and mask_token_id is None:
            raise FieldError("mask_token_id", f"{self.label} decoding needs mask_token_id (config.json or "
                                              "generation_config.json); base Qwen checkpoints decode with "
                                              "mode='autoregressive'", code=UNSUPPORTED)

    # ------------------------------------------------------------------ positions
    def positions_needed(self, prompt_length: int, new: int, block_size: int, alignment: str) -> tuple[int, str]:
        """(positions, the rule that counts them) a prompt of `prompt_length` tokens and `new`
        response tokens take of the model's context: drafted positions past N are never emitted,
        so only diffusion rounds up to whole blocks."""
        if not self.whole_blocks:
            return prompt_length + new, "P + N"
        if alignment == "absolute":
            return math.ceil((prompt_length + new) / block_size) * block_size, "ceil((P + N) / B) * B"
        return prompt_length + math.ceil(new / block_size) * block_size, "P + ceil(N / B) * B"

    def rows_needed(self, prompt_length: int, new: int, block_size: int) -> tuple[int, str]:
        """(cache rows, their rule) a request holds in an engine slot (absolute alignment): the last
        block whole (diffusion), the prompt and response plus one drafted block (self-speculative),
        or the prompt and response."""
        if self.whole_blocks:
            return math.ceil((prompt_length + new) / block_size) * block_size, "ceil((P + N) / B) * B"
        if self.verifies_drafts:
            return prompt_length + new + block_size, "P + N + B"
        return prompt_length + new, "P + N"

    def room(self, context: int, prompt_length: int, block_size: int) -> int:
        """The most response tokens `context` rows leave after the prompt (`rows_needed` inverted)."""
        if self.whole_blocks:
            return context // block_size * block_size - prompt_length
        if self.verifies_drafts:
            return context - prompt_length - block_size
        return context - prompt_length

    def prefix_length(self, prompt_length: int, block_size: int) -> int:
        """Prompt tokens prefilled before decoding starts: the whole blocks (diffusion; the prompt
        tail opens the first block), all but the pending last token (self-speculative), or all."""
        if self.whole_blocks:
            return prompt_length - prompt_length % block_size
        return prompt_length - int(self.verifies_drafts)


STRATEGIES = {
    Mode.DIFFUSION: ModeStrategy(Mode.DIFFUSION, decodes_blocks=True, whole_blocks=True, greedy_only=False),
    Mode.AUTOREGRESSIVE: ModeStrategy(Mode.AUTOREGRESSIVE, decodes_blocks=False, whole_blocks=False,
                                      greedy_only=False),
    Mode.SELF_SPECULATIVE: ModeStrategy(Mode.SELF_SPECULATIVE, decodes_blocks=True, whole_blocks=False,
                                        greedy_only=True),
}


def as_mode(value: str | Mode) -> Mode:
    """`value` as a `Mode`; a name that is none is a FieldError naming `mode`."""
    try:
        return Mode(value)
    except ValueError:
        raise FieldError("mode", f"mode must be one of {', '.join(map(repr, MODES))}, got {value!r}") from None


def strategy(mode: str | Mode) -> ModeStrategy:
    """The strategy of `mode` (a `Mode` or its name)."""
    return STRATEGIES[as_mode(mode)]
