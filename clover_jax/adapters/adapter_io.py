"""A LoRA run's adapter on disk, in our own layout, and loading it onto its base.

An adapter directory holds:

* `clover_adapter.safetensors` — float32 tensors named by their pytree path joined with dots:
  `groups.layer_0.self_attn.q_proj.weight.lora_a` [groups, rank, in] and `.lora_b`
  [groups, out, rank] (B unscaled; routed stacks carry [groups, experts, ...]), the fully trained
  block-mode tensors under their own path (`groups.layer_0.linear_attn.block_logit_scale`), and
  `mask_rows.embedding` / `mask_rows.lm_head` [hidden];
* `clover_adapter.json` — rank, alpha, targets, the mask token id, the vocabulary growth of a
  converted base, the written model's `config.json` fields, and the base's architecture
  fingerprint (a different base is refused before its weights are read);
* the written model's `config.json`, tokenizer files and `generation_config.json` (the mask token
  included), so the directory is the loaded model's `path` (`generate` reads its generation config
  there); it holds no base weights, so it loads only as `adapter=` of its base.

`save_adapter` writes the first two and `config.json`; the trainer adds the tokenizer files and
`generation_config.json` (`clover_jax.training.outputs.write_adapter`).
`CloverModel.from_pretrained(base, adapter=DIR, quantize=...)` loads the base in float, merges
the adapter (`lora.merge`) and then quantises as loading would: the weights it serves are the
merged ones, whichever base the adapter was trained over (for QLoRA: the float base the
quantised one was made from).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import NamedTuple

import numpy as np

from clover_jax.adapters import lora
from clover_jax.adapters.lora import LoraSpec
from clover_jax.adapters.vocabulary import grow_vocabulary
from clover_jax.core.config import CloverConfig
from clover_jax.core.tree_paths import put

logger = logging.getLogger(__name__)

WEIGHTS, CONFIG = "clover_adapter.safetensors", "clover_adapter.json"
FORMAT = "clover-lora"


def architecture_fingerprint(config: CloverConfig) -> str:
    """sha256 of the base's shape-defining config fields (mask token and model type aside: a Qwen
    base and its converted Clover have the same weights)."""
    from weights.writer import config_dict

    fields = config_dict(config, "any")
    for name in ("architectures", "model_type", "dtype", "mask_token_id", "moe_block_coreset_enabled",
                 "moe_block_coreset_top_p", "eos_token_id"):
        fields.pop(name, None)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def flat_tensors(trainable: dict) -> dict[str, np.ndarray]:
    """The trainable pytree as {dotted name: float32 host array}."""
    tensors = {}
    for path, factors in lora.lora_items(trainable):
        for part in ("a", "b"):
            tensors[".".join(path) + f".lora_{part}"] = np.asarray(factors[part], np.float32)
    for path, leaf in lora.full_items(trainable):
        tensors[".".join(path)] = np.asarray(leaf, np.float32)
    for name, row in trainable["mask_rows"].items():
        tensors[f"mask_rows.{name}"] = np.asarray(row, np.float32)
    return tensors


def nested_tensors(tensors: dict[str, np.ndarray]) -> dict:
    """`flat_tensors` read back into the trainable pytree."""
    trainable: dict = {"lora": {}, "full": {}, "mask_rows": {}}
    for name, value in tensors.items():
        parts = tuple(name.split("."))
        if parts[0] == "mask_rows":
            trainable["mask_rows"][parts[1]] = value
        elif parts[-1] in ("lora_a", "lora_b"):
            trainable["lora"] = put(trainable["lora"], parts[:-1] + (parts[-1][-1],), value)
        else:
            trainable["full"] = put(trainable["full"], parts, value)
    return trainable


def save_adapter(out: str, trainable: dict, spec: LoraSpec, *, base_config: CloverConfig, written_config: CloverConfig,
                 grown_vocab: int | None) -> str:
    """Write the adapter of a run (`trainable`, `spec`) over a base of `base_config` into `out`: its
    tensors, `clover_adapter.json` and the written model's `config.json` (`written_config`; the
    vocabulary the base grows to, `grown_vocab`, None: kept). The trainer adds the tokenizer and
    generation config (`clover_jax.training.outputs.write_adapter`)."""
    from safetensors.numpy import save_file

    from weights.writer import config_dict

    os.makedirs(out, exist_ok=True)
    save_file(flat_tensors(trainable), os.path.join(out, WEIGHTS), metadata={"format": FORMAT})
    description = {"format": FORMAT, "version": 1, "rank": spec.rank, "alpha": spec.alpha,
                   "targets": list(spec.targets), "mask_token_id": spec.mask_token_id,
                   "grown_vocab": grown_vocab, "base_fingerprint": architecture_fingerprint(base_config),
                   "config": config_dict(written_config, "float32")}
    with open(os.path.join(out, CONFIG), "w") as handle:
        json.dump(description, handle, indent=2)
        handle.write("\n")
    with open(os.path.join(out, "config.json"), "w") as handle:
        json.dump(description["config"], handle, indent=2)
        handle.write("\n")
    return out


class Adapter(NamedTuple):
    """A read adapter: spec, the trainable pytree (host arrays), the written model's config, the
    vocabulary size a converted base grows to (None: kept), the base fingerprint, the directory."""

    spec: LoraSpec
    trainable: dict
    config: CloverConfig
    grown_vocab: int | None
    base_fingerprint: str
    path: str

    def check_base(self, base_config: CloverConfig) -> None:
        if architecture_fingerprint(base_config) != self.base_fingerprint:
            raise ValueError(f"the adapter in {self.path} was trained on a different base model (architecture "
                             f"fingerprint {self.base_fingerprint[:12]}, this base's "
                             f"{architecture_fingerprint(base_config)[:12]}): load it onto the model it was "
                             "trained on")

    def merged_params(self, params: dict, base_config: CloverConfig) -> dict:
        """The base's float parameters (canonical layout) with the adapter merged in."""
        self.check_base(base_config)
        if self.grown_vocab:
            params = grow_vocabulary(params, base_config, self.grown_vocab)
        return lora.merge(params, self.trainable, self.spec)


def read_adapter(directory: str | os.PathLike) -> Adapter:
    """Read an adapter directory written by `save_adapter` (ValueError naming what is missing)."""
    from safetensors.numpy import load_file

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"adapter directory {directory} does not exist")
    missing = [name for name in (WEIGHTS, CONFIG) if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise ValueError(f"{directory} is not a clover-jax adapter: it lacks {', '.join(missing)} (a LoRA run writes "
                         f"them into out/adapter, or into out for QLoRA)")
    with open(os.path.join(directory, CONFIG)) as handle:
        description = json.load(handle)
    if description.get("format") != FORMAT:
        raise ValueError(f"{os.path.join(directory, CONFIG)}: format {description.get('format')!r}, "
                         f"expected {FORMAT!r}")
    config = CloverConfig.from_dict(description["config"], source=os.path.join(directory, CONFIG))
    spec = LoraSpec(int(description["rank"]), float(description["alpha"]), tuple(description["targets"]),
                    int(description["mask_token_id"]), bool(config.tie_word_embeddings))
    trainable = nested_tensors(load_file(os.path.join(directory, WEIGHTS)))
    return Adapter(spec, trainable, config, description.get("grown_vocab"), description["base_fingerprint"],
                   directory)
