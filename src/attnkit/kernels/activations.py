"""Activations of the feed-forward network and their derivatives.

``gelu`` is the exact ``x * Phi(x)`` with the Gaussian CDF (BERT's and torch's default). numpy has no erf:
float64 uses W. J. Cody's (1969) rational approximations, accurate to float64 rounding; float32 uses the
``x P(x^2) / Q(x^2)`` form on [-4, 4] that Eigen uses (within 8 float32 ulp, about torch's own float32
GELU error) and is ~15x faster, which matters for BERT-sized feed-forward layers.
``gelu_tanh`` is the tanh approximation (GPT-2; torch's ``approximate="tanh"``).
``silu`` is ``x * sigmoid(x)`` (SwiGLU's gate in Llama, Mistral, Qwen2), with the sigmoid written as
``(1 + tanh(x / 2)) / 2`` so that it never overflows.
``relu2`` is ``relu(x) ** 2`` (squared ReLU: Nemotron-H's MLP), derivative ``2 relu(x)``.
"""
from __future__ import annotations

import numpy as np

from . import _threads

__all__ = ["ACTIVATIONS", "activation_forward", "activation_backward", "erf"]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "relu2")

# Cody's coefficients: erf on |x| < 0.5, erfc on 0.5 <= |x| < 4, and the asymptotic erfc beyond.
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03,
      1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01, 2.98635138197400131e02,
      8.81952221241769090e02, 1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03,
      2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02, 1.62138957456669019e03,
      3.29079923573345963e03, 4.36261909014324716e03, 3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2,
      6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1, 6.05183413124413191e-2,
      2.33520497626869185e-3)
_SQRPI = 5.6418958354775628695e-1  # 1 / sqrt(pi)


def erf(x: np.ndarray) -> np.ndarray:
    """Error function, elementwise, in float64 (relative error near machine epsilon)."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    out = np.empty_like(x)
    small = ax < 0.5
    mid = (ax >= 0.5) & (ax < 4.0)
    big = (ax >= 4.0) & (ax < 27.0)
    out[ax >= 27.0] = np.sign(x[ax >= 27.0])  # erfc underflows below float64's smallest normal
    out[np.isnan(x)] = np.nan
    if small.any():
        xs = x[small]
        z = xs * xs
        num = _A[4] * z
        den = z
        for i in range(3):
            num = (num + _A[i]) * z
            den = (den + _B[i]) * z
        out[small] = xs * (num + _A[3]) / (den + _B[3])
    if mid.any():
        y = ax[mid]
        num = _C[8] * y
        den = y
        for i in range(7):
            num = (num + _C[i]) * y
            den = (den + _D[i]) * y
        erfc = (num + _C[7]) / (den + _D[7]) * _exp_minus_square(y)
        out[mid] = np.sign(x[mid]) * (1.0 - erfc)
    if big.any():
        y = ax[big]
        z = 1.0 / (y * y)
        num = _P[5] * z
        den = z
        for i in range(4):
            num = (num + _P[i]) * z
            den = (den + _Q[i]) * z
        r = z * (num + _P[4]) / (den + _Q[4])
        erfc = (_SQRPI - r) / y * _exp_minus_square(y)
        out[big] = np.sign(x[big]) * (1.0 - erfc)
    return out


def _exp_minus_square(y: np.ndarray) -> np.ndarray:
    """``exp(-y*y)`` split as Cody does, so the rounding of ``y*y`` does not cost relative accuracy."""
    ysq = np.trunc(y * 16.0) / 16.0
    delta = (y - ysq) * (y + ysq)
    return np.exp(-ysq * ysq) * np.exp(-delta)


_SQRT_2_OVER_PI = 0.7978845608028654


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` in ``x``'s dtype, in three in-place passes (SiLU's cost in a prefill).

    For ``x`` below about -88 (float32) ``exp(-x)`` overflows to inf and the result is 0, the correctly
    rounded limit; the overflow is expected, so it is not reported.
    """
    out = np.negative(x)
    with np.errstate(over="ignore"):
        if not isinstance(out, np.ndarray):  # a NumPy scalar has no buffer to work in
            return 1 / (1 + np.exp(out))
        np.exp(out, out=out)
    out += 1
    return np.reciprocal(out, out=out)


def _gelu_tanh_inner(pre: np.ndarray) -> np.ndarray:
    """``sqrt(2 / pi) * (x + 0.044715 x^3)``, the cube as two products: ``pre**3`` on a float array goes
    through NumPy's general ``power`` (about 70x slower than ``pre * pre * pre`` on float32)."""
    inner = pre * pre  # (...) like pre
    inner *= pre
    inner *= 0.044715
    inner += pre
    inner *= _SQRT_2_OVER_PI
    return inner


