"""The gated MLP's SiLU and gating in blocks of rows on the thread pool: bit for bit the one-shot expressions."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.kernels import gated_mlp
from attnkit.kernels._threads import num_threads
from attnkit.kernels.activations import activation_forward


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_silu_gating_in_blocks_equals_the_one_shot_expressions(dtype, threads):
    rng = np.random.default_rng(0)
    both = (rng.standard_normal((2, 700, 600)) * 40).astype(dtype)  # large enough that exp(-x) overflows
    gate_pre, up = both[..., :300], both[..., 300:]  # the fused product's halves: strided views
    before = both.copy()
    with num_threads(threads):
        gate, hidden = gated_mlp._silu_gate(gate_pre, up)
    expected = activation_forward(gate_pre, "silu")  # (2, 700, 300)
    assert len(range(0, 1400, gated_mlp._SILU_CHUNK // 300)) > 1  # more than one block
    assert gate.dtype == dtype and gate.shape == hidden.shape == (2, 700, 300)
    np.testing.assert_array_equal(gate, expected)
    np.testing.assert_array_equal(hidden, expected * up)
    np.testing.assert_array_equal(both, before)
