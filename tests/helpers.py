"""Shared helpers for the attnkit test suite (importable as ``helpers``: pytest puts ``tests/`` on the path).

Dimension letters: B batch, H heads, Lq/Lk query/key length, D model (or key) features, Dv value features.
Masks are boolean, ``True`` = may attend, broadcast against the scores ``(..., Lq, Lk)``.

Contents:
- ``numerical_gradient`` / ``assert_gradient``: float64 central finite differences and the normwise relative
  error ``|a - n| / max(|a| + |n|, tiny)`` (below 1e-6);
- ``assert_close_rel`` / ``group_scale``: normwise relative agreement with a reference
  (``max|a - r| / max|r|``, or relative to the scale of the whole gradient); the largest discrepancy
  against PyTorch per component and dtype is recorded in ``DISCREPANCIES`` and printed at the end of a run;
- torch conversion helpers and independent torch references (F.scaled_dot_product_attention, and an
  explicit masked-softmax attention that stays finite on fully masked rows);
- mask factories: none, causal, padding, broadcast and random masks with fully masked rows.
"""
from __future__ import annotations

import os

import numpy as np

import torch

FD_EPS = 1e-6
FD_TOL = 1e-6
TINY = 1e-30

# PyTorch agreement thresholds (normwise relative): float64 and float32.
TOL = {np.float64: 1e-10, np.float32: 1e-5}
REL_FLOOR = 1e-3  # magnitude below which an array counts as "zero" for the relative comparison
TORCH_DTYPE = {np.float64: torch.float64, np.float32: torch.float32}

MASK_KINDS = ("none", "causal", "padding", "fully_masked")


# --------------------------------------------------------------------------------------------------------
# Random numbers
# --------------------------------------------------------------------------------------------------------
def make_rng(*seed: int) -> np.random.Generator:
    """A generator seeded from any tuple of integers (e.g. the parameters of a grid point)."""
    return np.random.default_rng(list(seed) if seed else 0)


def randn(rng: np.random.Generator, *shape: int, dtype=np.float64, scale: float = 1.0) -> np.ndarray:
    """Standard normal array of ``shape`` in ``dtype``."""
    return (scale * rng.standard_normal(shape)).astype(dtype)


# --------------------------------------------------------------------------------------------------------
# Finite differences
# --------------------------------------------------------------------------------------------------------
def numerical_gradient(f, x: np.ndarray, eps: float = FD_EPS) -> np.ndarray:
    """Central finite-difference gradient of the scalar ``f()`` with respect to ``x`` (perturbed in place).

    ``x`` must be a float64 array that ``f`` reads (a view, such as a fused parameter, is probed in place too);
    it is restored exactly after each probe.
    """
    assert x.dtype == np.float64, "finite differences are run in float64 only"
    grad = np.zeros(x.shape)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        f_plus = float(f())
        x[i] = old - eps
        f_minus = float(f())
        x[i] = old
        grad[i] = (f_plus - f_minus) / (2.0 * eps)
    return grad


def relative_error(analytic: np.ndarray, numeric: np.ndarray) -> float:
    """Normwise relative error ``|a - n| / max(|a| + |n|, tiny)`` (Frobenius norms)."""
    analytic = np.asarray(analytic, dtype=np.float64)
    numeric = np.asarray(numeric, dtype=np.float64)
    num = np.linalg.norm((analytic - numeric).ravel())
    den = max(np.linalg.norm(analytic.ravel()) + np.linalg.norm(numeric.ravel()), TINY)
    return float(num / den)


def assert_gradient(f, x: np.ndarray, analytic: np.ndarray, name: str, tol: float = FD_TOL) -> None:
    """Assert ``analytic`` matches the finite-difference gradient of ``f`` w.r.t. ``x`` (float64)."""
    assert analytic.shape == x.shape, f"grad of {name} has shape {analytic.shape}, expected {x.shape}"
    assert np.all(np.isfinite(analytic)), f"grad of {name} is not finite"
    numeric = numerical_gradient(f, x)
    err = relative_error(analytic, numeric)
    assert err < tol, f"grad of {name}: relative error {err:.3e} >= {tol:.0e}"


