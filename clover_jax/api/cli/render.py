"""What `generate` shows: status lines on stderr, the response streamed as its blocks are
decided, and the replay of each block's denoising steps or each self-speculative round."""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

from decoding.modes import Mode

MASK_GLYPH = "░"
REJECTED_MARK = "¦"  # --show-steps, self-speculative: the drafts after it were rejected


class Status:
    """Progress and summaries on stderr (never on stdout, which holds the response)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)


class StreamPrinter:
    """`generate(on_block=...)` listener: prints the response as its blocks are decided."""

    def __init__(self, tokenizer, generation, skip_special: bool):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.eos, self.limit = set(generation.eos_token_id), generation.max_new_tokens
        self.reset()

    def reset(self) -> None:
        self.ids, self.printed, self.done, self.muted = [], "", False, False

    def __call__(self, index: int, tokens: list, block_number: int) -> None:
        if self.done or self.muted:
            return
        for token in tokens:
            if len(self.ids) >= self.limit:
                self.done = True
                break
            self.ids.append(int(token))
            if token in self.eos:
                self.done = True
                break
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special).rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text

    def finish(self, text: str) -> None:
        rest = text[len(self.printed):] if text.startswith(self.printed) else "\n" + text
        sys.stdout.write(rest + "\n")
        sys.stdout.flush()


def render_steps(tokenizer, prompt_ids: Sequence[int], response: Sequence[int], fill_steps: Sequence[int],
                 steps_per_block: Sequence[int], generation, out, delay: float = 0.0) -> None:
    """Replay the denoising of each block from the trajectory recorded inside the jitted loop.

    One line per denoising step: the block's positions, decided tokens as text and masked ones
    as MASK_GLYPH; tokens filled at that step are highlighted on a terminal. The prompt tail that
    opens the first block (absolute alignment) is shown as decided from the start. Schedules
    that remask show each position's last fill. The block the response ends in stops at the step
    that decided its last shown position (the positions past the end are not shown).
    """
    size, prompt_length = generation.block_size, len(prompt_ids)
    tail = prompt_length % size if generation.block_alignment == "absolute" else 0
    glyph = MASK_GLYPH if _encodable(MASK_GLYPH, out) else "_"
    color = out.isatty() and os.environ.get("NO_COLOR") is None
    new, dim, reset = ("\x1b[1;32m", "\x1b[2m", "\x1b[0m") if color else ("", "", "")
    blocks = []  # per block: [(token, step or 0 for prompt)]
    first = [(token, 0) for token in prompt_ids[prompt_length - tail:]] if tail else []
    for t, (token, step) in enumerate(zip(response, fill_steps, strict=True)):
        k = (tail + t) // size
        while len(blocks) <= k:
            blocks.append(first if not blocks else [])
        blocks[k].append((token, int(step)))
    width = len(str(len(blocks) - 1))
    for k, cells in enumerate(blocks):
        last_fill = max((s for _, s in cells), default=0)
        steps = max(steps_per_block[k] if k < len(steps_per_block) else 0, last_fill)
        # the response may end inside the last block: stop once its shown positions are decided
        frames = last_fill if k == len(blocks) - 1 else steps
        for step in range(1, frames + 1):
            parts = []
            for token, filled in cells:
                piece = _visible(tokenizer.decode([token]))
                if filled == 0:
                    parts.append(f"{dim}{piece}{reset}")
                elif filled < step:
                    parts.append(piece)
                elif filled == step:
                    parts.append(f"{new}{piece}{reset}")
                else:
                    parts.append(glyph)
            decided = sum(1 for _, filled in cells if filled <= step)
            print(f"block {k:>{width}} step {step:>2}/{steps:<2} │{''.join(parts)}│ {decided}/{len(cells)}",
                  file=out, flush=True)
            if delay:
                time.sleep(delay)


def render_rounds(tokenizer, response: Sequence[int], trajectory: dict, generation, out, delay: float = 0.0) -> None:
    """Replay self-speculative decoding round by round from the record kept inside the jitted loop.

    One line per round: the drafts accepted (green on a terminal), the causal pass's own token in
    brackets (where the draft first differed, or after a fully accepted draft), then
    REJECTED_MARK and the drafts rejected (dim). A round cut by EOS or max_new_tokens shows what it
    emitted and nothing rejected.
    """
    color = out.isatty() and os.environ.get("NO_COLOR") is None
    green, own, dim, reset = ("\x1b[1;32m", "\x1b[1;33m", "\x1b[2m", "\x1b[0m") if color else ("", "", "", "")
    text = lambda ids: "".join(_visible(tokenizer.decode([token])) for token in ids)
    rounds = list(zip(trajectory["drafts"], trajectory["accepted"], trajectory["emitted"], strict=True))
    width, position = len(str(len(rounds))), 0
    for number, (drafts, accepted, emitted) in enumerate(rounds, 1):
        tokens = response[position:position + emitted]
        position += emitted
        line = f"{green}{text(tokens[:accepted])}{reset}"
        if emitted > accepted:
            line += f"{own}[{text(tokens[accepted:])}]{reset}"
            if accepted < len(drafts):
                line += f"{dim}{REJECTED_MARK}{text(drafts[accepted:])}{reset}"
        print(f"round {number:>{width}}/{len(rounds)} │{line}│ {accepted}/{generation.block_size} drafts accepted, "
              f"{emitted} emitted", file=out, flush=True)
        if delay:
            time.sleep(delay)


def _visible(piece: str) -> str:
    return piece.replace("\n", "⏎").replace("\r", "␍").replace("\t", "⇥") or "∅"


def _encodable(text: str, stream) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "utf-8")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


def summary(metrics: dict, tokens: int, finished: str, mode: Mode) -> str:
    steps = metrics["steps_per_block"]
    shown = steps if len(steps) <= 12 else steps[:12] + ["..."]
    blocks = {Mode.DIFFUSION: f"steps per block {shown}, ",
              Mode.SELF_SPECULATIVE: f"{len(steps)} rounds, "}.get(mode, "")
    compile_note = ", compile included" if metrics["includes_compile"] else ""
    return (f"-- {tokens} tokens (stopped by {finished}), {metrics['nfe']} forwards, "
            f"{metrics['tokens_per_forward']:.2f} tokens/forward, {blocks}"
            f"{metrics['seconds']:.2f} s ({metrics['tokens_per_second']} tokens/s{compile_note})")
