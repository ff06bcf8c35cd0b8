"""Adapters that put other libraries' attention functions in :func:`~attnkit.testing.check_attention`'s calling
convention, ``fn(q, k, v, spec) -> out`` on torch tensors (B, H, L, D).

Each adapter passes what the library takes as an argument and nothing more: a feature the function has no
argument for raises ``NotImplementedError`` (the case reads "unsupported"), so what the suite finds is the
library's behaviour, not the adapter's. Where the library's own idiom decides a semantics, the adapter uses the
idiom its documentation shows, and says so below.

=======================================  ==================================================================
adapter                                  what it calls
=======================================  ==================================================================
:func:`torch_sdpa` (``backend``)          ``torch.nn.functional.scaled_dot_product_attention`` under
                                         ``torch.nn.attention.sdpa_kernel(backend)``: ``is_causal``,
                                         ``attn_mask`` (boolean, True = take part), ``scale``,
                                         ``enable_gqa``. Causal with a mask is unsupported (SDPA takes one
                                         or the other); no window, soft-cap, sinks or ALiBi argument.
:func:`torch_flex_attention`             ``torch.nn.attention.flex_attention.flex_attention`` (eager): the
                                         masks as one ``mask_mod`` through ``create_block_mask``; causal as
                                         its documentation's ``causal_mask`` (``q_idx >= kv_idx``), the
                                         window as ``q_idx - kv_idx < window``; soft-cap and ALiBi as
                                         ``score_mod``; no sinks argument. No gradients: torch has no CPU
                                         backward for it.
:func:`transformers_attention` (kind)    transformers' attention-interface functions
                                         (``modeling_llama.eager_attention_forward``,
                                         ``integrations.sdpa_attention.sdpa_attention_forward``), with the
                                         mask built as its models build it (``masking_utils.eager_mask`` /
                                         ``sdpa_mask``, the queries at the last positions as with a cache);
                                         soft-cap, sinks (``s_aux``) and the window go in the keyword
                                         arguments the models pass; ALiBi is unsupported (the models that
                                         have it add it to the mask).
=======================================  ==================================================================
"""
from __future__ import annotations

import contextlib
import warnings

import numpy as np

from .conformance import AttentionSpec

__all__ = ["torch_sdpa", "torch_flex_attention", "transformers_attention", "sdpa_backends"]

_NO_KERNEL = ("No viable backend", "No available kernel")


def _refuse(spec: AttentionSpec, owner: str, **features: bool) -> None:
    """NotImplementedError naming the first feature of ``spec`` that ``owner`` has no argument for."""
    present = {"window": spec.window is not None, "softcap": spec.softcap is not None,
               "sinks": spec.sinks is not None, "alibi": spec.alibi_slopes is not None,
               "causal_and_mask": spec.causal and (spec.mask is not None or spec.key_padding is not None)}
    for feature, refused in features.items():
        if refused and present[feature]:
            raise NotImplementedError(f"{owner} has no argument for {feature.replace('_', ' ')}")


def _dense_mask(spec: AttentionSpec):
    """The spec's key padding and mask as one torch boolean (B, 1, Lq|1, Lk), True = may attend, or None."""
    import torch

    masks = [m for m in (None if spec.key_padding is None else spec.key_padding[:, None, None, :], spec.mask)
             if m is not None]
    if not masks:
        return None
    mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]  # (B, 1, Lq|1, Lk)
    return torch.from_numpy(np.ascontiguousarray(mask))


def sdpa_backends() -> list[str]:
    """The SDPA backends that run a small float32 case on this machine (CPU: ``"math"``, ``"flash"``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch

    found = []
    q = torch.zeros(1, 1, 2, 8)
    for name, backend in (("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
            found.append(name)
        except RuntimeError:
            continue
    return found


def torch_sdpa(backend: str | None = None):
    """torch's ``scaled_dot_product_attention`` in the suite's convention, on one backend (None: torch's choice).

    Parameters
    ----------
    backend : {"math", "flash", "efficient", "cudnn"} or None
        Run under ``torch.nn.attention.sdpa_kernel`` of that backend; a case it has no kernel for reads
        "unsupported".
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch

    backends = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if backend is not None and backend not in backends:
        raise ValueError(f"backend must be None or one of {sorted(backends)}, got {backend!r}")

    def sdpa(q, k, v, spec: AttentionSpec):
        _refuse(spec, "scaled_dot_product_attention", window=True, softcap=True, sinks=True, alibi=True,
                causal_and_mask=True)
        chosen = contextlib.nullcontext() if backend is None else sdpa_kernel(backends[backend])
        try:
            with chosen:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=_dense_mask(spec), dropout_p=spec.dropout_p,
                    is_causal=spec.causal, scale=spec.scale, enable_gqa=k.shape[1] != q.shape[1])
        except RuntimeError as exc:
            if any(text in str(exc) for text in _NO_KERNEL):
                raise NotImplementedError(f"no {backend} kernel for this case") from exc
            raise

    sdpa.framework = "torch"
    sdpa.__name__ = f"torch SDPA ({backend or 'default'} backend)"
    return sdpa


