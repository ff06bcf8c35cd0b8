"""Bridge to ``torch.nn``: build attnkit modules from torch's attention and Transformer modules, and back.

torch is imported only inside these functions (attnkit's runtime dependency is numpy alone).

Weight layout: ``torch.nn.Linear`` stores ``weight`` as (out, in) and computes ``x @ weight.T``; attnkit
stores ``W`` as (in, out) and computes ``x @ W``, so every matrix is transposed on the way. torch's packed
``in_proj_weight`` (3E, E) holds the query, key and value projections one above the other.

Layouts and masks: attnkit is always batch first, so a module with ``batch_first=False`` gives the same
numbers once its (L, B, E) inputs are transposed to (B, L, E). attnkit's boolean masks mean ``True`` = may
attend / real token, the opposite of ``torch.nn``'s: pass ``~torch_mask``.

What has no attnkit counterpart is refused with a ``ValueError`` naming it: ``add_bias_kv``,
``add_zero_attn``, layers built with ``bias=False``, activations other than relu / gelu / tanh-gelu.

Dimension letters: E ``embed_dim`` (= D ``d_model``), Ek/Ev key/value features, F ``d_ff``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..attention.additive import AdditiveAttention
from ..attention.multi_head_attention import MultiHeadAttention
from ..attention.scaled_dot_product import ScaledDotProductAttention
from ..core.converters import TorchConverter, register_torch_converter, torch_converter, torch_converters
from ..layers.decoder import TransformerDecoder, TransformerDecoderBlock
from ..layers.encoder import TransformerEncoder
from ..layers.encoder_block import TransformerEncoderBlock
from ..layers.feed_forward import FeedForward
from ..layers.layer_norm import LayerNorm
from ..layers.transformer import Transformer

__all__ = ["require_torch", "from_torch", "to_torch", "mha_from_torch", "mha_state_dict", "mha_to_torch",
           "encoder_block_from_torch", "encoder_block_state_dict", "encoder_block_to_torch", "encoder_from_torch",
           "encoder_state_dict", "encoder_to_torch", "decoder_block_from_torch", "decoder_block_state_dict",
           "decoder_block_to_torch", "decoder_from_torch", "decoder_state_dict", "decoder_to_torch",
           "transformer_from_torch", "transformer_state_dict", "transformer_to_torch"]


def require_torch():
    """The ``torch`` module, or an ImportError that says how to get it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError("the torch.nn bridge needs PyTorch, which attnkit does not depend on: "
                          "install it with `pip install torch` (CPU wheels suffice)") from exc
    return torch


def _check_type(module: Any, class_name: str) -> None:
    torch = require_torch()
    expected = getattr(torch.nn, class_name)
    if not isinstance(module, expected):
        raise TypeError(f"expected a torch.nn.{class_name}, got {type(module).__name__}")


def _array(tensor: Any) -> np.ndarray:
    return tensor.detach().cpu().numpy().copy()


def _tensors(state: dict[str, np.ndarray]) -> dict[str, Any]:
    torch = require_torch()
    return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in state.items()}


def _prefixed(prefix: str, state: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}{name}": value for name, value in state.items()}


