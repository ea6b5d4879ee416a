"""Text from tokens as they are decided: an incremental detokenizer and the `stop` strings.

Both hold back what the next tokens may still change — an incomplete UTF-8 character, the
start of a stop string — so a streamed response never takes back what it sent, and a response
streamed in pieces is the same text as the response sent whole (they run the same code).
"""

from __future__ import annotations

from typing import Sequence

# Tokens decoded again before the new ones: enough for a byte-level BPE to settle a character
# split across tokens, few enough that each piece costs a constant amount of work.
_WINDOW = 6


class IncrementalDecoder:
    """The text of a growing token sequence, in pieces whose concatenation is the text of all
    the tokens (special tokens skipped). tokenizer: anything with `decode(ids, skip_special_tokens=)`."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window decoded again with the new tokens starts here
        self.read_offset = 0    # text up to here has been returned

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip)

    def push(self, ids: Sequence[int]) -> str:
        """New tokens -> the text they complete ("" while a character is incomplete)."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if text.endswith("\ufffd") or len(text) <= len(before) and not text.startswith(before):
            return ""  # an incomplete character: wait for the tokens that finish it
        piece = text[len(before):]
        self.prefix_offset = max(self.prefix_offset, len(self.ids) - _WINDOW)
        self.read_offset = len(self.ids)
        return piece

    def flush(self) -> str:
        """The rest, once no token will come (an incomplete character as the tokenizer shows it)."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return text[len(before):] if text.startswith(before) else ""


class StopStrings:
    """Cuts the text at the first of `stops` (OpenAI's `stop`: the string itself is not sent)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [stop for stop in stops if stop]
        self.held = ""
        self.stopped = False
        self.found: str | None = None  # the stop string the text was cut at (Anthropic's stop_sequence)

    def push(self, text: str) -> str:
        """More text -> what can be sent now; after a stop string, nothing more."""
        if self.stopped:
            return ""
        text = self.held + text
        found = [(text.find(stop), stop) for stop in self.stops if stop in text]
        if found:
            self.stopped, self.held = True, ""
            self.found = min(found)[1]
            return text[:min(found)[0]]
        keep = self._partial(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _partial(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
