"""``PhysicsGuidedAttention``: a "PINN-guided" head, a physics prior added to the attention scores.

``scores[..., i, j] = scale * q_i . k_j + strength * prior(x_i, x_j)``, where ``x`` are positions or
user-supplied coordinates and ``strength`` (scalar or per head) is learned. The prior is a score modifier
(:class:`attnkit.flex.ScoreMod`), evaluated tile by tile from the query and key indices, so the head runs
through :func:`attnkit.flex.flex_attention` like every other.

Dimension letters: B batch, H heads, Lq/Lk query/key length, Tq/Tk the query/key positions of one tile,
N the number of points of a coordinate grid, d the dimension of a point, S = 1 or H strengths.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._validation import as_float_array, check_finite, check_positive_int
from ..flex.modifiers import ScoreMod
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["PhysicsGuidedAttention", "PhysicsPriorBias"]

_BUILTIN = ("distance_decay", "gaussian")
# d(prior)/d(log length_scale) = -_DLOG[prior] * prior: the prior is proportional to l^-1 or l^-2.
_DLOG = {"distance_decay": 1.0, "gaussian": 2.0}


class PhysicsPriorBias(ScoreMod):
    """Score modifier ``score + strength[h] * prior(x_i, x_j)``.

    Parameters
    ----------
    prior : {"distance_decay", "gaussian"} or callable
        ``"distance_decay"``: ``-|x_i - x_j| / l``; ``"gaussian"``: ``-|x_i - x_j|^2 / (2 l^2)`` (Euclidean
        norm for points); a callable ``f(xq (Tq,) or (Tq, d), xk (Tk,) or (Tk, d)) -> (Tq, Tk)``.
    strength : ndarray, shape (S,)
        S = 1 (shared) or H (per head); used as given (``params["strength"]``).
    length_scale : float
        l, for the built-in priors.
    coordinates : None, ndarray (N,) / (N, d), or pair of ndarrays
        None: ``x`` is the position, query i at ``i + offset``; one array: the coordinates of key positions
        0..N-1, query i taking those of position ``i + offset``; a pair ``(xq (Lq, ...), xk (Lk, ...))``:
        query i at ``xq[i]``, key j at ``xk[j]``.
    offset : int, default 0
        Query i sits at key position ``i + offset`` (``Lk - Lq``: bottom-right aligned, as the heads pass).
    grad_strength : ndarray (S,), optional
        The array the strength's gradient is added into (default: new zeros).
    grad_log_length_scale : ndarray (1,), optional
        With it, ``log(l)`` is a parameter too and its gradient is added into this array (built-in priors).

    Shapes
    ------
    score, grad : (B, H, Tq, Tk); the prior (S, Tq, Tk) broadcasts over the batch (and the heads when S = 1).

    Examples
    --------
    >>> bias = PhysicsPriorBias("distance_decay", np.array([2.0]), length_scale=4.0, offset=1)
    >>> bias(np.zeros((1, 1, 2, 3)), 0, 0, np.arange(2)[:, None], np.arange(3)[None])[0, 0]  # queries at 1, 2
    array([[-0.5, -0. , -0.5],
           [-1. , -0.5, -0. ]])
    """

    def __init__(self, prior: str | Callable, strength: np.ndarray, length_scale: float = 1.0,
                 coordinates: Any = None, *, offset: int = 0, grad_strength: np.ndarray | None = None,
                 grad_log_length_scale: np.ndarray | None = None) -> None:
        super().__init__()
        self.prior, self.length_scale = prior, float(length_scale)
        self.coordinates, self.offset = coordinates, int(offset)
        self._add_param("strength", strength, grad_strength)
        if grad_log_length_scale is not None:
            self._add_param("log_length_scale", np.full(1, np.log(self.length_scale)), grad_log_length_scale)

    def points(self, q_idx: Any, k_idx: Any) -> tuple[np.ndarray, np.ndarray]:
        """Coordinates of the tile's queries (Tq,) / (Tq, d) and keys (Tk,) / (Tk, d)."""
        q_idx, k_idx = np.ravel(q_idx).astype(np.int64), np.ravel(k_idx).astype(np.int64)
        q_pos = q_idx + self.offset  # (Tq,)
        if self.coordinates is None:
            return q_pos.astype(np.float64), k_idx.astype(np.float64)
        if isinstance(self.coordinates, tuple):
            xq, xk = self.coordinates
            return xq[q_idx], xk[k_idx]  # (Tq, ...), (Tk, ...)
        return self.coordinates[q_pos], self.coordinates[k_idx]  # (Tq, ...), (Tk, ...)

    def prior_tile(self, q_idx: Any, k_idx: Any) -> np.ndarray:
        """The prior without strength: (Tq, Tk) float64."""
        xq, xk = self.points(q_idx, k_idx)
        if callable(self.prior):
            values = as_float_array(self.prior(xq, xk), "prior(q_pos, k_pos)")
            if values.shape != (xq.shape[0], xk.shape[0]):
                raise ValueError(f"prior(q_pos, k_pos) returned shape {values.shape}, expected (Tq, Tk) = "
                                 f"{(xq.shape[0], xk.shape[0])} for q_pos {xq.shape}, k_pos {xk.shape}")
            return values.astype(np.float64, copy=False)
        diff = xq[:, None] - xk[None, :]  # (Tq, Tk) or (Tq, Tk, d)
        sq = diff * diff if diff.ndim == 2 else (diff * diff).sum(axis=-1)  # (Tq, Tk)
        if self.prior == "gaussian":
            return -sq / (2.0 * self.length_scale**2)
        return -(np.abs(diff) if diff.ndim == 2 else np.sqrt(sq)) / self.length_scale  # (Tq, Tk)

    def check_shape(self, shape):
        if self.params["strength"].shape[0] not in (1, shape[1]):
            raise ValueError(f"PhysicsPriorBias: {self.params['strength'].shape[0]} strengths for scores of "
                             f"{shape[1]} heads (shape {tuple(shape)})")

    def forward(self, score, b, h, q_idx, kv_idx):
        strength = self.params["strength"].astype(score.dtype, copy=False)  # (S,)
        tile = strength[:, None, None] * self.prior_tile(q_idx, kv_idx)  # (S, Tq, Tk)
        return score + tile.astype(score.dtype, copy=False)  # (B, H, Tq, Tk)

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        prior = self.prior_tile(q_idx, kv_idx)  # (Tq, Tk)
        per_head = np.einsum("bhqk,qk->h", grad, prior)  # (H,)
        g_s = per_head.reshape(self.params["strength"].shape[0], -1).sum(axis=1)  # (S,): a shared strength sums
        self.grads["strength"] += g_s
        if "log_length_scale" in self.grads:
            self.grads["log_length_scale"] -= _DLOG[self.prior] * float(np.dot(self.params["strength"], g_s))
        return grad


