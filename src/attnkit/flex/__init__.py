"""FlexAttention on NumPy: one description of an attention variant, exact gradients, tile skipping.

A variant is a score modifier (:class:`ScoreMod`, or a plain function forward-only) and a mask modifier
(``mask_mod(b, h, q_idx, kv_idx) -> bool``) turned into a :class:`BlockMask` by :func:`create_block_mask`;
:func:`flex_attention` runs them (optionally with attention sinks and grouped K/V) and
:func:`flex_attention_backward` returns exact gradients, including the modifiers' parameters.
"""
from .attention import FlexAttentionContext, flex_attention, flex_attention_backward
from .masks import (
                    BlockMask,
                    and_masks,
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
                    ScoreMod,
                    additive_bias,
                    alibi,
                    alibi_slopes,
                    compose,
                    relative_position_bias,
                    softcap,
                    t5_relative_position_bucket,
)

__all__ = ["flex_attention", "flex_attention_backward", "FlexAttentionContext", "ScoreMod", "softcap", "alibi",
           "alibi_slopes", "relative_position_bias", "additive_bias", "compose", "t5_relative_position_bucket",
           "causal_mask", "causal_lower_right", "sliding_window_mask", "chunked_mask", "document_mask",
           "prefix_lm_mask", "padding_mask", "and_masks", "or_masks", "BlockMask", "create_block_mask"]