# --------------------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------------------
def max_rel_diff(actual, desired) -> float:
    """``max|actual - desired| / max|desired|`` in float64 (0 for empty arrays)."""
    a = np.asarray(actual, dtype=np.float64)
    d = np.asarray(desired, dtype=np.float64)
    if d.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(d))), 1e-300)
    return float(np.max(np.abs(a - d)) / scale)


def group_scale(*arrays) -> float:
    """The largest magnitude over several reference arrays: the natural scale of a whole gradient.

    Some gradient blocks are exactly zero in exact arithmetic (grad_K and grad_W_Q with a single key,
    grad_x of a one-feature layer norm), where both libraries return rounding noise; such blocks are
    compared relative to the magnitude of the full gradient instead of their own.
    """
    return max((float(np.max(np.abs(a))) for a in arrays if np.size(a)), default=0.0)


def assert_close_rel(actual, desired, dtype, what: str = "", scale: float | None = None) -> float:
    """Assert normwise relative agreement at the PyTorch tolerance for ``dtype``; returns the discrepancy.

    Elementwise relative error is meaningless for entries that cancel to ~0, so the error is measured
    relative to the largest magnitude of the reference array, or to ``scale`` if that is larger (see
    :func:`group_scale`), floored at ``REL_FLOOR``.
    """
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape, f"{what}: shape {actual.shape} != reference {desired.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    tol = TOL[np.dtype(dtype).type]
    own = float(np.max(np.abs(desired))) if desired.size else 0.0
    scale = max(own, REL_FLOOR if scale is None else scale, REL_FLOOR)
    a64, d64 = actual.astype(np.float64), desired.astype(np.float64)
    rel = float(np.max(np.abs(a64 - d64)) / scale) if desired.size else 0.0
    _record_discrepancy(np.dtype(dtype).name, rel)
    np.testing.assert_allclose(a64, d64, rtol=0, atol=tol * scale, err_msg=what)
    return rel


# Largest relative discrepancy against PyTorch per (component, dtype), printed at the end of the run.
DISCREPANCIES: dict[tuple[str, str], float] = {}
_COMPONENTS = (("sdpa", "sdpa"), ("multi_head", "multi-head attention"), ("layer_norm", "layer_norm"),
               ("encoder_block", "encoder block"))


def _record_discrepancy(dtype_name: str, rel: float) -> None:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    if "test_torch_parity" not in current and "test_fuzz" not in current:
        return
    test_name = current.split("::")[-1]
    for key, label in _COMPONENTS:
        if key in test_name:
            DISCREPANCIES[(label, dtype_name)] = max(DISCREPANCIES.get((label, dtype_name), 0.0), rel)
            return


