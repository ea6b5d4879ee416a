"""LoRA and QLoRA: adapters on every target (routed experts as grouped matmuls), merging, our
adapter layout, PEFT's layout checked with `peft` on `transformers`, QLoRA's gradients, and a
short LoRA conversion of the bundled base end to end."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.adapters import lora
from clover_jax.adapters.lora import LoraSpec
from clover_jax.training import FinetuneConfig
from tests.checkpoints import TWO_LAYERS, write_hf_checkpoint
from tests.conftest import MASK_ID, token_ids

EVERY_TARGET = ("attention", "gdn", "shared_expert", "routed_experts", "router")


def random_trainable(params, config, spec: LoraSpec, seed: int) -> dict:
    """A trainable pytree whose every part moves the model: B drawn (it starts at zero), the block-mode
    tensors and mask rows perturbed."""
    trainable = lora.init_trainable(params, config, spec, jax.random.key(seed))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(trainable)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    moved = []
    for (path, leaf), key in zip(leaves, keys, strict=True):
        name = str(getattr(path[-1], "key", path[-1]))
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        # B: a delta of ~20% of the weight's scale (inputs are O(1), rank 4, A ~ U(±1/√in))
        moved.append(noise * 0.3 / np.sqrt(spec.rank) if name == "b" else leaf + 0.1 * noise if name != "a" else leaf)
    return jax.tree_util.tree_unflatten(treedef, moved)


def relative_gap(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


@pytest.fixture(scope="module")
def qwen_base(tmp_path_factory) -> str:
    """A two-layer random Qwen3.5-MoE (no mask token, no block-mode tensors): PEFT's base."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen_two_layers"), TWO_LAYERS, seed=5)


@pytest.fixture(scope="module")
def small_clover(small_clover_checkpoint):
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(small_clover_checkpoint, progress=False)


@pytest.fixture(scope="module")
def clover_adapter(small_clover):
    spec = LoraSpec(rank=4, alpha=8.0, targets=EVERY_TARGET, mask_token_id=MASK_ID,
                    tied=small_clover.config.tie_word_embeddings)
    return spec, random_trainable(small_clover.params, small_clover.config, spec, seed=3)


def test_an_adapted_training_pass_equals_the_merged_weights(small_clover, clover_adapter):
    """Every target adapted, the routed experts through grouped matmuls of the factors: the noisy
    stream's logits of the attached adapters equal those of the merged weights (the expert loop)."""
    from clover_jax.training import block_diffusion_logits

    spec, trainable = clover_adapter
    clean = token_ids(2, 32, MASK_ID, seed=1)
    noisy = np.where(np.random.RandomState(2).rand(2, 32) < 0.5, MASK_ID, clean).astype(np.int32)
    merged = block_diffusion_logits(small_clover, clean, noisy, 8, params=lora.merge(small_clover.params, trainable,
                                                                                      spec))
    attached = block_diffusion_logits(small_clover, clean, noisy, 8, params=lora.attach(small_clover.params,
                                                                                       trainable, spec))
    base = block_diffusion_logits(small_clover, clean, noisy, 8)
    assert relative_gap(merged, base) > 0.05  # the adapter is far from trivial
    # The training pass keeps the frozen LM head (`lora.attach`): only the mask token's own logit,
    # which the loss and decoding set to -inf, may differ from the merged weights'.
    kept = np.arange(merged.shape[-1]) != MASK_ID
    assert relative_gap(attached[..., kept], merged[..., kept]) < 1e-5


