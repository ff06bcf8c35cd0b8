"""attnkit.set_num_threads / attnkit.num_threads: the one public setting for the kernels' threads."""
import numpy as np
import pytest

import attnkit
from attnkit.kernels import _threads, attention_forward


def test_set_and_restore():
    cores = _threads.default_num_threads()
    attnkit.set_num_threads(3)
    try:
        assert attnkit.get_num_threads() == 3 and _threads.default_num_threads() == 3
        with attnkit.num_threads(1):
            assert attnkit.get_num_threads() == 1
        assert attnkit.get_num_threads() == 3
    finally:
        attnkit.set_num_threads(None)
    assert attnkit.get_num_threads() == cores


def test_context_restores_after_an_error():
    with pytest.raises(RuntimeError), attnkit.num_threads(2):
        raise RuntimeError
    assert _threads._num_threads is None


@pytest.mark.parametrize("bad, error, message", [(0, ValueError, "positive, got 0"), (-1, ValueError, "positive"),
                                                 (1.5, TypeError, "an integer, got float"),
                                                 (True, TypeError, "an integer, got bool"),
                                                 ("2", TypeError, "an integer, got str")])
def test_bad_counts_are_refused(bad, error, message):
    with pytest.raises(error, match=f"n must be {message}"):
        attnkit.set_num_threads(bad)


def test_the_tiled_kernel_gives_the_same_result_on_one_thread_and_on_several():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 40, 8)) for _ in range(3))
    outs = []
    for n in (1, 3):
        with attnkit.num_threads(n):
            outs.append(attention_forward(q, k, v, need_weights=False)[0])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
