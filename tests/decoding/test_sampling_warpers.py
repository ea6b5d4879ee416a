"""`decoding.controls.sampling_logits` against transformers' own logits warpers (temperature, top-k,
top-p, applied in that order): the same tokens kept, the same values."""

from __future__ import annotations

import numpy as np
import pytest

from decoding.controls import Controls, sampling_logits


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 50, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.5),
                                                       (1.0, 0, 1.0), (0.5, 1, 1.0), (1.0, 300, 0.95)])
def test_sampling_logits_equal_transformers_warpers(temperature, top_k, top_p):
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.default_rng(top_k).normal(size=(6, 1000)).astype(np.float32) * 3
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    expected = LogitsProcessorList(warpers)(None, torch.from_numpy(logits.copy())).numpy()
    controls = Controls(*(np.float32(0.0) for _ in range(9)), temperature=np.float32(temperature),
                        top_k=np.int32(top_k), top_p=np.float32(top_p))
    ours = np.asarray(sampling_logits(logits, controls))
    assert (np.isinf(ours) == np.isinf(expected)).all()
    kept = ~np.isinf(expected)
    np.testing.assert_allclose(ours[kept], expected[kept], rtol=1e-6)
