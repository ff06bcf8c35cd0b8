"""Integrated gradients on a causal LM's input embeddings, from attnkit's exact backward.

Sundararajan et al.'s attribution of ``f(x) - f(baseline)`` to the input features: ``(x - x') . integral over
alpha in [0, 1] of grad f(x' + alpha (x - x'))``, summed over each token's features. The integral is a
quadrature, so the attributions sum to ``f(x) - f(x')`` only up to its error, the completeness gap, which is
returned (as captum's ``convergence_delta``). It is worth reading: an RMSNorm model is nearly invariant to the
scale of its input, so along the straight path from zero most of the change happens near alpha = 0, and an
even grid misses it (SmolLM2-135M at 64 points: the midpoint rule's sum off by 329%, Gauss-Legendre's by 1.7%).

Shapes: L tokens, D model width, K quadrature points.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import _progress
from .._validation import as_array, check_positive_int
from ._inputs import as_id_batch, check_position
from .hooks import hooks

__all__ = ["IntegratedGradients", "QUADRATURES", "integrated_gradients", "quadrature"]

QUADRATURES = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_left", "riemann_right")


class IntegratedGradients(NamedTuple):
    """``attributions`` (L,) per token; ``completeness_gap`` = ``attributions.sum() - difference``;
    ``difference`` = ``f(input) - f(baseline)``, f the target's log-probability."""

    attributions: np.ndarray
    completeness_gap: float
    difference: float