def test_the_adapter_directory_loads_onto_its_base_as_the_merged_model(small_clover, small_clover_checkpoint,
                                                                         clover_adapter, tmp_path):
    from clover_jax import CloverModel
    from clover_jax.training.conversion import Target
    from clover_jax.training.outputs import write_adapter

    spec, trainable = clover_adapter
    target = Target(small_clover.config, None, MASK_ID, False, {"mask_token_id": MASK_ID})
    write_adapter(str(tmp_path / "adapter"), jax.device_get(trainable), spec,
                            base_config=small_clover.config, target=target, tokenizer_source=small_clover_checkpoint)
    loaded = CloverModel.from_pretrained(small_clover_checkpoint, adapter=str(tmp_path / "adapter"), progress=False)
    merged = CloverModel(small_clover.config, lora.merge(small_clover.params, trainable, spec), small_clover.dtype)
    ids = token_ids(1, 24, MASK_ID, seed=4)
    np.testing.assert_array_equal(np.asarray(loaded.forward(ids)), np.asarray(merged.forward(ids)))
    block = np.where(np.arange(8) % 2 == 0, MASK_ID, ids[:, :8]).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(loaded.denoise_logits(ids[:, :16], block)),
                                  np.asarray(merged.denoise_logits(ids[:, :16], block)))
    from decoding import GenerationConfig

    assert GenerationConfig.from_pretrained(loaded.path).mask_token_id == MASK_ID  # what generate reads
    # `clover-jax serve --adapter` loads through the same call, with the adapter's tokenizer (the base
    # here is given the bundled one, whose vocabulary has the same size)
    import shutil

    import clover_jax
    from clover_jax.api.serving.server import build_service

    base = shutil.copytree(small_clover_checkpoint, tmp_path / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(clover_jax.bundled_model_path(), name), base / name)
    write_adapter(str(tmp_path / "served"), jax.device_get(trainable), spec, base_config=small_clover.config,
                            target=target, tokenizer_source=str(base))
    service = build_service(str(base), adapter=str(tmp_path / "served"))
    try:
        np.testing.assert_array_equal(np.asarray(service.model.forward(ids)), np.asarray(merged.forward(ids)))
    finally:
        service.engine.close()


def test_an_adapter_is_refused_on_another_base_or_with_files_missing(small_clover, clover_adapter, qwen_base,
                                                                      small_clover_checkpoint, tmp_path):
    from clover_jax import CloverModel
    from clover_jax.adapters import adapter_io
    from clover_jax.training.conversion import Target
    from clover_jax.training.outputs import write_adapter

    spec, trainable = clover_adapter
    other = dict(TWO_LAYERS, hidden_size=32, head_dim=16)
    other_dir = write_hf_checkpoint(tmp_path / "other", other, seed=1)
    target = Target(small_clover.config, None, MASK_ID, False, {"mask_token_id": MASK_ID})
    adapter = write_adapter(str(tmp_path / "adapter"), jax.device_get(trainable), spec,
                                      base_config=small_clover.config, target=target,
                                      tokenizer_source=small_clover_checkpoint)
    with pytest.raises(ValueError, match="different base model"):
        CloverModel.from_pretrained(other_dir, adapter=adapter, progress=False)
    os.remove(os.path.join(adapter, adapter_io.WEIGHTS))
    with pytest.raises(ValueError, match="lacks clover_adapter.safetensors"):
        CloverModel.from_pretrained(small_clover_checkpoint, adapter=adapter, progress=False)


def test_peft_loads_the_exported_adapter_with_the_same_causal_logits(qwen_base, tmp_path):
    """The PEFT layout on transformers' Qwen3_5MoeForCausalLM (peft's own loading: nn.Linear
    targets, the router and the fused experts as target_parameters) against clover-jax's merge."""
    import torch
    from peft import PeftModel
    from transformers import Qwen3_5MoeForCausalLM

    from clover_jax import CloverModel
    from clover_jax.adapters import peft_export

    base = CloverModel.from_pretrained(qwen_base, progress=False)
    mask = base.config.vocab_size - 1  # a row PEFT does not carry: left out of the comparison
    spec = LoraSpec(rank=4, alpha=8.0, targets=EVERY_TARGET, mask_token_id=mask, tied=False)
    trainable = random_trainable(base.params, base.config, spec, seed=7)
    out = peft_export.save_peft_adapter(str(tmp_path / "peft"), jax.device_get(trainable), spec, config=base.config)
    with open(os.path.join(out, "adapter_config.json")) as handle:
        assert json.load(handle)["target_parameters"] == ["mlp.gate.weight", "mlp.experts.gate_up_proj",
                                                           "mlp.experts.down_proj"]
    torch.set_num_threads(1)
    model = PeftModel.from_pretrained(Qwen3_5MoeForCausalLM.from_pretrained(qwen_base).eval(), out).eval()
    ids = token_ids(2, 24, mask, seed=8)
    with torch.no_grad():
        reference = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()[..., :mask]
        with model.disable_adapter():
            plain = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()[..., :mask]
    ours = CloverModel(base.config, lora.merge(base.params, trainable, spec), base.dtype).forward(ids)
    ours = np.asarray(ours)[..., :mask]
    assert relative_gap(plain, ours) > 0.05  # the adapter is far from trivial
    assert relative_gap(ours, reference) < 1e-5


