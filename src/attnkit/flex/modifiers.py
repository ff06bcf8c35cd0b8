"""Score modifiers: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` with an exact backward.

The index arguments are broadcastable integer arrays (``b`` of shape (B, 1, 1, 1), ``h`` (1, H, 1, 1),
``q_idx`` (1, 1, Tq, 1), ``kv_idx`` (1, 1, 1, Tk), Tq/Tk the positions of the tile being computed), so a
modifier is vectorised NumPy. A :class:`ScoreMod` keeps learnable arrays in ``.params`` and adds their
gradients into ``.grads`` (same keys) on every :meth:`ScoreMod.backward`; the caller zeroes them.

The positional modifiers (:class:`ALiBi`, :class:`RelativePositionBias`) place query i at key position
``i + offset``: ``offset=0`` (the default, as torch's FlexAttention examples) aligns the first query with the first
key; ``offset = Lk - Lq`` aligns the last query with the last key (bottom-right, as the causal mask of new tokens
after a cache), which is what the attention heads pass. They take their parameter arrays as given and can add
their gradients into arrays of the caller's (``grad=``), so a module's parameter and gradient are the modifier's.
"""
from __future__ import annotations

import math

import numpy as np

from .._validation import check_factor, check_positive_int

__all__ = ["ScoreMod", "ALiBi", "RelativePositionBias", "softcap", "alibi", "alibi_slopes", "relative_position_bias",
           "additive_bias", "compose", "t5_relative_position_bucket", "as_score_mod"]


class ScoreMod:
    """Base class of a score modifier with a backward.

    Subclasses implement :meth:`forward` and :meth:`backward`; learnable arrays live in ``self.params`` and
    their gradients in ``self.grads`` (zero-initialised, same shapes, accumulated into).
    """

    def __init__(self):
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    def _add_param(self, name: str, value: np.ndarray, grad: np.ndarray | None = None) -> None:
        """Register ``value`` (not copied) and the array its gradient is added into (default: new zeros)."""
        if grad is not None and np.shape(grad) != np.shape(value):
            raise ValueError(f"{type(self).__name__}: grad for {name!r} has shape {np.shape(grad)}, expected the "
                             f"parameter's {np.shape(value)}")
        self.params[name] = value
        self.grads[name] = np.zeros_like(value) if grad is None else grad

    @property
    def accumulates(self) -> bool:
        """True when :meth:`backward` adds into gradients that every tile shares (the kernels then run the
        backward's tiles on one thread, in a fixed order)."""
        return bool(self.params)

    def zero_grad(self) -> None:
        """Set every gradient in ``.grads`` to zero."""
        for g in self.grads.values():
            g[...] = 0

    def check_shape(self, shape: tuple[int, int, int, int]) -> None:
        """Raise ``ValueError`` if this modifier cannot act on scores of ``shape`` (B, H, Lq, Lk).

        :func:`~attnkit.flex.flex_attention` calls it once before any tile: a modifier sees only tiles, and
        an array of the wrong size indexed by a tile's positions either fails with NumPy's message or,
        worse, reads the wrong entries. The default accepts every shape.
        """

    def forward(self, score, b, h, q_idx, kv_idx):
        """Modified scores, shape of ``score`` (B, H, Tq, Tk)."""
        raise NotImplementedError

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        """Gradient with respect to the input ``score`` given ``grad`` of the output; adds into ``.grads``."""
        raise NotImplementedError

    def __call__(self, score, b, h, q_idx, kv_idx):
        """:meth:`forward` (a score modifier is called as torch's are)."""
        return self.forward(score, b, h, q_idx, kv_idx)


class _Forward(ScoreMod):
    """A plain function used as a score modifier: forward only."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        raise TypeError(f"score_mod {getattr(self.fn, '__name__', self.fn)!r} is a plain function and has no "
                        "backward; subclass attnkit.flex.ScoreMod with forward and backward to train through it")


def as_score_mod(score_mod) -> ScoreMod | None:
    """``score_mod`` as a :class:`ScoreMod` (a plain callable becomes a forward-only one), or ``None``."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if not callable(score_mod):
        raise TypeError(f"score_mod must be a ScoreMod, a callable or None, got {type(score_mod).__name__}")
    return _Forward(score_mod)