# --------------------------------------------------------------------------------------------------------
# Torch conversion
# --------------------------------------------------------------------------------------------------------
def to_torch(x, requires_grad: bool = False) -> torch.Tensor:
    """Copy a numpy array into a CPU tensor of the same dtype."""
    t = torch.from_numpy(np.array(x, copy=True))
    return t.requires_grad_(requires_grad)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Detach a tensor into a numpy array."""
    return t.detach().cpu().numpy()


def torch_bool_mask_for_sdpa(mask: np.ndarray | None) -> torch.Tensor | None:
    """F.scaled_dot_product_attention: bool ``attn_mask`` True = may attend, the same as ours."""
    return None if mask is None else torch.from_numpy(np.array(mask, dtype=bool))


def torch_bool_mask_for_mha(mask: np.ndarray | None, B: int, H: int, Lq: int, Lk: int) -> torch.Tensor | None:
    """nn.MultiheadAttention / TransformerEncoderLayer: bool mask True = NOT allowed, so invert ours.

    Our mask broadcasts against (B, H, Lq, Lk); torch wants (Lq, Lk) or (B * H, Lq, Lk).
    """
    if mask is None:
        return None
    full = np.broadcast_to(mask, (B, H, Lq, Lk)).reshape(B * H, Lq, Lk)
    return torch.from_numpy(~full)


def torch_sdpa(Q, K, V, mask, grad_out):
    """Reference: torch.nn.functional.scaled_dot_product_attention forward and backward.

    Returns numpy ``(out, dQ, dK, dV)``.
    """
    q, k, v = to_torch(Q, True), to_torch(K, True), to_torch(V, True)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch_bool_mask_for_sdpa(mask))
    out.backward(to_torch(grad_out))
    return to_numpy(out), to_numpy(q.grad), to_numpy(k.grad), to_numpy(v.grad)


def torch_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: np.ndarray | None):
    """Explicit torch attention with our fully-masked-row semantics (zero weights), differentiable.

    Rows with no allowed key are softmaxed without a mask and then multiplied by 0, so no NaN ever
    appears in the forward or the backward. Returns ``(out, weights)``.
    """
    scores = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])  # (..., Lq, Lk)
    if mask is None:
        w = torch.softmax(scores, dim=-1)
        return w @ v, w
    m = torch.from_numpy(np.broadcast_to(mask, tuple(scores.shape)).copy())  # (..., Lq, Lk)
    alive = m.any(dim=-1, keepdim=True)  # (..., Lq, 1)
    safe = m | ~alive
    w = torch.softmax(scores.masked_fill(~safe, float("-inf")), dim=-1) * alive.to(scores.dtype)
    return w @ v, w


# --------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------
def causal_mask(Lq: int, Lk: int) -> np.ndarray:
    """Top-left aligned causal mask (Lq, Lk): query i may attend keys j <= i (never a fully masked row)."""
    return np.tril(np.ones((Lq, Lk), dtype=bool))


def padding_mask(rng: np.random.Generator, B: int, Lk: int, n_lead: int) -> np.ndarray:
    """Padding mask of random lengths in [1, Lk], reshaped to (B, 1, ..., 1, Lk) for ``n_lead`` leading dims.

    ``n_lead`` counts the leading (batch-like) dims of the scores, e.g. 2 for (B, H, Lq, Lk).
    """
    lengths = rng.integers(1, Lk + 1, size=B)
    m = np.arange(Lk)[None, :] < lengths[:, None]  # (B, Lk)
    return m.reshape((B,) + (1,) * (n_lead - 1) + (1, Lk))


def random_mask_with_dead_rows(rng: np.random.Generator, shape: tuple[int, ...], p: float = 0.6) -> np.ndarray:
    """Random mask of ``shape`` (..., Lq, Lk) with at least one fully masked query row (if Lq > 1, also a live one)."""
    m = rng.random(shape) < p
    Lq = shape[-2]
    flat = m.reshape(-1, Lq, shape[-1])
    for b in range(flat.shape[0]):
        dead = rng.integers(0, Lq)
        flat[b, dead, :] = False
        if Lq > 1:
            live = (dead + 1 + rng.integers(0, Lq - 1)) % Lq
            flat[b, live, rng.integers(0, shape[-1])] = True
    return flat.reshape(shape)


def broadcast_mask(rng: np.random.Generator, Lq: int, Lk: int) -> np.ndarray:
    """A (Lq, Lk) mask shared by every batch/head, each row allowing at least one key."""
    m = rng.random((Lq, Lk)) < 0.5
    m[np.arange(Lq), rng.integers(0, Lk, size=Lq)] = True
    return m


def make_mask(kind: str, rng: np.random.Generator, lead: tuple[int, ...], Lq: int, Lk: int) -> np.ndarray | None:
    """Mask factory for scores of shape ``lead + (Lq, Lk)``.

    kinds: none, causal, padding, broadcast, fully_masked (random, with fully masked rows).
    """
    if kind == "none":
        return None
    if kind == "causal":
        return causal_mask(Lq, Lk)
    if kind == "padding":
        if not lead:
            return np.arange(Lk) < rng.integers(1, Lk + 1)
        return padding_mask(rng, lead[0], Lk, len(lead))
    if kind == "broadcast":
        return broadcast_mask(rng, Lq, Lk)
    if kind == "fully_masked":
        # Vary the head dim only if there is one, so that heads differ.
        return random_mask_with_dead_rows(rng, lead + (Lq, Lk))
    raise ValueError(f"unknown mask kind {kind!r}")


def dead_rows(mask: np.ndarray | None, score_shape: tuple[int, ...]) -> np.ndarray:
    """Boolean (..., Lq) array: the query rows whose mask allows no key (all False if mask is None)."""
    if mask is None:
        return np.zeros(score_shape[:-1], dtype=bool)
    return ~np.broadcast_to(mask, score_shape).any(axis=-1)
