"""FlexAttention on NumPy: one description of an attention variant, exact gradients, tile skipping.

A variant is a score modifier (:class:`ScoreMod`, e.g. :class:`ALiBi` or T5's :class:`RelativePositionBias`, or
a plain function forward-only) and a mask modifier (``mask_mod(b, h, q_idx, kv_idx) -> bool``) turned into a
:class:`BlockMask` by :func:`create_block_mask`; :func:`flex_attention` runs them (optionally with attention
sinks and grouped K/V) and :func:`flex_attention_backward` returns exact gradients, including the modifiers'
parameters. The common variants (causal, sliding-window and padding masks, which carry a :class:`KernelMask`;
a dense boolean mask) run on the attention kernels with their own arguments; the rest on the flex kernels.
Which kernel runs is decided by :func:`attnkit.kernels.registry.resolve_kernel`, the library's one rule.
"""
from .attention import FLEX_KERNELS, FlexAttentionContext, flex_attention, flex_attention_backward
from .masks import (
                    BlockMask,
                    KernelMask,
                    and_masks,
                    boolean_mask,
                    causal_lower_right,
                    causal_mask,
                    chunked_mask,
                    create_block_mask,
                    document_mask,
                    or_masks,
                    padding_mask,
                    prefix_lm_mask,
                    sliding_window_mask,
)
from .modifiers import (
                    ALiBi,
                    RelativePositionBias,
                    ScoreMod,
                    additive_bias,
                    alibi,
                    alibi_slopes,
                    compose,
                    relative_position_bias,
                    softcap,
                    t5_relative_position_bucket,
)

__all__ = ["flex_attention", "flex_attention_backward", "FlexAttentionContext", "FLEX_KERNELS", "ScoreMod",
           "ALiBi", "RelativePositionBias", "softcap", "alibi", "alibi_slopes", "relative_position_bias",
           "additive_bias", "compose", "t5_relative_position_bucket",
           "boolean_mask", "causal_mask", "causal_lower_right", "sliding_window_mask", "chunked_mask", "document_mask",
           "prefix_lm_mask", "padding_mask", "and_masks", "or_masks", "BlockMask", "KernelMask", "create_block_mask"]
