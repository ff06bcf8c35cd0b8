"""Per-layer inputs (Gemma 4): a second embedding of every token, one slice per layer, added inside each layer.

Dimension letters: B batch, L tokens, D ``hidden_size``, N layers, P ``per_layer_input_size``, V' its vocabulary.

The model computes every layer's input once, from the token ids and the (scaled) token embeddings ``h``:

    e = (rms_norm(reshape(h W_proj / sqrt(D), (N, P))) + table[ids] * sqrt(P)) / sqrt(2)      (B, L, N, P)

and layer i, after its MLP, adds ``rms_norm(W_up (act(h W_gate) * e[:, :, i]))`` to the residual stream, then
multiplies the stream by its learned ``layer_scalar`` (:class:`~attnkit.layers.lm_block.PerLayerInputBlock`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.module import Module
from ..init import as_generator, normal
from ..kernels.activations import activation_backward, activation_forward
from ..kernels.linear import linear, linear_backward
from .embedding import Embedding
from .rms_norm import RMSNorm

__all__ = ["PerLayerInputs", "PerLayerInputBranch"]


class PerLayerInputs(Module):
    """Every layer's per-layer input ``e`` (B, L, N, P) from the ids and the token embeddings.

    Parameters
    ----------
    config : DecoderConfig
        With ``layerwise.per_layer_input_size`` P > 0 and ``layerwise.per_layer_vocab_size`` V'.
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    embed.weight (V', N*P), W_proj (D, N*P), norm.gamma (P,).

    Shapes
    ------
    ids (B, L) int in [0, V'), h (B, L, D) -> (B, L, N, P) in ``h``'s dtype. :meth:`backward` takes the gradient
    of that and returns the gradient of ``h`` (B, L, D).
    """

    def __init__(self, config, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        part = config.layerwise
        self.num_layers, self.size, self.hidden_size = config.num_layers, part.per_layer_input_size, config.hidden_size
        width = self.num_layers * self.size
        self.embed = Embedding(part.per_layer_vocab_size, width, rng=gen, std=0.02)
        self.register_parameter("W_proj", normal(gen, (config.hidden_size, width), std=0.02))
        self.norm = RMSNorm(self.size, eps=config.norm.eps)

    def forward(self, ids: np.ndarray, h: np.ndarray) -> np.ndarray:
        """``e`` (B, L, N, P); saves what :meth:`backward` needs."""
        b, length = ids.shape
        kind = h.dtype.type
        # transformers' sqrt(P) is a float32 buffer (rounded to float32 in every dtype); 1/sqrt(D) and 1/sqrt(2)
        # are Python numbers, taken in the computation's dtype
        scales = (kind(np.float32(self.size ** 0.5)), kind(self.hidden_size ** -0.5), kind(0.5 ** 0.5))
        tokens = self.embed(ids).astype(h.dtype, copy=False) * scales[0]  # (B, L, N*P)
        context = linear(h, self._parameters["W_proj"]) * scales[1]  # (B, L, N*P)
        context = self.norm(context.reshape(b, length, self.num_layers, self.size))  # (B, L, N, P)
        self.save_for_backward(h, scales)
        return (context + tokens.reshape(b, length, self.num_layers, self.size)) * scales[2]  # (B, L, N, P)

    def step(self, ids: np.ndarray, h: np.ndarray) -> np.ndarray:
        """One decoding step: ids (B, 1), h (B, D) -> e (B, N, P), nothing saved."""
        e = self.forward(ids, h[:, None])[:, 0]  # (B, N, P)
        self.save_for_backward()
        return e

    def backward(self, grad_output: Any) -> np.ndarray:
        """The table's, W_proj's and the norm's gradients into ``grads``; the gradient of ``h`` (B, L, D)."""
        if self.saved_tensors is None:
            raise RuntimeError("PerLayerInputs.backward called before forward")
        h, scales = self.saved_tensors
        g = np.asarray(grad_output) * scales[2]  # (B, L, N, P)
        b, length = h.shape[:2]
        self.embed.backward(g.reshape(b, length, -1) * scales[0])
        g_context = self.norm.backward(g).reshape(b, length, -1) * scales[1]  # (B, L, N*P)
        grad_h, grad_w, _ = linear_backward(g_context, h, self._parameters["W_proj"], False)  # (B, L, D)
        self.grads["W_proj"] += grad_w
        return grad_h


class PerLayerInputBranch(Module):
    """``norm(act(h W_gate) * e) W_up)``: what one layer's per-layer input ``e`` adds to its residual stream ``h``.

    Attributes
    ----------
    W_gate (D, P), W_up (P, D), norm.gamma (D,).

    Shapes
    ------
    h (B, L, D), e (B, L, P) -> (B, L, D). :meth:`backward` returns the gradients of ``h`` (through the gate
    only: the residual is the block's) and of ``e``.
    """

    def __init__(self, config, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        d, p = config.hidden_size, config.layerwise.per_layer_input_size
        self.activation = config.mlp.activation
        self.register_parameter("W_gate", normal(gen, (d, p), std=0.02))
        self.register_parameter("W_up", normal(gen, (p, d), std=0.02))
        self.norm = RMSNorm(d, eps=config.norm.eps, offset=config.norm.offset)

    def forward(self, h: np.ndarray, e: np.ndarray) -> np.ndarray:
        pre = linear(h, self._parameters["W_gate"])  # (B, L, P)
        post = activation_forward(pre, self.activation)  # (B, L, P)
        mixed = post * e.astype(h.dtype, copy=False)  # (B, L, P)
        self.save_for_backward(h, e, pre, post, mixed)
        return self.norm(linear(mixed, self._parameters["W_up"]))  # (B, L, D)

    def step(self, h: np.ndarray, e: np.ndarray) -> np.ndarray:
        """One decoding step: h (B, D), e (B, P) -> (B, D), nothing saved."""
        post = activation_forward(linear(h, self._parameters["W_gate"]), self.activation)  # (B, P)
        return self.norm.step(linear(post * e.astype(h.dtype, copy=False), self._parameters["W_up"]))  # (B, D)

    def backward(self, grad_output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h, e, pre, post, mixed = self.saved_tensors
        g_up = self.norm.backward(grad_output)  # (B, L, D)
        g_mixed, grad_w, _ = linear_backward(g_up, mixed, self._parameters["W_up"], False)  # (B, L, P)
        self.grads["W_up"] += grad_w
        g_e = g_mixed * post  # (B, L, P)
        g_pre = activation_backward(g_mixed * e, pre, post, self.activation)  # (B, L, P)
        g_h, grad_w, _ = linear_backward(g_pre, h, self._parameters["W_gate"], False)  # (B, L, D)
        self.grads["W_gate"] += grad_w
        return g_h, g_e
