"""A naive Python-loop decoder written from the pseudo-code of docs/design.md §4, on `denoise_logits`.

One prompt, one denoising step at a time, every control applied per position in float32
numpy. Conventions shared with the implementation (and documented in docs/design.md §4): the NFE is
the prefill (when the prompt fills at least one block) plus one per denoising step, since each
commit is fused with the next block's first step and the last block is not committed; on the
`max_steps_per_block`-th step of a block every remaining mask is filled.
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def ramp(t, start, window):
    if window == 0:
        return 1.0 if t >= start else 0.0
    return min(max((t - start) / window, 0.0), 1.0)


def process(logits, counts: Counter, t: int, thinking_open: bool, cfg):
    out = logits.astype(np.float32).copy()
    for token, count in counts.items():
        if count > 0:
            out[token] = out[token] / cfg.repetition_penalty if out[token] > 0 else out[token] * cfg.repetition_penalty
            out[token] -= cfg.frequency_penalty * count + cfg.presence_penalty
    for eos in cfg.eos_token_id:
        out[eos] += cfg.dllm_length_penalty * ramp(t, cfg.dllm_length_penalty_start, cfg.dllm_length_penalty_window)
    if thinking_open:
        out[cfg.think_end_token_id] += cfg.dllm_think_end_bias * ramp(t, cfg.dllm_think_end_start,
                                                                      cfg.dllm_think_end_window)
    out[cfg.mask_token_id] = -np.inf
    return out


class ReferenceDecoder:
    def __init__(self, model, cfg):
        self.model, self.cfg = model, cfg
        self.min_margin = np.inf      # smallest gap of any greedy decision taken
        self.fill_paths = Counter()   # "threshold" / "most_confident" steps seen

    def generate(self, prompt: list[int]):
        cfg, model = self.cfg, self.model
        size, new, mask = cfg.block_size, cfg.max_new_tokens, cfg.mask_token_id
        length = len(prompt)
        opened = max((i for i, t in enumerate(prompt) if t == cfg.think_start_token_id), default=-1)
        closed = max((i for i, t in enumerate(prompt) if t == cfg.think_end_token_id), default=-1)
        prompt_thinking = opened > closed
        first = length // size
        sequence = list(prompt[:first * size])          # prefix: prompt blocks, then committed blocks
        response: list[int] = []
        nfe = 1 if first > 0 else 0
        steps_per_block = []
        block_index = first
        while len(response) < new:
            tail = prompt[block_index * size:] if block_index == first else []
            block = list(tail) + [mask] * (size - len(tail))
            fixed = [j < len(tail) for j in range(size)]
            steps = 0
            while mask in [block[j] for j in range(size) if not fixed[j]]:
                prefix = np.asarray([sequence], np.int32).reshape(1, -1)
                logits = np.asarray(model.denoise_logits(prefix, np.asarray([block], np.int32)))[0]
                steps += 1
                nfe += 1
                counts = Counter(response)
                counts.update(block[j] for j in range(size) if not fixed[j] and block[j] != mask)
                thinking = (prompt_thinking or counts[cfg.think_start_token_id] > 0) and \
                    counts[cfg.think_end_token_id] == 0
                candidates = {}
                for j in range(size):
                    if block[j] != mask or fixed[j]:
                        continue
                    t = block_index * size + j - length
                    scores = process(logits[j], counts, t, thinking, cfg)
                    order = np.argsort(-scores, kind="stable")
                    probabilities = np.exp(scores - scores.max())
                    probabilities /= probabilities.sum()
                    self.min_margin = min(self.min_margin, scores[order[0]] - scores[order[1]],
                                          abs(probabilities[order[0]] - cfg.threshold))
                    candidates[j] = (int(order[0]), float(probabilities[order[0]]))
                fill = [j for j, (_, p) in candidates.items() if p > cfg.threshold]
                if steps >= cfg.steps_cap:
                    fill = list(candidates)
                elif fill:
                    self.fill_paths["threshold"] += 1
                else:
                    best = max(candidates.values(), key=lambda c: c[1])[1]
                    ranked = sorted(p for _, p in candidates.values())
                    if len(ranked) > 1:
                        self.min_margin = min(self.min_margin, ranked[-1] - ranked[-2])
                    fill = [min(j for j, (_, p) in candidates.items() if p == best)]
                    self.fill_paths["most_confident"] += 1
                for j in fill:
                    block[j] = candidates[j][0]
            steps_per_block.append(steps)
            response += [token for j, token in enumerate(block) if block_index * size + j >= length]
            sequence += block  # commit (the first block opens with the prompt tail)
            if any(token in cfg.eos_token_id for token in response[:new]):
                break
            block_index += 1
        response = response[:new]
        cut = next((n + 1 for n, token in enumerate(response) if token in cfg.eos_token_id), len(response))
        return response[:cut], nfe, steps_per_block
