"""Complete models built from :mod:`attnkit.layers`, their configurations, and helpers to train and score them.

- :class:`TokenTagger`: embedding + encoder + projection, one class per token;
- :class:`DecoderConfig`: the architecture of a decoder-only language model, read from a Hugging Face
  ``config.json`` by :mod:`attnkit.pretrained` (one module per family in :mod:`attnkit.pretrained.families`);
- :class:`LayerSpec`: what one decoder layer is (``DecoderConfig.layers``: its mixer, MLP, sizes and cache);
- :class:`CausalLM`: the decoder-only language model a :class:`DecoderConfig` describes;
- :class:`MultiTokenPredictor`: a checkpoint's multi-token-prediction layers on a :class:`CausalLM` (a draft);
- :class:`Seq2SeqTransformer`: embeddings + encoder-decoder Transformer + head, with greedy and beam search.
"""
from .causal_lm import CausalLM
from .config import (
    AttentionConfig,
    AttentionMamba2Config,
    DecoderConfig,
    ExpertsConfig,
    MLPConfig,
    NormConfig,
    RotaryConfig,
    ScalesConfig,
    Seq2SeqConfig,
    SpecialTokens,
    TokenTaggerConfig,
)
from .layer_spec import LayerSpec
from .layerwise import LayerwiseConfig
from .multi_token import MultiTokenPredictor
from .seq2seq import Seq2SeqTransformer
from .token_tagger import TokenTagger, token_accuracy, train_step

__all__ = ["CausalLM", "DecoderConfig", "AttentionConfig", "AttentionMamba2Config", "ExpertsConfig", "LayerSpec",
           "LayerwiseConfig",
           "MLPConfig", "MultiTokenPredictor",
           "NormConfig",
           "RotaryConfig", "ScalesConfig", "Seq2SeqConfig", "Seq2SeqTransformer",
           "SpecialTokens", "TokenTagger", "TokenTaggerConfig",
           "token_accuracy", "train_step"]
