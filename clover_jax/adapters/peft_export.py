"""A LoRA run's adapter in PEFT's layout, for a Qwen3.5/3.6-MoE base (`peft` loads it onto
`transformers`' `Qwen3_5MoeForCausalLM`; tested against peft 0.21.2).

Written: `adapter_config.json` and `adapter_model.safetensors` as `PeftModel.save_pretrained`
writes them (float32; PEFT's scaling alpha / rank is ours):

* `nn.Linear` modules by name (`target_modules`): attention q/k/v/o, the GDN projections, the
  shared expert's gate/up/down — `...{module}.lora_A.weight` [r, in] = A, `lora_B.weight` [out, r] = B;
* the router (`mlp.gate`, a parameter in transformers, not an `nn.Linear`): `target_parameters`
  `mlp.gate.weight`, the same two-dimensional factors;
* the fused routed experts through `target_parameters` `mlp.experts.gate_up_proj` and
  `mlp.experts.down_proj` (PEFT's `ParamWrapper`, 3-D parameters [experts, out, in]): PEFT wraps
  the experts module once per parameter, in list order, so gate|up's factors sit under
  `experts.base_layer.` and down's under `experts.`; lora_A.weight [experts · r, in] holds the
  experts' A one after another, lora_B.weight [out, r · experts] interleaves B rank-major
  (column j · experts + e is expert e's rank j).

Not representable in PEFT, and omitted: the Clover block-mode tensors and the mask token's
embedding / LM-head rows (a Qwen base has no mask token; a causal forward never reads the
block-mode tensors). So the PEFT adapter reproduces the causal model on the base vocabulary, not
block diffusion: that needs our own layout (`adapter_io`).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from clover_jax.adapters import lora
from clover_jax.adapters.lora import LoraSpec
from clover_jax.core.config import CloverConfig

logger = logging.getLogger(__name__)

PEFT_VERSION = "0.21.2"
PEFT_MODULES = {"attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "gdn": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
                "shared_expert": ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]}
PEFT_PARAMETERS = {"router": ["mlp.gate.weight"],
                   "routed_experts": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
QWEN_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def peft_tensors(trainable: dict, config: CloverConfig) -> dict[str, np.ndarray]:
    """{PEFT state-dict name: float32 array} for every adapter of `trainable` (canonical layout)."""
    pattern = config.group_pattern
    tensors = {}
    for path, factors in lora.lora_items(trainable):
        slot = int(path[1].rsplit("_", 1)[1])
        inside = path[2:]
        a, b = np.asarray(factors["a"], np.float32), np.asarray(factors["b"], np.float32)
        for group in range(config.num_groups):
            layer = group * len(pattern) + slot
            prefix = f"base_model.model.model.layers.{layer}."
            if inside == ("mlp", "experts_gate_up_proj"):
                module = prefix + "mlp.experts.base_layer"
            elif inside == ("mlp", "experts_down_proj"):
                module = prefix + "mlp.experts"
            else:  # a Linear's weight, or the router's
                module = prefix + ".".join(inside[:-1] if inside[-1] == "weight" else inside)
            a_g, b_g = a[group], b[group]
            if a_g.ndim == 3:  # [experts, r, in], [experts, out, r]
                experts, rank, _ = a_g.shape
                tensors[module + ".lora_A.weight"] = a_g.reshape(experts * rank, -1)
                tensors[module + ".lora_B.weight"] = np.transpose(b_g, (1, 2, 0)).reshape(b_g.shape[1], -1)
            else:
                tensors[module + ".lora_A.weight"], tensors[module + ".lora_B.weight"] = a_g, b_g
    return {name: np.ascontiguousarray(value) for name, value in tensors.items()}


def peft_config(spec: LoraSpec, base_name: str | None) -> dict:
    """adapter_config.json: PEFT's `LoraConfig` fields (the unnamed ones take PEFT's defaults)."""
    modules = [name for target in spec.targets for name in PEFT_MODULES.get(target, [])]
    parameters = [name for target in ("router", "routed_experts") if target in spec.targets
                  for name in PEFT_PARAMETERS[target]]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "target_modules": modules or None, "target_parameters": parameters or None,
            "modules_to_save": None, "revision": None}


def save_peft_adapter(out: str, trainable: dict, spec: LoraSpec, *, config: CloverConfig,
                      base_name: str | None = None) -> str | None:
    """Write the PEFT layout into `out` when the base is a Qwen3.5/3.6-MoE (returns `out`), else
    log why not and return None (a Clover base has no `transformers` model for PEFT to load onto)."""
    from safetensors.numpy import save_file

    if config.model_type not in QWEN_TYPES:
        logger.info("no PEFT adapter: the base is %s, which transformers has no model for (PEFT layouts are "
                    "written for Qwen3.5/3.6-MoE bases)", config.model_type)
        return None
    os.makedirs(out, exist_ok=True)
    save_file(peft_tensors(trainable, config), os.path.join(out, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as handle:
        json.dump(peft_config(spec, base_name), handle, indent=2)
        handle.write("\n")
    logger.info("wrote the PEFT adapter to %s (block-mode tensors and the mask rows are not in it)", out)
    return out