@pytest.mark.parametrize(("fields", "match"), [
    ({"lora_targets": ("attention", "mlp")}, "unknown target"),
    ({"lora_rank": 0}, "lora_rank"),
    ({"quantize": "int8"}, "method='lora'"),
    ({"method": "lora", "quantize": "int3"}, "quantize"),
    ({"method": "lora", "lora_targets": ("router",), "freeze_router": True}, "frozen router"),
])
def test_bad_lora_settings_are_refused_when_the_config_is_made(fields, match):
    with pytest.raises(ValueError, match=match):
        FinetuneConfig(**fields)


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """Two QLoRA (int4) steps of a conversion of the bundled Qwen base, with Orbax checkpoints."""
    from clover_jax.training import finetune
    from clover_jax.training.tiny.recipe import BASE_DIR, Recipe, task_controls, write_task_data

    directory = tmp_path_factory.mktemp("qlora")
    data = write_task_data(directory / "train.jsonl", Recipe().task, count=32, seed=0, thinking_fraction=0.8)
    config = FinetuneConfig(method="lora", quantize="int4", lora_rank=4, steps=2, batch_size=4, seq_len=64,
                            block_size=16, learning_rate=3e-3, warmup_steps=1, log_every=1, load_balance_weight=0.0,
                            checkpoint_dir=str(directory / "checkpoints"), generation_config=task_controls(Recipe()))
    return finetune(BASE_DIR, data, directory / "out", config=config, progress=False), config, data, directory


def test_a_qlora_run_trains_every_trainable_leaf_and_checkpoints_only_them(qlora_run):
    """Over an int4 base: every adapter (the routed experts' through the quantised stacks), block-mode
    tensor and mask row moved from its initial value (so each got a gradient); the Orbax state holds
    the trainable part and its optimizer moments, not the base; the adapter is the output."""
    from clover_jax import CloverModel
    from clover_jax.adapters import adapter_io
    from clover_jax.training import finetune
    from clover_jax.training.tiny.recipe import BASE_DIR

    result, config, data, directory = qlora_run
    assert sorted(os.listdir(result.out)) == sorted([
        adapter_io.CONFIG, adapter_io.WEIGHTS, "config.json", "generation_config.json", "loss.png", "metrics.jsonl",
        "peft", "tokenizer.json", "tokenizer_config.json"])  # QLoRA: the adapter is the output; no merged weights
    assert os.path.isfile(os.path.join(result.out, "peft", "adapter_model.safetensors"))
    adapter = adapter_io.read_adapter(result.out)
    assert adapter.config.model_type == "clover_moe" and adapter.spec.mask_token_id == 127
    base = CloverModel.from_pretrained(BASE_DIR, quantize="int4", progress=False)
    initial = lora.init_trainable(base.params, base.config, adapter.spec, jax.random.key(config.seed))
    initial_leaves = dict(adapter_io.flat_tensors(jax.device_get(initial)))
    trained_leaves = adapter_io.flat_tensors(adapter.trainable)
    assert sorted(initial_leaves) == sorted(trained_leaves)
    assert any(".experts_gate_up_proj.lora_a" in name for name in trained_leaves)
    assert any(name.startswith("mask_rows.") for name in trained_leaves)
    assert any(name.endswith("block_logit_scale") for name in trained_leaves)
    unmoved = [name for name, value in trained_leaves.items() if np.array_equal(value, initial_leaves[name])]
    # The mask token's logit is -inf in the training softmax (as in decoding), so its LM-head row,
    # trainable as the spec asks, never receives a gradient.
    assert unmoved == ["mask_rows.lm_head"]
    # The Orbax state: the trainable part and its two AdamW moments, not the base.
    import orbax.checkpoint as ocp

    state_dir = os.path.join(config.checkpoint_dir, "2", "state")
    stored = ocp.PyTreeCheckpointer().metadata(state_dir)
    leaves = jax.tree_util.tree_leaves(getattr(stored, "item_metadata", stored),
                                       is_leaf=lambda leaf: hasattr(leaf, "shape"))
    stored_size = sum(int(np.prod(leaf.shape)) for leaf in leaves if hasattr(leaf, "shape"))
    trained = lora.parameter_count(adapter.trainable)
    assert 3 * trained <= stored_size < 3 * trained + 64
    model = CloverModel.from_pretrained(BASE_DIR, adapter=result.out, quantize="int4", progress=False)
    assert model.config.mask_token_id == 127 and np.isfinite(np.asarray(model.forward(np.arange(8)[None]))).all()
    # The same checkpoints under a different frozen base (the float one) are refused.
    with pytest.raises(ValueError, match="different frozen base"):
        finetune(BASE_DIR, data, directory / "again", config=FinetuneConfig(**{
            **{f: getattr(config, f) for f in config.__dataclass_fields__}, "quantize": None, "steps": 3}),
            progress=False)


