"""attnkit: the attention mechanisms of the Transformer in NumPy, with exact forward and backward passes.

Mask convention everywhere: boolean, ``True`` = may attend (or: is a real token). A query that may attend
to nothing gets zero weights, zero output and zero gradient, never NaN.

The main entry points are here: the attention functions and modules, :class:`CausalLM` and
:class:`DecoderConfig`, and :func:`load` (a Hugging Face folder or a GGUF file as ``(model, tokenizer)``; its
weights and tokenizer need the ``pretrained`` extra, imported when a model is loaded).
"""
__version__ = "0.5.0.dev0"

from . import attention_core, core, init, interop, kernels, layers, multi_head, positional, transformer_block
from .attention import (
                        AdditiveAttention,
                        Attention,
                        CausalAttention,
                        LearnedBiasAttention,
                        MultiHeadAttention,
                        PhysicsGuidedAttention,
                        ScaledDotProductAttention,
)
from .attention_core import additive_attention, scaled_dot_product_attention
from .core import BaseAttention, Module
from .kernels._threads import get_adaptive_threads, get_num_threads, num_threads, set_adaptive_threads, set_num_threads
from .models import CausalLM, DecoderConfig
from .positional import create_causal_mask, create_padding_mask, sinusoidal_encoding
from .pretrained import load, load_causal_lm, load_tokenizer, supported_model_types
from .transformer_block import TransformerEncoderBlock

__all__ = [
    "__version__",
    "attention_core", "core", "init", "interop", "kernels", "layers", "multi_head", "positional", "transformer_block",
    "BaseAttention", "Module", "MultiHeadAttention", "ScaledDotProductAttention", "TransformerEncoderBlock",
    "Attention", "AdditiveAttention", "CausalAttention", "LearnedBiasAttention", "PhysicsGuidedAttention",
    "additive_attention", "scaled_dot_product_attention",
    "create_causal_mask", "create_padding_mask", "sinusoidal_encoding",
    "set_num_threads", "get_num_threads", "num_threads", "set_adaptive_threads", "get_adaptive_threads",
    "CausalLM", "DecoderConfig", "load", "load_causal_lm", "load_tokenizer", "supported_model_types",
]