class _Softcap(ScoreMod):
    def __init__(self, cap: float):
        super().__init__()
        self.cap = check_factor(cap, "softcap: cap")

    # One new array per call, the rest in place: the kernel calls these on every tile.
    def forward(self, score, b, h, q_idx, kv_idx):
        out = np.asarray(np.divide(score, self.cap))  # an array even for a 0-d score
        np.tanh(out, out=out)
        out *= self.cap
        return out

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        t = np.asarray(np.divide(score, self.cap))
        np.tanh(t, out=t)
        np.multiply(t, t, out=t)
        np.subtract(1, t, out=t)
        t *= grad
        return t


def softcap(cap: float) -> ScoreMod:
    """``cap * tanh(score / cap)`` (Gemma 2, Grok): scores squashed into ``(-cap, cap)``.

    ``cap`` is a number in ``[2**-14, 65504]`` (:func:`attnkit._validation.check_factor`, ``ValueError``
    otherwise): a cap of 1e-320 is 0 in float32 and divides the scores by it, one of 1e308 is inf.

    Examples
    --------
    >>> float(softcap(2.0).forward(np.array(100.0), 0, 0, 0, 0))
    2.0
    """
    return _Softcap(cap)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's head slopes: ``2^(-8 (h + 1) / H)`` for a power-of-two H; the paper's interpolation otherwise.

    For other H, with ``P = 2^floor(log2 H)``: the P slopes of P heads, then every other slope of 2P heads
    (``2^(-4 (2m + 1) / P)``, m = 0, 1, ...) until there are H.

    Returns
    -------
    ndarray of float64, shape (H,)

    Examples
    --------
    >>> alibi_slopes(4)
    array([0.25      , 0.0625    , 0.015625  , 0.00390625])
    >>> alibi_slopes(3)
    array([0.0625    , 0.00390625, 0.25      ])
    """
    num_heads = check_positive_int(num_heads, "num_heads")
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    base = np.exp2(-8.0 / closest * np.arange(1, closest + 1))  # (P,)
    extra = np.exp2(-4.0 / closest * (2 * np.arange(num_heads - closest) + 1))  # (H - P,)
    return np.concatenate([base, extra])  # (H,)


def _offset(offset) -> int:
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    return int(offset)


def _relative(q_idx, kv_idx, offset: int) -> np.ndarray:
    """``kv_idx - (q_idx + offset)``: the key's position relative to the query's, (1, 1, Tq, Tk)."""
    return np.asarray(kv_idx) - (np.asarray(q_idx) + offset)


class ALiBi(ScoreMod):
    """ALiBi: ``score + slopes[h] * (j - i')``, or ``score - slopes[h] * |j - i'|`` when ``bidirectional``.

    ``i' = q_idx + offset`` is the query's key position and ``j = kv_idx``. The one-sided form is the paper's
    (and ``transformers``' Bloom and MPT, up to a constant per row): a penalty growing with the distance to
    earlier keys, meant for use with a causal mask (later keys would get a growing bonus). The slopes are
    learnable, with ALiBi's values from :func:`alibi_slopes`.

    Parameters
    ----------
    slopes : ndarray, shape (H,)
        Used as given (not copied): ``params["slopes"]``.
    bidirectional : bool, default False
        Penalise the distance in both directions (encoders).
    offset : int, default 0
        Query i sits at key position ``i + offset`` (``Lk - Lq``: bottom-right aligned).
    grad : ndarray, shape (H,), optional
        The array the slopes' gradient is added into (default: new zeros), ``grads["slopes"]``.

    Examples
    --------
    >>> mod = ALiBi(np.array([0.5]), offset=1)
    >>> mod(np.zeros((1, 1, 2, 3)), 0, np.zeros((1, 1, 1, 1), int), np.arange(2)[:, None], np.arange(3))[0, 0]
    array([[-0.5,  0. ,  0.5],
           [-1. , -0.5,  0. ]])
    """

    def __init__(self, slopes: np.ndarray, *, bidirectional: bool = False, offset: int = 0,
                 grad: np.ndarray | None = None):
        super().__init__()
        if not isinstance(slopes, np.ndarray) or slopes.ndim != 1 or slopes.dtype.kind != "f":
            got = f"shape {slopes.shape} dtype {slopes.dtype}" if isinstance(slopes, np.ndarray) else \
                type(slopes).__name__
            raise ValueError(f"alibi: slopes must be one float per head, shape (H,), got {got}")
        self.bidirectional, self.offset = bool(bidirectional), _offset(offset)
        self._add_param("slopes", slopes, grad)

    def check_shape(self, shape):
        if self.params["slopes"].shape[0] != shape[1]:
            raise ValueError(f"alibi: {self.params['slopes'].shape[0]} slopes for scores of {shape[1]} heads "
                             f"(shape {tuple(shape)}); give one slope per query head")

    def _distance(self, q_idx, kv_idx) -> np.ndarray:
        """What each slope multiplies: ``j - i'`` or ``-|j - i'|``, (1, 1, Tq, Tk) int."""
        rel = _relative(q_idx, kv_idx, self.offset)
        return -np.abs(rel) if self.bidirectional else rel

    def forward(self, score, b, h, q_idx, kv_idx):
        dist = self._distance(q_idx, kv_idx).astype(score.dtype)  # (1, 1, Tq, Tk)
        return score + self.params["slopes"].astype(score.dtype)[h] * dist  # (B, H, Tq, Tk)

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        dist = np.broadcast_to(self._distance(q_idx, kv_idx), (1, 1, *grad.shape[-2:]))[0, 0]  # (Tq, Tk)
        per_head = np.einsum("bhqk,qk->h", grad, dist.astype(grad.dtype))  # (H,)
        np.add.at(self.grads["slopes"], np.asarray(h).reshape(-1), per_head)
        return grad


def alibi(slopes, *, bidirectional: bool = False, offset: int = 0) -> ScoreMod:
    """ALiBi (:class:`ALiBi`) with learnable slopes, a copy of ``slopes`` (shape (H,)) in float64.

    Use :func:`alibi_slopes` for the paper's values: ``score + slopes[h] * (kv_idx - q_idx)``.
    """
    slopes = np.array(slopes, dtype=np.float64)
    if slopes.ndim != 1:
        raise ValueError(f"alibi: slopes must be one value per head, shape (H,), got shape {slopes.shape}")
    return ALiBi(slopes, bidirectional=bidirectional, offset=offset)


def t5_relative_position_bucket(relative_position: np.ndarray, bidirectional: bool = True,
                                num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """T5's bucket of each relative position ``key_position - query_position``.

    Half of the buckets (per direction when ``bidirectional``) hold the exact distances ``0 .. max_exact - 1``
    (``max_exact = n // 2``, n the buckets per direction); the other half cover distances up to
    ``max_distance`` on a log scale, and every larger distance falls in the last bucket. Bidirectional:
    keys after the query (positive relative position) use buckets ``n .. 2n - 1``. Unidirectional: keys
    after the query share bucket 0 with distance 0. The log is taken in float32, as in Mesh TensorFlow and
    HuggingFace's ``T5Attention._relative_position_bucket``, so that the buckets are the same.

    Parameters
    ----------
    relative_position : ndarray of int, any shape
    bidirectional : bool
    num_buckets : int
    max_distance : int

    Returns
    -------
    ndarray of int64, the shape of ``relative_position``, values in ``[0, num_buckets)``

    Examples
    --------
    >>> t5_relative_position_bucket(np.array([-200, -20, -3, 0, 3, 20, 200]))
    array([15, 10,  3,  0, 19, 26, 31])
    >>> t5_relative_position_bucket(np.array([-200, -20, -3, 0, 3]), bidirectional=False)
    array([31, 17,  3,  0,  0])
    """
    rel = np.asarray(relative_position, dtype=np.int64)
    buckets = np.zeros(rel.shape, dtype=np.int64)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0) * num_buckets
        dist = np.abs(rel)
    else:
        dist = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    is_small = dist < max_exact
    # float32 like the reference; distances below max_exact are replaced by max_exact to keep log() finite.
    ratio = np.maximum(dist, max_exact).astype(np.float32) / np.float32(max_exact)
    log_pos = (np.log(ratio) / np.float32(math.log(max_distance / max_exact))
               * np.float32(num_buckets - max_exact))
    if_large = np.minimum(max_exact + log_pos.astype(np.int64), num_buckets - 1)
    return buckets + np.where(is_small, dist, if_large)



class RelativePositionBias(ScoreMod):
    """T5's relative-position bias: ``score + table[bucket(j - i'), h]``, a learnable (buckets, heads) table.

    ``i' = q_idx + offset`` is the query's key position and ``j = kv_idx``; the bucket is
    :func:`t5_relative_position_bucket`'s. The table has ``transformers``' layout (the weight of T5's
    ``relative_attention_bias`` embedding, ``(num_buckets, num_heads)``).

    Parameters
    ----------
    table : ndarray, shape (NB, H)
        Used as given (not copied): ``params["table"]``.
    max_distance : int, default 128
        Distances from here on share the last bucket.
    bidirectional : bool, default True
        Separate buckets for keys before and after the query (encoders); ``False`` for causal decoders.
    offset : int, default 0
        Query i sits at key position ``i + offset`` (``Lk - Lq``: bottom-right aligned).
    grad : ndarray, shape (NB, H), optional
        The array the table's gradient is added into (default: new zeros), ``grads["table"]``.
    """

    def __init__(self, table: np.ndarray, max_distance: int = 128, bidirectional: bool = True, *, offset: int = 0,
                 grad: np.ndarray | None = None):
        super().__init__()
        if not isinstance(table, np.ndarray) or table.ndim != 2 or table.dtype.kind != "f":
            got = f"shape {table.shape} dtype {table.dtype}" if isinstance(table, np.ndarray) else \
                type(table).__name__
            raise ValueError(f"relative_position_bias: table must be floats of shape (num_buckets, num_heads), "
                             f"got {got}")
        self.num_buckets, self.num_heads = table.shape
        self.max_distance = check_positive_int(max_distance, "max_distance")
        self.bidirectional, self.offset = bool(bidirectional), _offset(offset)
        self._add_param("table", table, grad)

    def check_shape(self, shape):
        if self.num_heads != shape[1]:
            raise ValueError(f"relative_position_bias: a table of {self.num_heads} heads for scores of "
                             f"{shape[1]} heads (shape {tuple(shape)})")

    def _buckets(self, q_idx, kv_idx):
        rel = _relative(q_idx, kv_idx, self.offset)  # (1, 1, Tq, Tk)
        return t5_relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)

    def forward(self, score, b, h, q_idx, kv_idx):
        buckets = self._buckets(q_idx, kv_idx)  # (1, 1, Tq, Tk)
        return score + self.params["table"].astype(score.dtype)[buckets, h]  # (B, H, Tq, Tk)

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        per_head = grad.sum(axis=0)  # (H, Tq, Tk): the bias does not depend on the batch row
        heads = np.asarray(h).reshape(-1)  # (H,)
        flat = self._buckets(q_idx, kv_idx)[0] * self.num_heads + heads[:, None, None]  # (H, Tq, Tk)
        summed = np.bincount(flat.ravel(), weights=per_head.ravel(), minlength=self.num_buckets * self.num_heads)
        self.grads["table"] += summed.reshape(self.num_buckets, self.num_heads)  # (NB, H)
        return grad


def relative_position_bias(num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                           bidirectional: bool = True, *, table=None, seed: int = 0, offset: int = 0) -> ScoreMod:
    """T5's relative-position bias (:class:`RelativePositionBias`) with a table of its own.

    Parameters
    ----------
    num_heads, num_buckets, max_distance, bidirectional
        As in T5 (:func:`t5_relative_position_bucket`).
    table : array, shape (num_buckets, num_heads), optional
        Initial table (copied, in float64); default normal(0, 0.02) from ``seed``.
    offset : int, default 0
        Query i sits at key position ``i + offset``.
    """
    num_heads = check_positive_int(num_heads, "num_heads")
    num_buckets = check_positive_int(num_buckets, "num_buckets")
    if table is None:
        table = np.random.default_rng(seed).normal(0.0, 0.02, size=(num_buckets, num_heads))
    table = np.array(table, dtype=np.float64)
    if table.shape != (num_buckets, num_heads):
        raise ValueError(f"relative_position_bias: table must have shape (num_buckets, num_heads) = "
                         f"{(num_buckets, num_heads)}, got {table.shape}")
    return RelativePositionBias(table, max_distance, bidirectional, offset=offset)


def _index(arr_dim: int, idx):
    return idx if arr_dim > 1 else 0


class _AdditiveBias(ScoreMod):
    def __init__(self, bias):
        super().__init__()
        bias = np.array(bias, dtype=np.float64)
        if bias.ndim > 4:
            raise ValueError(f"additive_bias: the bias must broadcast to (B, H, Lq, Lk), got shape {bias.shape}")
        self._add_param("bias", bias.reshape((1,) * (4 - bias.ndim) + bias.shape))

    def check_shape(self, shape):
        bias = self.params["bias"].shape  # (B|1, H|1, Lq|1, Lk|1) when it fits
        if any(n not in (1, m) for n, m in zip(bias, shape)):
            raise ValueError(f"additive_bias: the bias, of shape {bias} as (B, H, Lq, Lk), does not broadcast "
                             f"to the scores of shape {tuple(shape)}")

    def _where(self, b, h, q_idx, kv_idx):
        shape = self.params["bias"].shape
        return tuple(_index(n, i) for n, i in zip(shape, (b, h, q_idx, kv_idx)))

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.params["bias"].astype(score.dtype)[self._where(b, h, q_idx, kv_idx)]

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        shape = self.params["bias"].shape
        summed = grad.sum(axis=tuple(a for a in range(4) if shape[a] == 1), keepdims=True)
        where = tuple(np.broadcast_to(w, summed.shape) if not isinstance(w, int) else w
                      for w in self._where(b, h, q_idx, kv_idx))
        np.add.at(self.grads["bias"], where, summed)
        return grad


def additive_bias(bias) -> ScoreMod:
    """``score + bias[b, h, q_idx, kv_idx]`` with a learnable ``bias`` broadcastable to (B, H, Lq, Lk).

    Size-1 axes broadcast (their gradient is summed); the array is copied.
    """
    return _AdditiveBias(bias)


class _Compose(ScoreMod):
    def __init__(self, mods):
        super().__init__()
        self.mods = [as_score_mod(m) for m in mods]
        for i, m in enumerate(self.mods):
            for name, value in m.params.items():
                self.params[f"{i}.{name}"] = value
                self.grads[f"{i}.{name}"] = m.grads[name]

    def check_shape(self, shape):
        for m in self.mods:
            m.check_shape(shape)

    def forward(self, score, b, h, q_idx, kv_idx):
        for m in self.mods:
            score = m.forward(score, b, h, q_idx, kv_idx)
        return score

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        inputs = []
        for m in self.mods:
            inputs.append(score)
            score = m.forward(score, b, h, q_idx, kv_idx)
        for m, s in zip(reversed(self.mods), reversed(inputs)):
            grad = m.backward(grad, s, b, h, q_idx, kv_idx)
        return grad


def compose(*mods) -> ScoreMod:
    """Apply ``mods`` in order (``compose(f, g)(s) = g(f(s))``); ``.params``/``.grads`` keyed ``"i.name"``.

    The keys share the arrays of the parts: updating ``compose(...).params`` updates the parts.
    """
    return _Compose(mods)