def test_a_qlora_run_with_its_base_in_host_memory_follows_the_same_loss_curve(qlora_run, tmp_path):
    """`offload_base`: the int4 base's stacked matrices in pinned host memory (a one-device mesh),
    each layer copied in where it runs, "layer" remat — the trainer's loop (placement, the base's
    fingerprint, checkpoints) gives the loss curve of the run with the base on the device."""
    from clover_jax.training import finetune
    from clover_jax.training.tiny.recipe import BASE_DIR

    result, config, data, _ = qlora_run
    offloaded = FinetuneConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                  "offload_base": True, "remat": "layer",
                                  "checkpoint_dir": str(tmp_path / "checkpoints")})
    again = finetune(BASE_DIR, data, tmp_path / "out", config=offloaded, progress=False)
    want = [record["loss"] for record in result.metrics if "loss" in record]
    got = [record["loss"] for record in again.metrics if "loss" in record]
    assert len(got) == len(want) == config.steps
    np.testing.assert_allclose(got, want, rtol=2e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_the_mask_row_beside_the_table_has_the_loss_and_gradient_of_the_row_written_into_it(small_clover, tied):
    """`attach` leaves the frozen tables as they are and puts the mask token's embedding row beside
    the table: the loss and every gradient equal those of the tables with the trained rows
    written into them (the dense form: a table copy and a table-wide gradient)."""
    import dataclasses

    from clover_jax.nn.model import TRAINED_MASK_ROW
    from clover_jax.training.batches import Normalisers, block_rows
    from clover_jax.training.block_pass import training_module
    from clover_jax.training.loss import LossSettings, loss_parts
    from clover_jax.training.masking import draw_noise
    from tests.training.test_loss import B, packed_rows

    config = dataclasses.replace(small_clover.config, tie_word_embeddings=tied)
    base = {name: leaf for name, leaf in small_clover.params.items() if not (tied and name == "lm_head")}
    module = training_module(small_clover.module.clone(config=config))
    spec = LoraSpec(rank=4, alpha=8.0, targets=("attention",), mask_token_id=MASK_ID, tied=tied)
    trainable = random_trainable(base, config, spec, seed=4)
    rows = packed_rows()
    noise = draw_noise(jax.random.key(5), block_rows(rows, B)[1], min_ratio=0.5, complementary=True)
    settings = LossSettings(block_size=B, mask_token_id=MASK_ID, coreset=True)

    def written(base, trainable, spec):
        params = lora.attach(base, trainable, spec)
        embedding = {k: v for k, v in params["embed_tokens"].items() if k != TRAINED_MASK_ROW}
        return lora._with_mask_rows({**params, "embed_tokens": embedding}, trainable["mask_rows"], spec)

    def loss(trainable, attach):
        return loss_parts(attach(base, trainable, spec), module, rows, noise, Normalisers(jnp.float32(10.0),
                          jnp.float32(10.0)), settings=settings, coreset_top_p=jnp.float32(0.9)).loss

    beside, beside_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(trainable, lora.attach)
    dense, dense_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(trainable, written)
    np.testing.assert_allclose(float(beside), float(dense), rtol=1e-6)
    assert float(np.abs(beside_grads["mask_rows"]["embedding"]).max()) > 0  # noisy blocks hold the mask token
    if not tied:  # the mask token's logit is -inf in the loss: its LM-head row gets no gradient in either form
        assert not np.any(dense_grads["mask_rows"]["lm_head"]) and not np.any(beside_grads["mask_rows"]["lm_head"])
    for got, want in zip(jax.tree.leaves(beside_grads), jax.tree.leaves(dense_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
