"""Large products split by rows over attnkit's threads: the same numbers as one BLAS call, in the same dtype."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.kernels import _threads, linear
from attnkit.kernels._threads import num_threads


def _calls(monkeypatch) -> list[int]:
    """Record the worker count of every run_tasks call the product makes."""
    seen: list[int] = []
    run = _threads.run_tasks

    def counting(tasks, work, threads):
        seen.append(len(tasks))
        return run(tasks, work, threads)

    monkeypatch.setattr(linear, "run_tasks", counting)
    return seen


@pytest.mark.parametrize("threads, rows, inner, blocks", [(2, 256, 512, 2), (3, 1000, 512, 3), (4, 300, 512, 2),
                                                          (1, 1024, 512, 0), (2, 255, 512, 0), (2, 1024, 8, 0)])
def test_a_large_product_is_split_into_blocks_of_at_least_128_rows(monkeypatch, threads, rows, inner, blocks):
    seen = _calls(monkeypatch)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((rows, inner)), rng.standard_normal((inner, 256))  # 2**25 multiply-adds at 256 x 512
    with num_threads(threads):
        out = linear.product(a, b)
    assert seen == ([blocks] if blocks else [])
    np.testing.assert_allclose(out, a @ b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_split_product_keeps_float32_and_reads_transposed_operands(transposed):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((600, 512)).astype(np.float32)
    b = rng.standard_normal((512, 128)).astype(np.float32)
    if transposed:  # column-major views, as a weight's transpose is
        a, b = np.asfortranarray(a), np.asfortranarray(b)
    with num_threads(2):
        out = linear.product(a, b)
    assert out.dtype == np.float32 and out.shape == (600, 128)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-3)


def test_linear_over_a_long_sequence_is_split_and_equals_the_float64_product(monkeypatch):
    seen = _calls(monkeypatch)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 300, 256)).astype(np.float32)
    w, bias = rng.standard_normal((256, 256)).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    x_before = x.copy()
    with num_threads(2):
        y = linear.linear(x, w, bias)
    assert seen == [2] and y.dtype == np.float32 and y.shape == (2, 300, 256)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w + bias, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(x, x_before)
