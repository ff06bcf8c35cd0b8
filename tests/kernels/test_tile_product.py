"""A tile product raises no invalid-value warning (the suite turns warnings into errors) and keeps NumPy's result."""
from __future__ import annotations

import warnings

import numpy as np

from attnkit.kernels._masked_product import tile_product


def test_a_tile_product_is_numpys_product_without_the_invalid_value_warning():
    a = np.array([[np.inf, 0.0], [1.0, 2.0]], np.float32)  # inf * 0: NaN in the first row
    b = np.array([[0.0, 1.0], [1.0, 1.0]], np.float32)
    out = np.empty((2, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = tile_product(a, b, out=out)
    with np.errstate(invalid="ignore"):
        expected = a @ b
    assert got is out
    np.testing.assert_array_equal(got, expected)  # NaN where NumPy gives NaN, the rest exact
    assert np.isnan(got[0, 0]) and got[1].tolist() == [2.0, 3.0]
