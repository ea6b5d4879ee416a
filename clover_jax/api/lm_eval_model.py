"""clover-jax as an `lm-eval` model (`--model clover-jax`), answering `generate_until` with `generate`.

    import clover_jax.api.lm_eval_model  # registers "clover-jax" with lm-eval
    lm_eval.simple_evaluate(model="clover-jax",
                            model_args="pretrained=PATH,block_size=32,threshold=0.9,schedule=dream,schedule.alg=entropy",
                            tasks=["gsm8k"], apply_chat_template=True)

or from the shell: `clover-jax-lm-eval --model clover-jax --model_args pretrained=PATH,... --tasks gsm8k`
(lm-eval's own command line, with this model registered). model_args: `pretrained` (a checkpoint
directory), `dtype`, `quantize`, `impl`, `mesh` (DATA.EXPERT.TENSOR or DATAxEXPERTxTENSOR with DATA 1,
since lm-eval splits model_args on commas), `target=auto` (the format and mesh `clover_jax.plan`
recommends for this machine); every `GenerationConfig` field (`block_size`, `threshold`,
`max_new_tokens`, `schedule`, penalties, ...); `schedule.<name>` for a parameter of the schedule;
`enable_thinking` (chat template variable) and `think_end_token` (the response is the text after
its last occurrence; default `</think>` when the tokenizer has it, `none` keeps the thinking);
`seed` for sampling. The batch size is lm-eval's `--batch_size` (`auto`: 8).

Requests are grouped by their generation kwargs and decoded in batches. A request's `until`
strings cut the decoded text (after the thinking is dropped), `max_gen_toks` is `max_new_tokens`,
`do_sample` / `temperature` / `top_p` / `top_k` override the model args.

Log-likelihood requests (multiple choice, perplexity) are scored exactly by one causal pass over
context + continuation (`decoding.scoring.prompt_logprobs`: the causal distribution with the mask
token excluded, as the server's prompt log-probabilities are), so they agree with lm-eval's
`local-completions` model against `clover-jax serve`. `loglikelihood_rolling` scores a text after the
checkpoint's first EOS token, in windows of the model's context.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any

import jax
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import postprocess_generated_text
from tqdm.auto import tqdm

from decoding.generation import generate
from decoding.generation_config import GenerationConfig
from decoding.research import padded_batches
from decoding.scoring import prompt_logprobs

logger = logging.getLogger(__name__)

MODEL_OPTIONS = ("dtype", "quantize", "impl", "mesh", "target")
PLAN_CONTEXT = 32768  # positions --target auto budgets for (at most the model's context)
SCHEDULE_PREFIX = "schedule."


@register_model("clover-jax")
class CloverLM(LM):
    """An lm-eval `LM` over a Clover checkpoint; see the module docstring for `model_args`."""

    def __init__(self, pretrained: str | None = None, batch_size: int | str | None = 8,
                 max_batch_size: int | None = None, device: str | None = None, enable_thinking: bool | None = None,
                 think_end_token: str | None = None, seed: int = 0, **options: Any):
        super().__init__()
        from clover_jax.model.clover_model import CloverModel
        from clover_jax.text.tokenizer import Tokenizer

        if not pretrained:
            raise ValueError("clover-jax needs model_args='pretrained=PATH' (a checkpoint directory)")
        fields = {f.name for f in dataclasses.fields(GenerationConfig)}
        load = {key: options.pop(key) for key in MODEL_OPTIONS if key in options}
        schedule_params = {key[len(SCHEDULE_PREFIX):]: options.pop(key) for key in list(options)
                           if key.startswith(SCHEDULE_PREFIX)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"clover-jax model_args {unknown} are unknown; allowed: pretrained, batch_size, "
                             f"enable_thinking, think_end_token, seed, {', '.join(MODEL_OPTIONS)}, "
                             f"'{SCHEDULE_PREFIX}<parameter>' and the GenerationConfig fields {sorted(fields)}")
        if schedule_params:
            options["schedule_params"] = {**(options.get("schedule_params") or {}), **schedule_params}
        self.batch_size = _batch_size(batch_size)
        if device is not None:
            logger.info("clover-jax runs on JAX's devices (%s); device=%r is ignored", jax.devices()[0].platform,
                        device)
        self.config = GenerationConfig.from_pretrained(pretrained, **options)
        self.tokenizer = Tokenizer.from_pretrained(pretrained)
        self.model = CloverModel.from_pretrained(pretrained, progress=False, **_placed(pretrained, load,
                                                                                      self.batch_size))
        self.pretrained = str(pretrained)
        self.enable_thinking = enable_thinking
        if think_end_token is None and self.tokenizer.token_to_id("</think>") is not None:
            think_end_token = "</think>"
        self.think_end_token = None if str(think_end_token).lower() in ("none", "") else think_end_token
        self.key = jax.random.key(int(seed))

    # ------------------------------------------------------------------ log-likelihoods
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether every continuation token is the likeliest) per
        request, from one causal pass over the context's and the continuation's tokens (split as
        lm-eval's models split them, `_encode_pair`)."""
        results = []
        for request in tqdm(requests, desc="clover-jax loglikelihood", disable=disable_tqdm):
            context_ids, continuation_ids = self._encode_pair(*request.args)
            if not context_ids:  # lm-eval's rule for an empty context: start from the end-of-text token
                context_ids = [self._prefix_token()]
            result = self._score(context_ids, continuation_ids)
            self.cache_hook.add_partial("loglikelihood", request.args, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log P(text) per request: every token after the checkpoint's EOS token, in windows of the
        model's context (each window after the first sees the context's worth of tokens before it)."""
        limit = self.model.config.max_position_embeddings
        results = []
        for request in tqdm(requests, desc="clover-jax loglikelihood_rolling", disable=disable_tqdm):
            ids = [self._prefix_token()] + self.tokenizer.encode(request.args[0], add_special_tokens=False)
            total, done = 0.0, 1
            while done < len(ids):
                end = min(done + limit - 1, len(ids))
                begin = max(0, end - limit)
                scores = prompt_logprobs(self.model, ids[begin:end], self._special.mask_token_id)
                total += float(scores.logprobs[done - begin - 1:].sum())
                done = end
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            results.append(total)
        return results

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's rule (its API models' too): the context's trailing spaces move to the
        continuation, and the continuation's tokens are those of the whole after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
        head = self.tokenizer.encode(context, add_special_tokens=False)
        return head, whole[len(head):]

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = context + continuation
        limit = self.model.config.max_position_embeddings
        if len(ids) > limit:  # keep the continuation whole and as much context as fits (lm-eval's rule)
            ids = ids[len(ids) - limit:]
        scores = prompt_logprobs(self.model, ids, self._special.mask_token_id, top=1)
        tail = slice(len(ids) - len(continuation) - 1, None)
        greedy = bool((scores.top_ids[tail, 0] == np.asarray(continuation)).all())
        return float(scores.logprobs[tail].sum()), greedy

    def _prefix_token(self) -> int:
        eos = self._special.eos_token_id
        if not eos:
            raise ValueError("the checkpoint has no EOS token to start an empty context from")
        return int(eos[0])

    @functools.cached_property
    def _special(self) -> GenerationConfig:
        """The model args' config with the checkpoint's special token ids (mask, EOS)."""
        return self.config.with_token_ids(self.model.config, self.pretrained)

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One text per request: the response decoded without special tokens, the thinking dropped
        (see `think_end_token`), cut at the first of the request's `until` strings."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="clover-jax generate_until", disable=disable_tqdm)
        for indices in groups.values():
            gen_kwargs = dict(requests[indices[0]].args[1] or {})
            until = gen_kwargs.pop("until", None)
            config = self._config_for(gen_kwargs)
            contexts = [self.tokenizer.encode(requests[i].args[0], add_special_tokens=False) for i in indices]
            done = 0
            for batch, real in padded_batches(contexts, min(self.batch_size, len(contexts))):
                out = generate(self.model, batch, config, key=self.key if config.do_sample else None)
                for offset in range(real):
                    text = self.tokenizer.decode(out.sequences[offset], skip_special_tokens=True)
                    text = postprocess_generated_text(text, until, self.think_end_token)
                    index = indices[done + offset]
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                done += real
                bar.update(real)
        bar.close()
        return results

    def _config_for(self, gen_kwargs: dict) -> GenerationConfig:
        """The model args' generation config with a request's generation kwargs applied."""
        changes = {}
        if "max_gen_toks" in gen_kwargs:
            changes["max_new_tokens"] = int(gen_kwargs.pop("max_gen_toks"))
        temperature = gen_kwargs.pop("temperature", None)
        do_sample = gen_kwargs.pop("do_sample", None)
        if do_sample is not None:
            changes["do_sample"] = bool(do_sample)
        if temperature is not None:
            if float(temperature) == 0.0:  # lm-eval's way of asking for greedy decoding
                changes["do_sample"] = False
            else:
                changes["temperature"] = float(temperature)
        for name in ("top_p", "top_k"):
            if name in gen_kwargs:
                changes[name] = gen_kwargs.pop(name)
        if gen_kwargs:
            logger.warning("clover-jax ignores generation kwargs %s", sorted(gen_kwargs))
        return self.config.replace(**changes)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        variables = {} if self.enable_thinking is None else {"enable_thinking": bool(self.enable_thinking)}
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **variables)

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self.tokenizer.get_chat_template(None if chat_template is True else chat_template)


def _placed(pretrained: str, load: dict, batch: int) -> dict:
    """The load options with `quantize`, `mesh` ("DATA.EXPERT.TENSOR": lm-eval's model_args split on
    commas) and `target=auto` resolved (`clover_jax.api.placement`) into from_pretrained's arguments."""
    from clover_jax.api.placement import resolve_placement
    from clover_jax.core.config import CloverConfig

    mesh = load.pop("mesh", None)
    mesh = mesh.replace(".", ",").replace("x", ",") if isinstance(mesh, str) else mesh
    config = CloverConfig.from_pretrained(pretrained)
    placement = resolve_placement(config, quantize=load.pop("quantize", None), mesh=mesh,
                                  target=load.pop("target", None), batch=batch,
                                  context_length=min(PLAN_CONTEXT, config.max_position_embeddings))
    logger.info("clover-jax: %s (%s)", placement.describe(), placement.reason)
    return {**load, **placement.load_options()}


def _batch_size(value: int | str | None) -> int:
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return 8
    size = int(value)
    if size < 1:
        raise ValueError(f"clover-jax batch_size must be >= 1, got {value!r}")
    return size


def main() -> None:
    """lm-eval's command line with the clover-jax model registered (`clover-jax-lm-eval`)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