def activation_forward(pre: np.ndarray, name: str) -> np.ndarray:
    """Apply activation ``name`` to ``pre`` (result in ``pre``'s dtype)."""
    if name == "relu":
        return np.maximum(pre, 0)
    if name == "gelu":
        if pre.dtype == np.float32:
            return _gelu_float32(pre)
        cdf = 0.5 * (1.0 + erf(pre * 0.7071067811865476))
        return (pre * cdf).astype(pre.dtype, copy=False)
    if name == "gelu_tanh":
        return 0.5 * pre * (1.0 + np.tanh(_gelu_tanh_inner(pre)))
    if name == "silu":
        return pre * _sigmoid(pre)
    if name == "relu2":
        positive = np.maximum(pre, 0)
        return positive * positive
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def activation_backward(grad: np.ndarray, pre: np.ndarray, post: np.ndarray, name: str) -> np.ndarray:
    """Gradient of the activation's input given the gradient of its output."""
    if name == "relu":
        return grad * (pre > 0)
    if name == "gelu" and pre.dtype == np.float32 and grad.dtype == np.float32 and grad.shape == pre.shape:
        return _gelu_backward_float32(grad, pre)
    if name == "gelu" and pre.dtype == np.float32:
        cdf = np.float32(0.5) * (np.float32(1.0) + _erf_float32(pre * np.float32(0.7071067811865476)))
        pdf = np.exp(np.float32(-0.5) * pre * pre) * np.float32(0.3989422804014327)
        return grad * (cdf + pre * pdf)
    if name == "gelu":
        x = pre.astype(np.float64, copy=False)
        cdf = 0.5 * (1.0 + erf(x * 0.7071067811865476))
        pdf = np.exp(-0.5 * x * x) * 0.3989422804014327
        return (grad * (cdf + x * pdf)).astype(grad.dtype, copy=False)
    if name == "gelu_tanh":
        t = np.tanh(_gelu_tanh_inner(pre))
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * pre * pre)
        return grad * (0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t * t) * d_inner)
    if name == "silu":
        s = _sigmoid(pre)
        return grad * (s * (1.0 + pre * (1.0 - s)))
    if name == "relu2":
        return grad * (2 * np.maximum(pre, 0))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


_ALPHA32 = np.array([-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                     -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02], dtype=np.float32)
_BETA32 = np.array([-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                    -1.42647390514189e-02], dtype=np.float32)


# Float32 GELU in chunks of this many elements (256 KiB): the ~20 elementwise passes of the erf polynomial
# then run on cache-resident temporaries (instead of 20 sweeps over, e.g., a 16 MiB BERT hidden layer plus
# fresh page-faulting temporaries), and the chunks are spread over the kernels' thread pool (ufuncs release
# the GIL), as torch's GELU uses every intra-op thread. Measured on (32, 80, 1536): 27.6 ms one-shot,
# 11.1 ms chunked on one thread, 7.3 ms on two; 16K-element chunks lose to GIL hand-offs on two threads.
_GELU_CHUNK = 65536


def _gelu_float32(pre: np.ndarray) -> np.ndarray:
    """``pre * 0.5 * (1 + erf(pre / sqrt(2)))`` in float32, chunked and threaded.

    Bit-for-bit the same as the one-shot expression: the same float32 operations in the same order.
    """
    out = np.empty(pre.shape, dtype=pre.dtype)  # C order, like flat_in
    flat_in = pre.reshape(-1) if pre.flags.c_contiguous else np.ascontiguousarray(pre).reshape(-1)
    flat_out = out.reshape(-1)
    n = flat_in.size
    starts = list(range(0, n, _GELU_CHUNK))

    def work(start: int, _worker: int) -> None:
        x = flat_in[start:start + _GELU_CHUNK]
        y = flat_out[start:start + _GELU_CHUNK]
        e = _erf_float32(x * np.float32(0.7071067811865476))
        e += np.float32(1.0)
        e *= np.float32(0.5)
        np.multiply(x, e, out=y)

    if len(starts) <= 1:
        work(0, 0)
    else:
        _threads.run_tasks(starts, work, _threads.default_num_threads())
    return out


def _gelu_backward_float32(grad: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """``grad * (Phi(pre) + pre * phi(pre))`` in float32, chunked and threaded like :func:`_gelu_float32`.

    Bit-for-bit the same as the one-shot expression in :func:`activation_backward`.
    """
    out = np.empty(pre.shape, dtype=np.float32)
    flat_pre = np.ascontiguousarray(pre).reshape(-1)
    flat_grad = np.ascontiguousarray(grad).reshape(-1)
    flat_out = out.reshape(-1)
    starts = list(range(0, flat_pre.size, _GELU_CHUNK))

    def work(start: int, _worker: int) -> None:
        x = flat_pre[start:start + _GELU_CHUNK]
        cdf = _erf_float32(x * np.float32(0.7071067811865476))
        cdf += np.float32(1.0)
        cdf *= np.float32(0.5)
        pdf = np.float32(-0.5) * x
        pdf *= x
        np.exp(pdf, out=pdf)
        pdf *= np.float32(0.3989422804014327)
        pdf *= x
        cdf += pdf
        np.multiply(flat_grad[start:start + _GELU_CHUNK], cdf, out=flat_out[start:start + _GELU_CHUNK])

    if len(starts) <= 1:
        work(0, 0)
    else:
        _threads.run_tasks(starts, work, _threads.default_num_threads())
    return out


def _erf_float32(x):
    """erf in float32, ``x * P(x^2) / Q(x^2)`` on [-4, 4] (Eigen's fast erf; within 8 float32 ulp)."""
    x = np.clip(x, np.float32(-4.0), np.float32(4.0))
    x2 = x * x
    p = x2 * _ALPHA32[0]  # the same roundings as starting from full(alpha0) and multiplying by x2
    p += _ALPHA32[1]
    for c in _ALPHA32[2:]:
        p *= x2
        p += c
    p *= x
    q = x2 * _BETA32[0]
    q += _BETA32[1]
    for c in _BETA32[2:]:
        q *= x2
        q += c
    p /= q
    return p