def _flex_mask_mod(spec: AttentionSpec):
    """One ``mask_mod`` for flex_attention, written as its documentation writes each mask; None if none."""
    import torch

    parts = []
    if spec.causal:
        parts.append(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)  # the documented causal_mask: top left
    if spec.window is not None:
        window = spec.window
        parts.append(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < window)
    dense = _dense_mask(spec)
    if dense is not None:
        parts.append(lambda b, h, q_idx, kv_idx: dense[b, 0, q_idx if dense.shape[2] > 1 else 0, kv_idx])
    if not parts:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = parts[0](b, h, q_idx, kv_idx)
        for part in parts[1:]:
            allowed = torch.logical_and(allowed, part(b, h, q_idx, kv_idx))
        return allowed
    return mask_mod


def _flex_score_mod(spec: AttentionSpec):
    """soft-cap and ALiBi as one ``score_mod``; None if neither."""
    import torch

    cap = spec.softcap
    slopes = None if spec.alibi_slopes is None else torch.from_numpy(np.asarray(spec.alibi_slopes))
    if cap is None and slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if slopes is not None:
            score = score + slopes[h].to(score.dtype) * (kv_idx - q_idx)
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        return score
    return score_mod


def torch_flex_attention():
    """torch's ``flex_attention`` (eager, on CPU) in the suite's convention; forward only (see the module)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch

    def flex(q, k, v, spec: AttentionSpec):
        _refuse(spec, "flex_attention", sinks=True)
        mask_mod = _flex_mask_mod(spec)
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device="cpu")
        with torch.no_grad(), warnings.catch_warnings():
            # eager flex_attention on CPU says it is not compiled: what this adapter means to run
            warnings.filterwarnings("ignore", message=".*unfused implementation.*")
            return flex_attention(q, k, v, score_mod=_flex_score_mod(spec), block_mask=block_mask, scale=spec.scale,
                                  enable_gqa=k.shape[1] != q.shape[1])

    flex.framework = "torch"
    flex.differentiable = False
    flex.__name__ = "torch flex_attention"
    return flex


def _transformers_mask(kind: str, spec: AttentionSpec, q, k):
    """The mask transformers' models give the attention function: ``masking_utils`` with the queries at the
    last ``Lq`` of ``Lk`` positions (``q_offset = Lk - Lq``, as a cache puts them), the dense mask ANDed in."""
    from transformers import masking_utils as mu

    import torch

    batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
    dense = None if spec.mask is None else torch.from_numpy(spec.mask)
    padding = None if spec.key_padding is None else torch.from_numpy(spec.key_padding)
    if not spec.causal and padding is None and dense is None:
        return None
    function = mu.bidirectional_mask_function if not spec.causal else mu.causal_mask_function \
        if spec.window is None else mu.sliding_window_causal_mask_function(spec.window)
    built = dict(q_offset=seq_k - seq_q, mask_function=function, attention_mask=padding)
    if kind == "eager":
        mask = mu.eager_mask(batch, seq_q, seq_k, dtype=q.dtype, **built)  # (B, 1, Lq, Lk): 0 or the dtype's min
        return mask if dense is None else mask.masked_fill(~dense, torch.finfo(q.dtype).min)
    mask = mu.sdpa_mask(batch, seq_q, seq_k, local_size=spec.window, **built)  # bool, or None when causal suffices
    return dense if mask is None else mask if dense is None else mask & dense


def transformers_attention(kind: str):
    """transformers' ``"eager"`` or ``"sdpa"`` attention-interface function in the suite's convention.

    The function gets a stand-in for the attention module (``num_key_value_groups``, ``is_causal``,
    ``training=False``); eager's ``scaling`` is required (the models pass ``module.scaling``), so a case asking
    for the default scale reads "unsupported" there.
    """
    import torch

    if kind == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward as forward
    elif kind == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as forward
    else:
        raise ValueError(f"kind must be 'eager' or 'sdpa', got {kind!r}")

    class AttentionModule(torch.nn.Module):
        """What the interface functions read from the calling attention layer."""

        def __init__(self, groups: int, causal: bool):
            super().__init__()
            self.num_key_value_groups, self.is_causal = groups, causal
            self.eval()

    def attend(q, k, v, spec: AttentionSpec):
        _refuse(spec, f"transformers' {kind} attention", alibi=True)
        if kind == "eager" and spec.scale is None:
            raise NotImplementedError("eager_attention_forward has no default scale (scaling is required)")
        extra = {}
        if spec.softcap is not None:
            extra["softcap"] = spec.softcap
        if spec.sinks is not None:
            extra["s_aux"] = torch.from_numpy(np.asarray(spec.sinks)).to(q.dtype)
        if spec.window is not None:
            extra["sliding_window"] = spec.window
        module = AttentionModule(q.shape[1] // k.shape[1], spec.causal)
        out, _ = forward(module, q, k, v, _transformers_mask(kind, spec, q, k), dropout=spec.dropout_p,
                         scaling=spec.scale, **extra)
        return out.transpose(1, 2)  # (B, Hq, Lq, Dv): the functions return (B, Lq, Hq, Dv)

    attend.framework = "torch"
    attend.__name__ = f"transformers {kind}_attention_forward"
    return attend
