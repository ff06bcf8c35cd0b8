"""Attention whose keys and values one layer computes and later layers reuse (Gemma 4's text model).

Dimension letters: B batch, L new tokens, S keys (past + new), D ``hidden_size``, Hq query heads, Hkv key/value
heads, Dh features per head (this layer's: a global layer's heads may be wider).

Two token mixers, chosen per layer when the model is built (the block's ``MIXERS``):

- :class:`KVOwnerAttention` computes its keys and values: per-head RMSNorm of queries and keys (with gains),
  RMSNorm of the values without a gain, rotary queries and keys; on a global layer with ``keys_are_values``
  there is no value projection and the values are the key projection's output (normalised apart). It hands
  the keys and values it attends to (after the cache, so the cached slots too) to a :class:`SharedKV`.
- :class:`KVReaderAttention` has only query and output projections: it attends with its own queries to the
  keys and values its owner handed over in the same forward pass. The cache holds nothing for it.

The backward runs the layers in reverse, so every reader's gradient with respect to the shared keys and values
is added into the :class:`SharedKV` before the owner's backward reads it: the owner's projections receive the
gradient of every layer that used their output.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output
from ..core.hooks import hook_heads, hook_heads_backward
from ..core.module import Module
from ..flex import flex_attention_backward
from ..init import as_generator, normal
from ..kernels import rotary as _rotary
from ..kernels.decode_step import head_norms_into, rms_norm_into
from ..kernels.fixed_weights import FixedWeights, fixed_weights_backward
from ..kernels.linear import linear, linear_backward
from ..kernels.rms_norm import rms_norm_backward, rms_norm_forward
from .grouped_query import GroupedQueryAttention, NoQueryTemperature, WindowSpan, causal_span, no_positions

__all__ = ["SharedKV", "KVOwnerAttention", "KVReaderAttention", "connect_shared_kv"]


class SharedKV:
    """The keys and values an owning layer attended to in the current pass, and the readers' gradients of them.

    Attributes
    ----------
    keys, values : (B, Hkv, S, Dh)
    key_mask : (B, S) bool or None
        ``True`` = real token, over the slots of ``keys``; None = every slot real.
    """

    def __init__(self) -> None:
        self.keys = self.values = self.key_mask = None
        self._grad_keys = self._grad_values = None

    def publish(self, keys: np.ndarray, values: np.ndarray, key_mask: np.ndarray | None) -> None:
        """Hand over a forward pass's keys and values (and forget the last pass's gradients)."""
        self.keys, self.values, self.key_mask = keys, values, key_mask
        self._grad_keys = self._grad_values = None

    def read(self, reader: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(keys, values, key_mask) of this pass, for the layer ``reader``; refused before the owner ran."""
        if self.keys is None:
            raise RuntimeError(f"KVReaderAttention (layer {reader}): the layer owning its keys and values has not "
                               f"run in this pass (connect_shared_kv connects them)")
        return self.keys, self.values, self.key_mask

    def add_grad(self, grad_keys: np.ndarray, grad_values: np.ndarray) -> None:
        """A reader's gradients (B, Hkv, S, Dh) of the keys and values, added to the others'."""
        if self._grad_keys is None:
            self._grad_keys, self._grad_values = grad_keys.copy(), grad_values.copy()
        else:
            self._grad_keys += grad_keys
            self._grad_values += grad_values

    def take_grad(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The summed readers' gradients (None when no reader ran a backward), and forget them."""
        grads = self._grad_keys, self._grad_values
        self._grad_keys = self._grad_values = None
        return grads


def _common(module: GroupedQueryAttention, config, layer_index: int, rng) -> np.random.Generator:
    """The settings both mixers share, read from ``config`` for layer ``layer_index``; W_Q, W_O and q_norm."""
    Module.__init__(module)
    if (isinstance(layer_index, bool) or not isinstance(layer_index, int)
            or not 0 <= layer_index < config.num_layers):
        raise ValueError(f"layer_index must be an integer in [0, {config.num_layers}), got {layer_index!r}")
    spec = config.layers[layer_index]
    module.layer_index = layer_index
    module.hidden_size, module.num_heads = config.hidden_size, config.num_heads
    module.head_dim, module.num_kv_heads = spec.head_dim, spec.num_kv_heads
    module.num_groups = module.num_heads // module.num_kv_heads
    module.window = spec.window
    module.reach = module.window or np.inf  # how far back a query sees: a decoding step within it needs no mask
    # full and sliding layers only (LayerwiseConfig.check): no chunks, no temperature, no positions
    module.chunk, module.temperature, module.positions = None, NoQueryTemperature(), no_positions
    module.span = WindowSpan(module.window) if module.window else causal_span
    rotary = spec.rotary
    module.uses_rotary = rotary is not None
    module.interleaved = rotary is not None and rotary.interleaved
    module.scale = config.attention.scale
    module.score_mod = spec.score_mod
    module.norm_eps, module.norm_offset = config.norm.eps, config.norm.offset
    gen = as_generator(rng)
    q_width = module.num_heads * module.head_dim
    module.register_parameter("W_Q", normal(gen, (config.hidden_size, q_width), std=0.02))
    module.register_parameter("W_O", normal(gen, (q_width, config.hidden_size), std=0.02))
    module.register_parameter("q_norm", np.ones(module.head_dim))
    return gen


class _LayerwiseAttention(GroupedQueryAttention):
    """What both mixers do with their queries and their output; the keys and values are the subclasses'."""

    def _gain(self, name: str) -> np.ndarray:
        """A q/k norm's weight plus the norm offset."""
        weight = self._parameters[name]
        return weight + weight.dtype.type(self.norm_offset)

    def _queries(self, x: np.ndarray, rotary):
        """Normalised, rotated query heads (B, Hq, L, Dh) and what their backward needs."""
        q = self._heads(linear(x, self._parameters["W_Q"]), self.num_heads)  # (B, Hq, L, Dh)
        q, q_hat, q_rstd = rms_norm_forward(q, self._gain("q_norm"), self.norm_eps)  # (B, Hq, L, Dh)
        hooked = self._hook_table is not None
        if hooked:
            q = hook_heads(self, "hook_q", q)
        if rotary is not None:
            q = _rotary.rotary_apply(q, *rotary, self.interleaved)  # (B, Hq, L, Dh)
            if hooked:
                q = hook_heads(self, "hook_rot_q", q)
        return q, (q_hat, q_rstd)

    def _queries_step(self, x: np.ndarray, rotary) -> np.ndarray:
        """:meth:`_queries` of one position per row: normalised, rotated query heads (B, Hq, 1, Dh), normalised
        and turned where the fresh projection lies (rms_norm_into and the in-place rotation are the forward's
        numbers bit for bit)."""
        q = linear(x, self._parameters["W_Q"]).reshape(x.shape[0], self.num_heads, 1, self.head_dim)  # (B, Hq, 1, Dh)
        rms_norm_into(q, self._gain("q_norm"), self.norm_eps, q, np.empty(q.shape, q.dtype))
        return q if rotary is None else _rotary.rotary_apply_in_place(q, *rotary, self.interleaved)  # (B, Hq, 1, Dh)

    def _output_step(self, heads: np.ndarray) -> np.ndarray:
        """The heads' outputs (B, Hq, Dh) side by side through W_O: (B, D)."""
        return linear(heads.reshape(heads.shape[0], -1), self._parameters["W_O"])  # (B, D)

    def _queries_backward(self, dq: np.ndarray, x: np.ndarray, rotary, normed) -> np.ndarray:
        """W_Q's and q_norm's gradients into ``grads``; the input gradient (B, L, D) through the queries."""
        hooked = self._hook_table is not None
        if rotary is not None:
            if hooked:
                dq = hook_heads_backward(self, "hook_rot_q", dq)
            dq = _rotary.rotary_backward(dq, *rotary, self.interleaved)  # (B, Hq, L, Dh)
        if hooked:
            dq = hook_heads_backward(self, "hook_q", dq)
        dq, grad_gain = rms_norm_backward(dq, *normed, self._gain("q_norm"))  # (B, Hq, L, Dh)
        self.grads["q_norm"] += grad_gain
        b, length = x.shape[:2]
        flat = dq.transpose(0, 2, 1, 3).reshape(b, length, -1)  # (B, L, Hq*Dh)
        grad_x, grad_w, _ = linear_backward(flat, x, self._parameters["W_Q"], False)  # (B, L, D)
        self.grads["W_Q"] += grad_w
        return grad_x

    def _output(self, out: np.ndarray, b: int, length: int):
        """The heads' outputs (B, Hq, L, Dh) side by side (B, L, Hq*Dh), and through W_O (B, L, D)."""
        merged = out.transpose(0, 2, 1, 3)  # (B, L, Hq, Dh)
        if self._hook_table is not None:
            merged = self.hook_point("hook_z", merged)
        merged = merged.reshape(b, length, self.num_heads * self.head_dim)  # (B, L, Hq*Dh)
        return merged, linear(merged, self._parameters["W_O"])  # (B, L, D)

    def _output_backward(self, grad_output: np.ndarray, x: np.ndarray, merged: np.ndarray) -> np.ndarray:
        """W_O's gradient into ``grads``; the heads' output gradient (B, Hq, L, Dh)."""
        g = check_grad_output(grad_output, x.shape, x.dtype, type(self).__name__)
        grad_merged, grad_w, _ = linear_backward(g, merged, self._parameters["W_O"], False)  # (B, L, Hq*Dh)
        self.grads["W_O"] += grad_w
        b, length = x.shape[:2]
        grad_out = grad_merged.reshape(b, length, self.num_heads, self.head_dim)  # (B, L, Hq, Dh)
        if self._hook_table is not None:
            grad_out = self.hook_backward("hook_z", grad_out)
        return np.ascontiguousarray(grad_out.transpose(0, 2, 1, 3))  # (B, Hq, L, Dh)

    @staticmethod
    def _attention_backward(grad_out: np.ndarray, ctx):
        """dq, dk, dv (B, H, L, Dh) of the attention (of the weights a hook put in place of its pattern, if one did)."""
        if isinstance(ctx, FixedWeights):
            return fixed_weights_backward(grad_out, ctx)
        return flex_attention_backward(grad_out, ctx)[:3]

    def _finish(self, y, weights, b: int, length: int, output_attentions: bool):
        if not output_attentions:
            return y
        return y, weights.reshape(b, self.num_heads, length, weights.shape[-1])  # (B, Hq, L, S)

    def _checked(self, x: Any) -> np.ndarray:
        x = check_features(x, "x", self.hidden_size, type(self).__name__, "hidden_size")
        if x.ndim != 3:
            raise ValueError(f"{type(self).__name__}: x must be (B, L, D), got shape {x.shape}")
        return x


class KVOwnerAttention(_LayerwiseAttention):
    """Causal self-attention that computes its keys and values and shares them (see the module docstring).

    Parameters
    ----------
    config : DecoderConfig
        With ``layerwise`` (:class:`~attnkit.models.LayerwiseConfig`): this layer's Dh and Hkv, and whether its
        values are its keys' projection.
    layer_index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    W_Q (D, Hq*Dh), W_K (D, Hkv*Dh), W_V (D, Hkv*Dh) unless the values are the keys, W_O (Hq*Dh, D); q_norm,
    k_norm (Dh,); ``shared``, the :class:`SharedKV` its readers read.

    Shapes
    ------
    As :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`: x (B, L, D) -> (B, L, D).
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        gen = _common(self, config, layer_index, rng)
        kv_width = self.num_kv_heads * self.head_dim
        self.register_parameter("W_K", normal(gen, (config.hidden_size, kv_width), std=0.02))
        self.keys_are_values = (config.layerwise.keys_are_values
                                and config.layer_types[layer_index] == "full_attention")
        if not self.keys_are_values:
            self.register_parameter("W_V", normal(gen, (config.hidden_size, kv_width), std=0.02))
        # what each key/value projection's output is: W_K's the keys (and the values, when they are the keys)
        self.kv_projections = {"W_K": ("k", "v")} if self.keys_are_values else {"W_K": ("k",), "W_V": ("v",)}
        self.register_parameter("k_norm", np.ones(self.head_dim))
        # side by side for a decoding step's one product: [queries | keys | values], or [queries | keys]
        self.fuse_parameters("W_QKV", ("W_Q", *self.kv_projections))
        self.shared = SharedKV()

    def hook_points(self) -> tuple[str, ...]:
        """As GroupedQueryAttention's: ``hook_q``, ``hook_k``, ``hook_v`` (after the norms), ``hook_rot_q``,
        ``hook_rot_k``, ``hook_pattern``, ``hook_z``."""
        rotated = ("hook_rot_q", "hook_rot_k") if self.uses_rotary else ()
        return ("hook_q", "hook_k", "hook_v", *rotated, "hook_pattern", "hook_z")

    def _keys_values(self, x: np.ndarray, rotary):
        """Normalised, rotated keys and normalised values (B, Hkv, L, Dh), and what their backward needs."""
        raw = {}
        for name, roles in self.kv_projections.items():
            out = self._heads(linear(x, self._parameters[name]), self.num_kv_heads)  # (B, Hkv, L, Dh)
            raw.update(dict.fromkeys(roles, out))  # one array twice when the values are the keys
        k_raw, v_raw = raw["k"], raw["v"]  # (B, Hkv, L, Dh) each
        k, k_hat, k_rstd = rms_norm_forward(k_raw, self._gain("k_norm"), self.norm_eps)  # (B, Hkv, L, Dh)
        v, v_hat, v_rstd = rms_norm_forward(v_raw, np.ones(self.head_dim, x.dtype), self.norm_eps)  # (B, Hkv, L, Dh)
        if self._hook_table is not None:
            k, v = hook_heads(self, "hook_k", k), hook_heads(self, "hook_v", v)
        if rotary is not None:
            k = _rotary.rotary_apply(k, *rotary, self.interleaved)  # (B, Hkv, L, Dh)
            if self._hook_table is not None:
                k = hook_heads(self, "hook_rot_k", k)
        return k, v, (k_hat, k_rstd, v_hat, v_rstd)

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """Attend every new token to itself and the tokens before it; hand the keys and values to ``shared``."""
        x = self._checked(x)
        b, length, _ = x.shape
        q, q_normed = self._queries(x, rotary)  # (B, Hq, L, Dh)
        k, v, kv_normed = self._keys_values(x, rotary)  # (B, Hkv, L, Dh) each
        if cache is not None:
            kept = cache.update(self.layer_index, k, v)
            k, v = kept.keys, kept.values  # (B, Hkv, S, Dh)
            key_mask = self._check_mask(attention_mask, b, int(kept.slots[-1]) + 1)
            key_mask = None if key_mask is None else key_mask[:, kept.slots]  # (B, S)
        else:
            key_mask = self._check_mask(attention_mask, b, length)
        self.shared.publish(k, v, key_mask)
        out, weights, ctx = self._attend(q, k, v, key_mask, output_attentions)  # (B, Hq, L, Dh)
        merged, y = self._output(out, b, length)  # (B, L, Hq*Dh), (B, L, D)
        if cache is None:  # the cached path is inference: it keeps nothing
            self.save_for_backward(x, merged, ctx, rotary, q_normed, kv_normed)
        else:
            self.save_for_backward()
        return self._finish(y, weights, b, length, output_attentions)

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None, cache=None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D), as :meth:`forward` with a cache: the new key and value into the
        cache, every kept one handed to ``shared`` for the readers."""
        q, k, v = self._qkv_step(x, rotary)  # (B, Hq, 1, Dh), (B, Hkv, 1, Dh), (B, Hkv, 1, Dh)
        kept = cache.update(self.layer_index, k, v)  # keys, values (B, Hkv, S, Dh)
        key_mask = None if attention_mask is None else attention_mask[:, kept.slots]  # (B, S)
        self.shared.publish(kept.keys, kept.values, key_mask)
        return self._output_step(self._attend_step(q, kept.keys, kept.values, key_mask))  # (B, D)

    def _qkv_step(self, x: np.ndarray, rotary):
        """:meth:`_queries` and :meth:`_keys_values` of one position per row, from one product of the side-by-side
        projections: queries and keys normalised in one pass (each its own gain) and turned in one rotation where
        they lie in the projection, the values normalised into an array of their own (before the keys, whose
        projection they may be). Returns q (B, Hq, 1, Dh), k and v (B, Hkv, 1, Dh)."""
        b, hq, hkv, dh = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        p = self._parameters
        qkv = self.fused_parameter("W_QKV")
        if qkv is None:  # a parameter was given new storage (or is packed): its own product
            qkv = np.concatenate([linear(x, p[name]) for name in ("W_Q", *self.kv_projections)], axis=1)
        else:
            qkv = linear(x, qkv)  # (B, (Hq + Hkv [+ Hkv]) Dh)
        qk = qkv[:, :(hq + hkv) * dh].reshape(b, hq + hkv, 1, dh)  # (B, Hq + Hkv, 1, Dh), a view
        v = qkv[:, (hq if self.keys_are_values else hq + hkv) * dh:].reshape(b, hkv, 1, dh)  # (B, Hkv, 1, Dh)
        v = rms_norm_into(v, v.dtype.type(1), self.norm_eps, np.empty(v.shape, v.dtype), np.empty(v.shape, v.dtype))
        head_norms_into(qk, hq, self._gain("q_norm"), self._gain("k_norm"), self.norm_eps)
        if rotary is not None:
            _rotary.rotary_apply_in_place(qk, *rotary, self.interleaved)  # (B, Hq + Hkv, 1, Dh)
        return qk[:, :hq], qk[:, hq:], v

    def backward(self, grad_output: Any) -> np.ndarray:
        """The parameters' gradients into ``grads`` (the readers' share of the keys' and values' included);
        ``grad_x`` (B, L, D) (uncached path only)."""
        if self.saved_tensors is None:
            raise RuntimeError("KVOwnerAttention.backward needs a forward without a cache just before it")
        x, merged, ctx, rotary, q_normed, (k_hat, k_rstd, v_hat, v_rstd) = self.saved_tensors
        grad_out = self._output_backward(grad_output, x, merged)  # (B, Hq, L, Dh)
        dq, dk, dv = self._attention_backward(grad_out, ctx)  # (B, H, L, Dh)
        shared_dk, shared_dv = self.shared.take_grad()
        if shared_dk is not None:
            dk, dv = dk + shared_dk, dv + shared_dv  # (B, Hkv, L, Dh)
        hooked = self._hook_table is not None
        if rotary is not None:
            if hooked:
                dk = hook_heads_backward(self, "hook_rot_k", dk)
            dk = _rotary.rotary_backward(dk, *rotary, self.interleaved)  # (B, Hkv, L, Dh)
        if hooked:
            dk, dv = hook_heads_backward(self, "hook_k", dk), hook_heads_backward(self, "hook_v", dv)
        dk, grad_gain = rms_norm_backward(dk, k_hat, k_rstd, self._gain("k_norm"))  # (B, Hkv, L, Dh)
        self.grads["k_norm"] += grad_gain
        dv, _ = rms_norm_backward(dv, v_hat, v_rstd, np.ones(self.head_dim, dv.dtype))  # (B, Hkv, L, Dh)
        grad_x = self._queries_backward(dq, x, rotary, q_normed)  # (B, L, D)
        b, length = x.shape[:2]
        flat = {"k": dk, "v": dv}
        for name, roles in self.kv_projections.items():  # a projection that made both gets the sum
            g = sum(flat[role] for role in roles).transpose(0, 2, 1, 3).reshape(b, length, -1)  # (B, L, Hkv*Dh)
            gx, grad_w, _ = linear_backward(g, x, self._parameters[name], False)  # (B, L, D)
            self.grads[name] += grad_w
            grad_x += gx
        return grad_x


class KVReaderAttention(_LayerwiseAttention):
    """Causal self-attention with its own queries over the keys and values of an earlier layer.

    Parameters
    ----------
    config, layer_index, rng
        As :class:`KVOwnerAttention`. :func:`connect_shared_kv` gives it its owner's ``shared``.

    Attributes
    ----------
    W_Q (D, Hq*Dh), W_O (Hq*Dh, D), q_norm (Dh,); ``shared``; ``owner_index``, the layer whose keys and values
    it reads.
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        _common(self, config, layer_index, rng)
        self.owner_index = config.layers[layer_index].kv_owner
        if self.owner_index is None:
            raise ValueError(f"layer {layer_index} computes its own keys and values: it is no KVReaderAttention")
        self.shared = SharedKV()  # replaced by the owner's when the model connects its layers

    def hook_points(self) -> tuple[str, ...]:
        """``hook_q``, ``hook_rot_q``, ``hook_pattern``, ``hook_z`` (its keys and values are its owner's)."""
        rotated = ("hook_rot_q",) if self.uses_rotary else ()
        return ("hook_q", *rotated, "hook_pattern", "hook_z")

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """Attend every new token to the owner's keys and values of this pass (``attention_mask`` and ``cache``
        were the owner's to read)."""
        x = self._checked(x)
        b, length, _ = x.shape
        q, q_normed = self._queries(x, rotary)  # (B, Hq, L, Dh)
        out, weights, ctx = self._attend(q, *self.shared.read(self.layer_index), output_attentions)  # (B, Hq, L, Dh)
        merged, y = self._output(out, b, length)  # (B, L, Hq*Dh), (B, L, D)
        if cache is None:
            self.save_for_backward(x, merged, ctx, rotary, q_normed)
        else:
            self.save_for_backward()
        return self._finish(y, weights, b, length, output_attentions)

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> None:
        """Nothing: the layer reads its owner's keys and values, which the owner's entry keeps."""
        return None

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None, cache=None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D) over the keys and values the owner's step handed over."""
        q = self._queries_step(x, rotary)  # (B, Hq, 1, Dh)
        return self._output_step(self._attend_step(q, *self.shared.read(self.layer_index)))  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """W_Q's, W_O's and q_norm's gradients into ``grads``, the keys' and values' into the owner's
        ``shared``; ``grad_x`` (B, L, D)."""
        if self.saved_tensors is None:
            raise RuntimeError("KVReaderAttention.backward needs a forward without a cache just before it")
        x, merged, ctx, rotary, q_normed = self.saved_tensors
        grad_out = self._output_backward(grad_output, x, merged)  # (B, Hq, L, Dh)
        dq, dk, dv = self._attention_backward(grad_out, ctx)  # (B, H, L, Dh)
        self.shared.add_grad(dk, dv)
        return self._queries_backward(dq, x, rotary, q_normed)


def connect_shared_kv(attentions) -> None:
    """Give every owner among ``attentions`` (one per layer) a fresh :class:`SharedKV`, and every reader its
    owner's (a copy of a model, e.g. :func:`attnkit.torch.to_numpy`'s, must not share them with the original)."""
    for attention in attentions:
        if isinstance(attention, KVOwnerAttention):
            attention.shared = SharedKV()
    for attention in attentions:
        if isinstance(attention, KVReaderAttention):
            attention.shared = attentions[attention.owner_index].shared
