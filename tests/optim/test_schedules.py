"""The shared learning-rate schedule: its formula at every step, its ends, and its argument checks."""
import math

import numpy as np
import pytest

from attnkit.optim import warmup_cosine


@pytest.mark.parametrize("peak,warmup,total,floor", [(1.0, 10, 100, 0.1), (3e-3, 0, 7, 0.0), (0.5, 5, 5, 0.05),
                                                     (2.0, 1, 1, 0.3)])
def test_every_step_follows_the_formula(peak, warmup, total, floor):
    steps = np.arange(total)
    warm = np.minimum(1.0, (steps + 1) / max(warmup, 1))
    cosine = 0.5 * (1 + np.cos(np.pi * steps / max(total - 1, 1)))
    want = peak * warm * (floor + (1 - floor) * cosine)
    got = np.array([warmup_cosine(int(s), peak=peak, warmup=warmup, total=total, floor=floor) for s in steps])
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_ends_and_shape():
    lrs = [warmup_cosine(s, peak=1.0, warmup=10, total=200, floor=0.1) for s in range(260)]
    assert lrs[0] == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0.0))))
    assert lrs[199] == pytest.approx(0.1) and lrs[259] == lrs[199]  # past the end: the final value
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10], strict=True))  # warm-up rises
    assert all(a >= b for a, b in zip(lrs[9:199], lrs[10:200], strict=True))  # then decays
    assert max(lrs) <= 1.0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(step=-1), ValueError, "step must be non-negative"),
    (dict(step=1.5), TypeError, "step must be an integer"),
    (dict(peak=0.0), ValueError, "peak must be a finite number > 0"),
    (dict(peak=float("nan")), ValueError, "peak must be a finite number > 0"),
    (dict(warmup=-2), ValueError, "warmup must be non-negative"),
    (dict(total=0), ValueError, "total must be positive"),
    (dict(floor=1.5), ValueError, r"floor must be a number in \[0, 1\]"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    args = dict(step=0, peak=1.0, warmup=2, total=10, floor=0.0) | kwargs
    step = args.pop("step")
    with pytest.raises(error, match=match):
        warmup_cosine(step, **args)