def quadrature(method: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(alphas (K,), weights (K,))`` of a rule on [0, 1] with captum's names (``QUADRATURES``).

    >>> alphas, weights = quadrature("riemann_trapezoid", 3)
    >>> alphas.tolist(), weights.tolist()
    ([0.0, 0.5, 1.0], [0.25, 0.5, 0.25])
    """
    if method not in QUADRATURES:
        raise ValueError(f"method must be one of {', '.join(map(repr, QUADRATURES))}, got {method!r}")
    steps = check_positive_int(steps, "steps", maximum=100_000)
    if method == "gausslegendre":
        nodes, weights = np.polynomial.legendre.leggauss(steps)  # on [-1, 1]
        return (nodes + 1) / 2, weights / 2
    if method == "riemann_trapezoid":
        if steps < 2:
            raise ValueError(f"steps must be at least 2 for riemann_trapezoid, got {steps}")
        weights = np.full(steps, 1.0 / (steps - 1))
        weights[[0, -1]] /= 2
        return np.linspace(0.0, 1.0, steps), weights
    offset = {"riemann_middle": 0.5, "riemann_left": 0.0, "riemann_right": 1.0}[method]
    return (np.arange(steps) + offset) / steps, np.full(steps, 1.0 / steps)


def _baseline(model, ids: np.ndarray, baseline: Any) -> np.ndarray:
    """The baseline embeddings (L, D), in ``hook_embed``'s space (after ``scales.embedding``)."""
    length, width = ids.shape[-1], model.config.hidden_size
    if baseline is None:
        return np.zeros((length, width), model.dtype)
    if isinstance(baseline, (int, np.integer)) and not isinstance(baseline, bool):
        if not 0 <= baseline < model.config.vocab_size:
            raise ValueError(f"baseline token {baseline} is not in [0, {model.config.vocab_size})")
        row = model.embed.weight[int(baseline)] * model.dtype.type(model.config.scales.embedding)  # (D,)
        return np.broadcast_to(row, (length, width)).astype(model.dtype)
    arr = as_array(baseline, "baseline")
    if arr.shape != (length, width) or arr.dtype.kind != "f":
        raise ValueError(f"baseline must be None, a token id or float embeddings of shape (L, D) = ({length}, "
                         f"{width}), got {type(baseline).__name__} of shape {arr.shape}")
    return arr.astype(model.dtype)


def integrated_gradients(model, input_ids: Any, target: Any, steps: int = 64, baseline: Any = None, *,
                         target_position: int = -1, method: str = "gausslegendre",
                         batch_size: int = 16, foil: Any = None, progress: bool | None = None) -> IntegratedGradients:
    """Integrated gradients of ``log p(target)`` after ``target_position``, on the input token embeddings.

    With a ``foil`` the function explained is contrastive, ``log p(target) - log p(foil)``, which is the logit
    difference ``logit[target] - logit[foil]`` (the softmax's normaliser cancels).

    Parameters
    ----------
    model : CausalLM
        Its gradient buffers are left freed (zeros when read).
    input_ids : array_like of int, (L,) or (1, L)
        One sequence.
    target : int
        The output token explained.
    steps : int, default 64
        K, the quadrature points (each one forward and one backward, ``batch_size`` at a time).
    baseline : None, int or ndarray (L, D), optional
        Zeros (default), one token's embedding at every position (e.g. EOS), or given embeddings; all in the
        space of ``hook_embed`` (after Gemma's ``scales.embedding``). Position embeddings are not interpolated.
    target_position : int, default -1
        Which position's next-token distribution is explained (the tokens after it get 0).
    method : str, default "gausslegendre"
        The quadrature rule, by captum's names (``QUADRATURES``). Gauss-Legendre puts points near the ends of
        the path, where an RMSNorm model changes most from a zero baseline.
    batch_size : int, default 16
        Quadrature points per forward.
    foil : int, optional
        The contrasting token of the contrastive variant (why ``target`` rather than ``foil``).
    progress : bool or None, default None
        A line on stderr counting the quadrature points done (:mod:`attnkit._progress`): None shows it when
        stderr is a terminal, True always, False never.

    Returns
    -------
    IntegratedGradients
        ``(attributions (L,), completeness_gap, difference)``. The gap shrinks as ``steps`` grows; report it.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> ig = integrated_gradients(lm, [1, 2, 3, 4], target=5, steps=8)
    >>> ig.attributions.shape
    (4,)
    >>> finer = integrated_gradients(lm, [1, 2, 3, 4], target=5, steps=64)
    >>> bool(abs(finer.completeness_gap) < abs(ig.completeness_gap) / 100)
    True
    """
    batch, _ = as_id_batch(input_ids, model.config.vocab_size, "input_ids")
    if batch.shape[0] != 1:
        raise ValueError(f"input_ids must be one sequence, got shape {np.shape(input_ids)}")
    vocab = model.config.vocab_size
    for name, token in (("target", target), ("foil", foil)):
        if token is None and name == "foil":
            continue
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab:
            raise ValueError(f"{name} must be a token id in [0, {vocab}), got {token!r}")
    batch_size = check_positive_int(batch_size, "batch_size")
    alphas, weights = quadrature(method, steps)
    length = batch.shape[1]
    position = check_position(target_position, length)
    ids = batch[:, :position + 1]  # (1, P): the model is causal, later tokens change nothing
    start = _baseline(model, ids, baseline if not isinstance(baseline, np.ndarray) else baseline[:position + 1])
    end = model.embed.weight[ids[0]] * model.dtype.type(model.config.scales.embedding)  # (P, D)

    def log_prob_and_grad(points: np.ndarray, need_grad: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """f at embeddings ``start + alpha (end - start)`` for each alpha (K,), and its gradient (K, P, D)."""
        path = start + points[:, None, None] * (end - start)  # (K, P, D)
        grads: dict[str, np.ndarray] = {}
        with hooks(model, {"hook_embed": lambda x, name: path},
                   backward={"hook_embed": lambda g, name: grads.__setitem__("g", np.array(g))}):
            logits = model(np.repeat(ids, len(points), axis=0), logits_to_keep=1)  # (K, 1, V)
            row = logits[:, 0].astype(np.float64)  # (K, V)
            shifted = row - row.max(axis=-1, keepdims=True)
            probs = np.exp(shifted)
            total = probs.sum(axis=-1, keepdims=True)  # (K, 1)
            if foil is None:
                log_p = shifted[:, target] - np.log(total[:, 0])  # (K,)
            else:  # log p(target) - log p(foil): the normaliser cancels
                log_p = row[:, target] - row[:, foil]  # (K,)
            if not need_grad:
                return log_p, None
            # d log softmax(z)[t] / dz = onehot(t) - softmax(z); of the logit difference, onehot(t) - onehot(f)
            grad_logits = -(probs / total) if foil is None else np.zeros_like(row)  # (K, V)
            grad_logits[:, target] += 1.0
            if foil is not None:
                grad_logits[:, foil] -= 1.0
            model.backward(grad_logits[:, None].astype(logits.dtype))
        return log_p, grads["g"]

    total_grad = np.zeros_like(end, dtype=np.float64)  # (P, D)
    with _progress.progress(len(alphas) + 2, "integrated gradients", unit="point", enabled=progress) as line:
        with model.input_gradients_only():
            for first in range(0, len(alphas), batch_size):
                chunk = slice(first, first + batch_size)
                _, grad = log_prob_and_grad(alphas[chunk])  # (k, P, D)
                total_grad += np.einsum("k,kpd->pd", weights[chunk], grad)
                line.update(len(alphas[chunk]))
        ends, _ = log_prob_and_grad(np.array([0.0, 1.0]), need_grad=False)  # f(baseline), f(input)
        line.update(2)
    attributions = np.zeros(length)
    attributions[:position + 1] = ((end - start) * total_grad).sum(axis=-1)  # (P,)
    difference = float(ends[1] - ends[0])
    return IntegratedGradients(attributions, float(attributions.sum() - difference), difference)
