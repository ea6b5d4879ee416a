"""`CloverModel.forward` refuses bad token ids with a ValueError before anything is compiled or run."""

from __future__ import annotations

import numpy as np
import pytest

import clover_jax.model.clover_model as clover_model_module


@pytest.mark.parametrize("ids, message", [
    (np.zeros((4,), np.int32), "must be a non-empty int array \\[batch, tokens\\], got shape \\(4,\\)"),
    (np.zeros((1, 0), np.int32), "got shape \\(1, 0\\)"),
    (np.zeros((1, 3), np.float32), "must hold integer token ids"),
    (np.array([[0, 5, 128]]), "ids in \\[0, 128\\], outside the vocabulary \\[0, 128\\)"),
    (np.array([[-1, 5]]), "outside the vocabulary"),
    (np.zeros((1, 4097), np.int32), "4097 tokens, more than max_position_embeddings=4096"),
])
def test_bad_input_ids_are_refused_before_compute(clover_model, monkeypatch, ids, message):
    calls = []
    monkeypatch.setattr(clover_model_module, "run_pass", lambda *args: calls.append(args))
    monkeypatch.setattr(clover_model_module, "run_causal", lambda *args: calls.append(args))
    with pytest.raises(ValueError, match=message):
        clover_model.forward(ids)
    assert calls == []