# -- multi-head attention ------------------------------------------------------------------------------
def _mha_weights(m: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch's (E, E|Ek|Ev) query/key/value weights, packed or separate."""
    if m._qkv_same_embed_dim:
        w = _array(m.in_proj_weight)  # (3E, E)
        e = m.embed_dim
        return w[:e], w[e:2 * e], w[2 * e:]
    return _array(m.q_proj_weight), _array(m.k_proj_weight), _array(m.v_proj_weight)


def _check_mha(m: Any) -> None:
    _check_type(m, "MultiheadAttention")
    if m.bias_k is not None:
        raise ValueError("torch.nn.MultiheadAttention with add_bias_kv=True has no attnkit counterpart")
    if m.add_zero_attn:
        raise ValueError("torch.nn.MultiheadAttention with add_zero_attn=True has no attnkit counterpart")


def _copy_mha(target: MultiHeadAttention, m: Any) -> None:
    """Copy the weights of ``m`` into ``target`` (same sizes and bias flag)."""
    w_q, w_k, w_v = _mha_weights(m)
    target.W_Q, target.W_K, target.W_V = w_q.T, w_k.T, w_v.T  # (E, E), (Ek, E), (Ev, E)
    target.W_O = _array(m.out_proj.weight).T  # (E, E)
    if target.bias:
        b = _array(m.in_proj_bias)  # (3E,)
        e = m.embed_dim
        target.b_Q, target.b_K, target.b_V = b[:e], b[e:2 * e], b[2 * e:]
        target.b_O = _array(m.out_proj.bias)


def mha_from_torch(m: Any) -> MultiHeadAttention:
    """An attnkit :class:`MultiHeadAttention` computing what ``torch.nn.MultiheadAttention`` ``m`` computes.

    ``kdim``/``vdim``, ``bias`` and the attention-weight ``dropout`` carry over; ``batch_first`` does not
    matter (attnkit is batch first). The parameters take ``m``'s dtype (at least float32).
    """
    _check_mha(m)
    mha = MultiHeadAttention(m.embed_dim, m.num_heads, dropout=float(m.dropout), bias=m.in_proj_bias is not None,
                             kdim=m.kdim, vdim=m.vdim, rng=0)
    mha.astype(_array(m.out_proj.weight).dtype)
    _copy_mha(mha, m)
    return mha


def mha_state_dict(mha: MultiHeadAttention) -> dict[str, Any]:
    """``mha``'s weights as a ``torch.nn.MultiheadAttention`` state dict (packed when kdim = vdim = E)."""
    if type(mha.attention) is not ScaledDotProductAttention:
        raise ValueError(f"torch.nn.MultiheadAttention has only the scaled dot-product head, not "
                         f"{type(mha.attention).__name__}")
    state: dict[str, np.ndarray] = {}
    if mha.kdim == mha.vdim == mha.embed_dim:
        state["in_proj_weight"] = np.concatenate([mha.W_Q.T, mha.W_K.T, mha.W_V.T])  # (3E, E)
    else:
        state["q_proj_weight"], state["k_proj_weight"], state["v_proj_weight"] = mha.W_Q.T, mha.W_K.T, mha.W_V.T
    if mha.bias:
        state["in_proj_bias"] = np.concatenate([mha.b_Q, mha.b_K, mha.b_V])  # (3E,)
    state["out_proj.weight"] = mha.W_O.T  # (E, E)
    if mha.bias:
        state["out_proj.bias"] = mha.b_O
    return _tensors(state)


# -- sublayers of the blocks ------------------------------------------------------------------------------
def _activation(layer: Any) -> str:
    torch = require_torch()
    act = layer.activation
    if act is torch.nn.functional.relu or isinstance(act, torch.nn.ReLU):
        return "relu"
    if act is torch.nn.functional.gelu:
        return "gelu"
    if isinstance(act, torch.nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    raise ValueError(f"activation {act!r} of {type(layer).__name__} has no attnkit counterpart "
                     f"(relu, gelu and tanh-approximated gelu do)")


def _check_block(layer: Any, class_name: str, attentions: tuple[str, ...]) -> None:
    _check_type(layer, class_name)
    if layer.linear1.bias is None or layer.norm1.bias is None:
        raise ValueError(f"torch.nn.{class_name} built with bias=False has no attnkit counterpart")
    for name in attentions:
        _check_mha(getattr(layer, name))
        if getattr(layer, name).in_proj_bias is None:
            raise ValueError(f"torch.nn.{class_name} with an unbiased {name} has no attnkit counterpart")


def _copy_ffn(target: FeedForward, linear1: Any, linear2: Any) -> None:
    target.W1, target.b1 = _array(linear1.weight).T, _array(linear1.bias)  # (D, F), (F,)
    target.W2, target.b2 = _array(linear2.weight).T, _array(linear2.bias)  # (F, D), (D,)


def _copy_norm(target: LayerNorm, norm: Any) -> None:
    target.gamma, target.beta = _array(norm.weight), _array(norm.bias)


def _ffn_state(ffn: FeedForward) -> dict[str, np.ndarray]:
    return {"linear1.weight": ffn.W1.T, "linear1.bias": ffn.b1, "linear2.weight": ffn.W2.T, "linear2.bias": ffn.b2}


def _norm_state(name: str, norm: LayerNorm) -> dict[str, np.ndarray]:
    return {f"{name}.weight": norm.gamma, f"{name}.bias": norm.beta}


def _dtype(layer: Any) -> np.dtype:
    return _array(layer.linear1.weight).dtype


# -- encoder ---------------------------------------------------------------------------------------------
def _encoder_block_kwargs(layer: Any) -> dict[str, Any]:
    _check_block(layer, "TransformerEncoderLayer", ("self_attn",))
    return dict(d_model=layer.self_attn.embed_dim, num_heads=layer.self_attn.num_heads,
                d_ff=layer.linear1.out_features, norm_first=bool(layer.norm_first), activation=_activation(layer),
                eps=float(layer.norm1.eps), attention_bias=True)


def _copy_encoder_block(block: Any, layer: Any) -> None:
    _copy_mha(block.attention, layer.self_attn)
    _copy_ffn(block.ffn, layer.linear1, layer.linear2)
    _copy_norm(block.norm1, layer.norm1)
    _copy_norm(block.norm2, layer.norm2)


def encoder_block_from_torch(layer: Any):
    """An attnkit ``TransformerEncoderBlock`` with the weights of a ``torch.nn.TransformerEncoderLayer``."""
    kwargs = _encoder_block_kwargs(layer)
    d_model, num_heads, d_ff = kwargs.pop("d_model"), kwargs.pop("num_heads"), kwargs.pop("d_ff")
    block = TransformerEncoderBlock(d_model, num_heads, d_ff, **kwargs, rng=0).astype(_dtype(layer))
    _copy_encoder_block(block, layer)
    return block


def encoder_block_state_dict(block: Any) -> dict[str, Any]:
    """An encoder block's weights as a ``torch.nn.TransformerEncoderLayer`` state dict."""
    state = _prefixed("self_attn.", mha_state_dict(block.attention))
    state.update(_tensors({**_ffn_state(block.ffn), **_norm_state("norm1", block.norm1),
                           **_norm_state("norm2", block.norm2)}))
    return state


def _stack_from_torch(stack: Any, class_name: str, stack_class: Any, block_kwargs: Any, copy_block: Any):
    """An attnkit stack of ``stack_class`` with the weights of a ``torch.nn.<class_name>`` (encoder or decoder):
    the blocks' configuration from ``block_kwargs(layer)`` (every layer alike), weights by ``copy_block``."""
    _check_type(stack, class_name)
    kwargs = block_kwargs(stack.layers[0])
    d_model, num_heads, d_ff = kwargs.pop("d_model"), kwargs.pop("num_heads"), kwargs.pop("d_ff")
    ours = stack_class(len(stack.layers), d_model, num_heads, d_ff, final_norm=stack.norm is not None,
                       **kwargs, rng=0).astype(_dtype(stack.layers[0]))
    for block, layer in zip(ours.layers, stack.layers, strict=True):
        if block_kwargs(layer) != block_kwargs(stack.layers[0]):
            raise ValueError(f"torch.nn.{class_name} layers of different configurations are not supported")
        copy_block(block, layer)
    if stack.norm is not None:
        _copy_norm(ours.norm, stack.norm)
    return ours


def _stack_state_dict(stack: Any, block_state_dict: Any) -> dict[str, Any]:
    """A stack's weights as the state dict of its ``torch.nn`` counterpart (blocks, then the final norm)."""
    state: dict[str, Any] = {}
    for i, block in enumerate(stack.layers):
        state.update(_prefixed(f"layers.{i}.", block_state_dict(block)))
    if stack.norm is not None:
        state.update(_tensors(_norm_state("norm", stack.norm)))
    return state


def encoder_from_torch(encoder: Any):
    """An attnkit ``TransformerEncoder`` with the weights of a ``torch.nn.TransformerEncoder``."""
    return _stack_from_torch(encoder, "TransformerEncoder", TransformerEncoder, _encoder_block_kwargs,
                             _copy_encoder_block)


def encoder_state_dict(encoder: Any) -> dict[str, Any]:
    """An encoder's weights as a ``torch.nn.TransformerEncoder`` state dict."""
    return _stack_state_dict(encoder, encoder_block_state_dict)


# -- decoder ---------------------------------------------------------------------------------------------
def _decoder_block_kwargs(layer: Any) -> dict[str, Any]:
    _check_block(layer, "TransformerDecoderLayer", ("self_attn", "multihead_attn"))
    return dict(d_model=layer.self_attn.embed_dim, num_heads=layer.self_attn.num_heads,
                d_ff=layer.linear1.out_features, dropout=float(layer.dropout.p), norm_first=bool(layer.norm_first),
                activation=_activation(layer), eps=float(layer.norm1.eps), attention_bias=True)


def _copy_decoder_block(block: Any, layer: Any) -> None:
    _copy_mha(block.self_attention, layer.self_attn)
    _copy_mha(block.cross_attention, layer.multihead_attn)
    _copy_ffn(block.ffn, layer.linear1, layer.linear2)
    for i in (1, 2, 3):
        _copy_norm(getattr(block, f"norm{i}"), getattr(layer, f"norm{i}"))


def decoder_block_from_torch(layer: Any):
    """An attnkit ``TransformerDecoderBlock`` with the weights of a ``torch.nn.TransformerDecoderLayer``."""
    kwargs = _decoder_block_kwargs(layer)
    d_model, num_heads, d_ff = kwargs.pop("d_model"), kwargs.pop("num_heads"), kwargs.pop("d_ff")
    block = TransformerDecoderBlock(d_model, num_heads, d_ff, **kwargs, rng=0).astype(_dtype(layer))
    _copy_decoder_block(block, layer)
    return block


def decoder_block_state_dict(block: Any) -> dict[str, Any]:
    """A decoder block's weights as a ``torch.nn.TransformerDecoderLayer`` state dict."""
    if isinstance(block.cross_attention.attention, AdditiveAttention):
        raise ValueError("a decoder block with additive cross-attention has no torch.nn counterpart")
    state = _prefixed("self_attn.", mha_state_dict(block.self_attention))
    state.update(_prefixed("multihead_attn.", mha_state_dict(block.cross_attention)))
    state.update(_tensors({**_ffn_state(block.ffn), **_norm_state("norm1", block.norm1),
                           **_norm_state("norm2", block.norm2), **_norm_state("norm3", block.norm3)}))
    return state


def decoder_from_torch(decoder: Any):
    """An attnkit ``TransformerDecoder`` with the weights of a ``torch.nn.TransformerDecoder``."""
    return _stack_from_torch(decoder, "TransformerDecoder", TransformerDecoder, _decoder_block_kwargs,
                             _copy_decoder_block)


def decoder_state_dict(decoder: Any) -> dict[str, Any]:
    """A decoder's weights as a ``torch.nn.TransformerDecoder`` state dict."""
    return _stack_state_dict(decoder, decoder_block_state_dict)


# -- encoder-decoder ---------------------------------------------------------------------------------------
def transformer_from_torch(model: Any):
    """An attnkit ``Transformer`` with the weights of a ``torch.nn.Transformer`` (both stacks' final norms)."""
    _check_type(model, "Transformer")
    enc = _encoder_block_kwargs(model.encoder.layers[0])
    dec = _decoder_block_kwargs(model.decoder.layers[0])
    ours = Transformer(dec["d_model"], dec["num_heads"], len(model.encoder.layers), len(model.decoder.layers),
                       dec["d_ff"], dropout=dec["dropout"], activation=dec["activation"],
                       norm_first=dec["norm_first"], eps=dec["eps"], attention_bias=True,
                       rng=0).astype(_dtype(model.decoder.layers[0]))
    if enc["norm_first"] != dec["norm_first"] or enc["activation"] != dec["activation"]:
        raise ValueError("a torch.nn.Transformer whose encoder and decoder differ in norm_first or activation "
                         "is not supported")
    ours.encoder = encoder_from_torch(model.encoder)
    ours.decoder = decoder_from_torch(model.decoder)
    return ours


def transformer_state_dict(model: Any) -> dict[str, Any]:
    """A Transformer's weights as a ``torch.nn.Transformer`` state dict."""
    return {**_prefixed("encoder.", encoder_state_dict(model.encoder)),
            **_prefixed("decoder.", decoder_state_dict(model.decoder))}


# -- attnkit to torch.nn: new modules ----------------------------------------------------------------------
def _torch_dtype(array: np.ndarray) -> Any:
    return require_torch().from_numpy(np.zeros(0, array.dtype)).dtype


def _torch_activation(name: str) -> Any:
    if name in ("relu", "gelu"):
        return name
    if name == "gelu_tanh":
        return require_torch().nn.GELU(approximate="tanh")
    raise ValueError(f"activation {name!r} has no torch.nn Transformer counterpart (relu, gelu and gelu_tanh do)")


def _loaded(module: Any, state: dict[str, Any]) -> Any:
    module.load_state_dict(state, strict=True)
    return module


def _attention_dropout(mha: MultiHeadAttention) -> float:
    return float(getattr(mha.attention, "dropout", 0.0))


def _biased_mha_state(mha: MultiHeadAttention) -> dict[str, Any]:
    """``mha``'s state dict with zero biases where it has none: torch's Transformer layers always have them."""
    state = mha_state_dict(mha)
    if not mha.bias:
        torch = require_torch()
        dtype = _torch_dtype(mha.W_O)
        state["in_proj_bias"] = torch.zeros(3 * mha.embed_dim, dtype=dtype)
        state["out_proj.bias"] = torch.zeros(mha.embed_dim, dtype=dtype)
    return state


def mha_to_torch(mha: MultiHeadAttention) -> Any:
    """A new batch-first ``torch.nn.MultiheadAttention`` computing what ``mha`` computes (its dtype)."""
    state = mha_state_dict(mha)
    m = require_torch().nn.MultiheadAttention(mha.embed_dim, mha.num_heads, dropout=_attention_dropout(mha),
                                              bias=mha.bias, kdim=mha.kdim, vdim=mha.vdim, batch_first=True,
                                              dtype=_torch_dtype(mha.W_O))
    return _loaded(m, state)


def _block_state(block: Any, attentions: dict[str, MultiHeadAttention], norms: tuple[str, ...]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, mha in attentions.items():
        state.update(_prefixed(f"{name}.", _biased_mha_state(mha)))
    norm_state: dict[str, np.ndarray] = {}
    for name in norms:
        norm_state.update(_norm_state(name, getattr(block, name)))
    state.update(_tensors({**_ffn_state(block.ffn), **norm_state}))
    return state


def _new_encoder_layer(block: TransformerEncoderBlock) -> Any:
    return require_torch().nn.TransformerEncoderLayer(
        block.d_model, block.num_heads, block.d_ff, dropout=0.0, activation=_torch_activation(block.activation),
        layer_norm_eps=block.eps, batch_first=True, norm_first=block.norm_first, dtype=_torch_dtype(block.W1))


def encoder_block_to_torch(block: TransformerEncoderBlock) -> Any:
    """A new batch-first ``torch.nn.TransformerEncoderLayer`` with ``block``'s configuration and weights.

    An attnkit block without attention biases becomes a torch layer whose attention biases are zero.
    """
    return _loaded(_new_encoder_layer(block), _block_state(block, {"self_attn": block.attention}, ("norm1", "norm2")))


def _new_decoder_layer(block: TransformerDecoderBlock) -> Any:
    if isinstance(block.cross_attention.attention, AdditiveAttention):
        raise ValueError("a decoder block with additive cross-attention has no torch.nn counterpart")
    return require_torch().nn.TransformerDecoderLayer(
        block.d_model, block.num_heads, block.d_ff, dropout=block.dropout1.p,
        activation=_torch_activation(block.activation), layer_norm_eps=block.eps, batch_first=True,
        norm_first=block.norm_first, dtype=_torch_dtype(block.ffn.W1))


def _decoder_block_torch_state(block: TransformerDecoderBlock) -> dict[str, Any]:
    attentions = {"self_attn": block.self_attention, "multihead_attn": block.cross_attention}
    return _block_state(block, attentions, ("norm1", "norm2", "norm3"))


def decoder_block_to_torch(block: TransformerDecoderBlock) -> Any:
    """A new batch-first ``torch.nn.TransformerDecoderLayer`` with ``block``'s configuration and weights."""
    return _loaded(_new_decoder_layer(block), _decoder_block_torch_state(block))


def _stack_torch_state(stack: Any, block_state: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, block in enumerate(stack.layers):
        state.update(_prefixed(f"layers.{i}.", block_state(block)))
    if stack.norm is not None:
        state.update(_tensors(_norm_state("norm", stack.norm)))
    return state


def _final_norm(stack: Any) -> Any:
    if stack.norm is None:
        return None
    return require_torch().nn.LayerNorm(stack.d_model, eps=stack.norm.eps, dtype=_torch_dtype(stack.norm.gamma))


def _encoder_torch_state(encoder: TransformerEncoder) -> dict[str, Any]:
    return _stack_torch_state(encoder, lambda b: _block_state(b, {"self_attn": b.attention}, ("norm1", "norm2")))


def encoder_to_torch(encoder: TransformerEncoder) -> Any:
    """A new batch-first ``torch.nn.TransformerEncoder`` with ``encoder``'s configuration and weights."""
    stack = require_torch().nn.TransformerEncoder(_new_encoder_layer(encoder.layers[0]), len(encoder.layers),
                                                  norm=_final_norm(encoder), enable_nested_tensor=False)
    return _loaded(stack, _encoder_torch_state(encoder))


def decoder_to_torch(decoder: TransformerDecoder) -> Any:
    """A new batch-first ``torch.nn.TransformerDecoder`` with ``decoder``'s configuration and weights."""
    stack = require_torch().nn.TransformerDecoder(_new_decoder_layer(decoder.layers[0]), len(decoder.layers),
                                                  norm=_final_norm(decoder))
    return _loaded(stack, _stack_torch_state(decoder, _decoder_block_torch_state))


def transformer_to_torch(model: Transformer) -> Any:
    """A new batch-first ``torch.nn.Transformer`` with ``model``'s configuration and weights."""
    first = model.decoder.layers[0]
    # torch.nn.Transformer re-initialises every matrix it holds, custom stacks included: load after building.
    ours = require_torch().nn.Transformer(first.d_model, first.num_heads,
                                          custom_encoder=encoder_to_torch(model.encoder),
                                          custom_decoder=decoder_to_torch(model.decoder), batch_first=True,
                                          norm_first=first.norm_first, dtype=_torch_dtype(first.ffn.W1))
    state = {**_prefixed("encoder.", _encoder_torch_state(model.encoder)),
             **_prefixed("decoder.", _stack_torch_state(model.decoder, _decoder_block_torch_state))}
    return _loaded(ours, state)


# -- one pair of entry points ------------------------------------------------------------------------------
for _cls, _converter in (
        (MultiHeadAttention, TorchConverter("MultiheadAttention", mha_from_torch, mha_state_dict, mha_to_torch)),
        (TransformerEncoderBlock, TorchConverter("TransformerEncoderLayer", encoder_block_from_torch,
                                                 encoder_block_state_dict, encoder_block_to_torch)),
        (TransformerEncoder, TorchConverter("TransformerEncoder", encoder_from_torch, encoder_state_dict,
                                            encoder_to_torch)),
        (TransformerDecoderBlock, TorchConverter("TransformerDecoderLayer", decoder_block_from_torch,
                                                 decoder_block_state_dict, decoder_block_to_torch)),
        (TransformerDecoder, TorchConverter("TransformerDecoder", decoder_from_torch, decoder_state_dict,
                                            decoder_to_torch)),
        (Transformer, TorchConverter("Transformer", transformer_from_torch, transformer_state_dict,
                                     transformer_to_torch))):
    register_torch_converter(_cls, _converter)


def from_torch(module: Any) -> Any:
    """The attnkit module computing what the ``torch.nn`` ``module`` computes, with its weights.

    Accepts ``MultiheadAttention``, ``TransformerEncoderLayer``, ``TransformerEncoder``,
    ``TransformerDecoderLayer``, ``TransformerDecoder`` and ``Transformer``.

    Raises
    ------
    TypeError
        If ``module`` is none of those.
    """
    torch = require_torch()
    for converter in torch_converters().values():
        if type(module) is getattr(torch.nn, converter.torch_class):
            return converter.from_torch(module)
    names = ", ".join(f"torch.nn.{c.torch_class}" for c in torch_converters().values())
    raise TypeError(f"module must be one of {names}, got {type(module).__module__}.{type(module).__name__}")


def to_torch(module: Any) -> Any:
    """A new batch-first ``torch.nn`` module with ``module``'s configuration and weights (the inverse of
    :func:`from_torch`).

    Raises
    ------
    TypeError
        If ``module``'s class has no ``torch.nn`` counterpart.
    """
    return torch_converter(type(module)).to_torch(module)
