"""--quantize / --mesh / --target auto (`clover_jax.api.placement`): refused with a clear message
before anything loads, through `serve`, `generate` and the lm-eval model; auto resolved by the
plan's arithmetic for this process's devices."""

from __future__ import annotations

import pytest

from clover_jax import bundled_model_path
from clover_jax.api.cli.main import main
from clover_jax.api.placement import check_placement, parse_mesh, resolve_placement
from clover_jax.core.config import CloverConfig
from clover_jax.core.quantization import QuantSpec


def test_parse_mesh():
    assert parse_mesh("1,8,1") == {"data": 1, "expert": 8, "tensor": 1}
    assert parse_mesh((1, 2, 4)) == parse_mesh({"expert": 2, "tensor": 4}) == {"data": 1, "expert": 2, "tensor": 4}
    for bad in ("8", "1,8", "1,x,1", "1,0,1", "1,8,1,1"):
        with pytest.raises(ValueError, match="DATA,EXPERT,TENSOR"):
            parse_mesh(bad)


@pytest.mark.parametrize("options, message", [
    (dict(mesh="1,8,1", devices=4), "is 8 devices, but this machine has 4"),
    (dict(mesh="2,4,1", devices=8), "DATA must be 1"),
    (dict(mesh="1,8,1", target="auto"), "drop --mesh or --target"),
    (dict(quantize="int4", target="auto"), "drop --quantize or --target"),
    (dict(quantize="int3"), "--quantize"),
    (dict(target="v6e-1"), "--target must be 'auto'"),
    (dict(mesh="1,2,1", devices=2, adapter="dir"), "--adapter loads onto one device"),
])
def test_bad_placements_are_refused(options, message):
    options = {"quantize": None, "mesh": None, "target": None, **options}
    with pytest.raises(ValueError, match=message):
        check_placement(**options)


def test_good_placements():
    assert check_placement(quantize="int4", mesh="1,4,2", target=None, devices=8) == \
        {"data": 1, "expert": 4, "tensor": 2}
    placement = resolve_placement(CloverConfig.from_pretrained(bundled_model_path()), quantize="int8", mesh=None,
                                  target=None, context_length=512, batch=4)
    assert placement.quantize == QuantSpec.parse("int8") and placement.mesh_shape is None


def test_target_auto_takes_the_plans_recommendation_for_this_machine():
    from clover_jax import plan

    config = CloverConfig.from_pretrained(bundled_model_path())
    placement = resolve_placement(config, quantize=None, mesh=None, target="auto", context_length=512, batch=4)
    recommended = plan(config, None, context_length=512, batch=4).recommendation
    assert placement.quantize == recommended.quantize and placement.mesh_shape is None  # one CPU device
    assert "plan for" in placement.reason


@pytest.mark.parametrize("argv, message", [
    (["serve", "--mesh", "1,2,1"], "--mesh 1,2,1 is 2 devices, but this machine has 1"),
    (["serve", "--target", "auto", "--quantize", "int8"], "drop --quantize or --target"),
    (["serve", "--mesh", "1,1"], "three integers"),
    (["generate", "hello", "--target", "auto", "--mesh", "1,1,1"], "drop --mesh or --target"),
    (["generate", "hello", "--mesh", "2,1,1"], "DATA must be 1"),
])
def test_the_commands_refuse_bad_placements_as_usage_errors(argv, message, capsys, monkeypatch):
    from clover_jax.model import clover_model

    monkeypatch.setattr(clover_model.CloverModel, "from_pretrained", _never)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_lm_eval_model_refuses_a_bad_mesh_before_loading(monkeypatch):
    pytest.importorskip("lm_eval")
    from clover_jax.api.lm_eval_model import CloverLM
    from clover_jax.model import clover_model

    monkeypatch.setattr(clover_model.CloverModel, "from_pretrained", _never)
    with pytest.raises(ValueError, match="is 4 devices, but this machine has 1"):
        CloverLM(pretrained=str(bundled_model_path()), mesh="1x4x1")
    with pytest.raises(ValueError, match="drop --mesh or --target"):
        CloverLM(pretrained=str(bundled_model_path()), mesh="1.1.1", target="auto")


def _never(*args, **kwargs):
    raise AssertionError("the weights were loaded before the flags were checked")