class PhysicsGuidedAttention(ScaledDotProductAttention):
    """Scaled dot-product attention plus a learnable-strength physics prior over positions or coordinates.

    ``weights = softmax(scale * q k^T + strength * prior(x_i, x_j))``: a positive ``strength`` with a
    distance-decay prior favours nearby points, as a PINN-style inductive bias (locality, diffusion
    kernels); training may strengthen, weaken or flip it.

    Parameters
    ----------
    prior : {"distance_decay", "gaussian"} or callable, default "distance_decay"
        ``"distance_decay"``: ``-|x_i - x_j| / length_scale``. ``"gaussian"``: ``-|x_i - x_j|^2 /
        (2 length_scale^2)``. For points (rows of a (N, d) array) ``|.|`` is the Euclidean norm. A callable
        ``f(q_pos, k_pos) -> (Tq, Tk)`` gets the coordinates of a tile's queries ((Tq,) or (Tq, d)) and keys
        and must be a pure function of them (it is evaluated again in backward); ``length_scale`` is unused.
    strength_init : float or array of shape (H,), default 1.0
        Initial strength.
    length_scale : float, default 1.0
        l > 0 of the built-in priors.
    coordinates : None, array (N,) / (N, d), or a pair of arrays, optional
        Where the tokens are. ``None``: at their positions, query i at ``i + Lk - Lq`` (bottom-right
        aligned, like the causal mask). One array: coordinates of positions 0..N-1 shared by queries and
        keys (N >= Lk >= Lq; query i again at position ``i + Lk - Lq``). A pair ``(q_coords, k_coords)`` of
        shapes (Lq,) / (Lq, d) and (Lk,) / (Lk, d): separate point sets (cross-attention). Can be changed
        later with :meth:`set_coordinates`.
    dropout : float, default 0.0
        Dropout on the weights after the softmax, training mode only (inverted scaling).
    scale : float, optional
        Score multiplier; default ``1 / sqrt(Dk)``.
    seed : int, optional
        Seed of the dropout stream.
    num_heads : int, optional
        Give H for one strength per head (the inputs must then have H at axis -3); default one shared.
    learn_length_scale : bool, default False
        Also learn the length scale, as the parameter ``log_length_scale`` (keeps l positive).

    Attributes
    ----------
    strength : (1,) or (H,); log_length_scale : (1,) when learned. Gradients in ``grads`` by name.

    Shapes
    ------
    q : (..., Lq, Dk), k : (..., Lk, Dk), v : (..., Lk, Dv) ((B, H, L, Dh) under ``MultiHeadAttention``).
        With ``num_heads`` set, axis -3 is the head axis (a 3-D input is read as (H, L, D)).
    mask : bool broadcastable to (..., Lq, Lk), ``True`` = may attend; ``is_causal`` ANDs the causal mask.
    output : (..., Lq, Dv), weights : (..., Lq, Lk) (before dropout), in the inputs' dtype.

    Examples
    --------
    >>> head = PhysicsGuidedAttention("gaussian", strength_init=2.0, length_scale=3.0)
    >>> x = np.random.default_rng(0).normal(size=(2, 6, 4))
    >>> out, w = head(x, x, x)
    >>> _ = head.backward(np.ones_like(out))
    >>> out.shape, head.grads["strength"].shape
    ((2, 6, 4), (1,))

    Points in the plane, one strength per head, inside ``MultiHeadAttention``:

    >>> from attnkit.attention import MultiHeadAttention
    >>> pts = np.random.default_rng(1).uniform(size=(6, 2))  # (N, d)
    >>> head = PhysicsGuidedAttention(coordinates=pts, length_scale=0.5, num_heads=2)
    >>> out, w = MultiHeadAttention(4, 2, attention=head, rng=0)(x, x, x)
    >>> w.shape
    (2, 2, 6, 6)
    """

    def __init__(self, prior: str | Callable = "distance_decay", strength_init: Any = 1.0, length_scale: float = 1.0,
                 coordinates: Any = None, dropout: float = 0.0, scale: float | None = None,
                 seed: int | None = None, *, num_heads: int | None = None, learn_length_scale: bool = False) -> None:
        super().__init__(dropout=dropout, scale=scale, is_causal=False, seed=seed)
        if not callable(prior) and prior not in _BUILTIN:
            raise ValueError(f"prior must be one of {_BUILTIN} or a callable f(q_pos, k_pos), got {prior!r}")
        self.prior = prior
        if isinstance(length_scale, (bool, np.bool_)) or not isinstance(length_scale, (int, float, np.number)) \
                or not np.isfinite(length_scale) or length_scale <= 0:
            raise ValueError(f"length_scale must be a positive finite number, got {length_scale!r}")
        if learn_length_scale and callable(prior):
            raise ValueError("learn_length_scale needs a built-in prior: a callable prior has no length scale")
        self.num_heads = None if num_heads is None else check_positive_int(num_heads, "num_heads")
        n = 1 if self.num_heads is None else self.num_heads
        strength = as_float_array(strength_init, "strength_init")
        if strength.ndim > 1 or strength.size not in (1, n):
            raise ValueError(f"strength_init must be a number or an array of shape ({n},) (num_heads="
                             f"{self.num_heads}), got shape {strength.shape}")
        check_finite(strength, "strength_init")
        self.register_parameter("strength", np.broadcast_to(strength.reshape(-1), (n,)))
        self._fixed_length_scale = float(length_scale)
        if learn_length_scale:
            self.register_parameter("log_length_scale", np.full(1, np.log(float(length_scale))))
        self.coordinates = None
        self.set_coordinates(coordinates)

    @property
    def length_scale(self) -> float:
        """Current length scale l (``exp(log_length_scale)`` when learned)."""
        if "log_length_scale" in self._parameters:
            return float(np.exp(self._parameters["log_length_scale"][0]))
        return self._fixed_length_scale

    def set_coordinates(self, coordinates: Any) -> None:
        """Set the token coordinates: ``None``, one array (N,) / (N, d), or a pair ``(q_coords, k_coords)``."""
        if coordinates is None:
            self.coordinates = None
            return
        pair = isinstance(coordinates, (tuple, list)) and len(coordinates) == 2 and \
            not np.isscalar(coordinates[0]) and np.ndim(coordinates[0]) >= 1
        arrays = [as_float_array(c, "coordinates").copy() for c in (coordinates if pair else (coordinates,))]
        for a in arrays:
            if a.ndim not in (1, 2) or a.shape[0] == 0:
                raise ValueError(f"coordinates must be arrays of shape (N,) or (N, d), got shape {a.shape}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"coordinates must be finite (shape {a.shape})")
        if pair and arrays[0].shape[1:] != arrays[1].shape[1:]:
            raise ValueError(f"query and key coordinates must have the same point dimension, got shapes "
                             f"{arrays[0].shape} and {arrays[1].shape}")
        self.coordinates = tuple(arrays) if pair else arrays[0]

    def extra_repr(self) -> str:
        prior = getattr(self.prior, "__name__", repr(self.prior))
        return (f"prior={prior}, length_scale={self.length_scale}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, scale={self.scale}")

    def score_mod_for(self, seq_q: int, seq_k: int) -> PhysicsPriorBias:
        """The prior for Lq queries after Lk keys (bottom-right aligned) as a :class:`PhysicsPriorBias` on the
        current parameters, adding its gradients into ``grads``."""
        return PhysicsPriorBias(self.prior, self._parameters["strength"], length_scale=self.length_scale,
                                coordinates=self.coordinates, offset=seq_k - seq_q,
                                grad_strength=self.grads["strength"],
                                grad_log_length_scale=self.grads["log_length_scale"] if "log_length_scale" in
                                self._parameters else None)

    def _check_coordinates(self, seq_q: int, seq_k: int) -> None:
        c = self.coordinates
        if c is None:
            return
        if isinstance(c, tuple):
            if c[0].shape[0] != seq_q or c[1].shape[0] != seq_k:
                raise ValueError(f"coordinates: the pair has {c[0].shape[0]} query and {c[1].shape[0]} key points "
                                 f"but the inputs have seq_q = {seq_q}, seq_k = {seq_k}")
        elif c.shape[0] < seq_k:
            raise ValueError(f"coordinates has {c.shape[0]} points (shape {c.shape}) but the keys have "
                             f"seq_k = {seq_k} positions")
        elif seq_q > seq_k:
            raise ValueError(f"coordinates: with one array the queries sit at key positions i + seq_k - seq_q, "
                             f"negative for seq_q = {seq_q} > seq_k = {seq_k}; give a pair (q_coords, k_coords)")

    def forward(self, q: Any, k: Any, v: Any, mask: Any = None, *, is_causal: bool = False,
                need_weights: bool = True):
        """Attend with the prior; returns ``(output (..., Lq, Dv), weights (..., Lq, Lk) or None)``."""
        q, k, v, lead, mask = self._check_inputs(q, k, v, mask)
        if self.num_heads is not None and (not lead or lead[-1] != self.num_heads):
            raise ValueError(f"PhysicsGuidedAttention has num_heads = {self.num_heads} strengths but the inputs "
                             f"have {lead[-1] if lead else 'no'} heads at axis -3 (q: {q.shape}); expected "
                             f"(..., {self.num_heads}, L, D)")
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        self._check_coordinates(seq_q, seq_k)
        return self._attend(q, k, v, mask, is_causal, self.score_mod_for(seq_q, seq_k), need_weights)

    def backward(self, grad_output: Any):
        """Return ``(grad_q, grad_k, grad_v)`` and add the gradients of ``strength`` (and ``log_length_scale``)."""
        return super().backward(grad_output)
