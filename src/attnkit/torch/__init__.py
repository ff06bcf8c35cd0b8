"""PyTorch twins of attnkit's layers and models, for GPUs and clusters (the ``torch`` extra).

Every twin is a ``torch.nn.Module`` with the constructor arguments of the attnkit class of the same name,
the same parameter names (``named_parameters()`` keys equal attnkit's) and layout (``x @ W``), and attnkit's
masks (``True`` = may attend / real token). Attention runs on ``F.scaled_dot_product_attention``.

- :func:`from_numpy` / :func:`to_numpy`: an attnkit module to its twin and back (values and dtype kept);
- ``python -m attnkit.torch.train``: data-parallel training of a :class:`CausalLM` with ``torchrun``,
  writing a Hugging Face folder that attnkit's ``load_causal_lm`` and ``transformers`` both load.

attnkit's core never imports this package (or torch).

>>> import numpy as np
>>> import torch
>>> from attnkit.layers import TransformerEncoder as NumpyEncoder
>>> encoder = NumpyEncoder(2, d_model=8, num_heads=2, rng=0)
>>> twin = from_numpy(encoder)
>>> x = np.random.default_rng(0).normal(size=(1, 4, 8))
>>> bool(np.allclose(twin(torch.from_numpy(x)).detach().numpy(), encoder(x)))
True
"""
try:
    import torch  # noqa: F401  (the twins are torch modules: without torch there is nothing to offer)
except ImportError as err:  # pragma: no cover - exercised by the wheel test in a NumPy-only environment
    raise ImportError("attnkit.torch needs PyTorch: pip install 'attnkit[torch]'") from err

from ._twin import from_numpy, to_numpy  # noqa: E402
from .attention import (  # noqa: E402
    GatedAttention,
    GroupedQueryAttention,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    ScaledDotProductAttention,
)
from .blocks import (
    LMBlock,
    MixerOnlyBlock,
    MLPOnlyBlock,
    ParallelLMBlock,
    Transformer,
    TransformerDecoder,
    TransformerDecoderBlock,
    TransformerEncoder,
    TransformerEncoderBlock,
)
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetMixer
from .kimi_delta_attention import KimiDeltaAttention, KimiDeltaAttentionMixer
from .layers import (
    XIELUMLP,
    Dropout,
    Embedding,
    FeedForward,
    GatedMLP,
    GatedSharedExpert,
    Identity,
    LayerNorm,
    MixtureOfExperts,
    Projection,
    RMSNorm,
    RotaryEmbedding,
    Router,
    Scale,
    ScaledGatedMLP,
    SinusoidalPositionalEncoding,
    UngatedMLP,
    Zero,
)
from .layerwise import (
    KVOwnerAttention,
    KVReaderAttention,
    LayerwiseBlock,
    PerLayerInputBlock,
    PerLayerInputBranch,
    PerLayerInputs,
)
from .mamba2 import AttentionMamba2Mixer, Mamba2, Mamba2Mixer
from .models import CausalLM, Seq2SeqTransformer
from .short_conv import ShortConv, ShortConvMixer

__all__ = [
    "from_numpy", "to_numpy",
    "LayerNorm", "RMSNorm", "FeedForward", "GatedMLP", "UngatedMLP", "XIELUMLP", "Router", "MixtureOfExperts",
    "GatedSharedExpert",
    "Embedding", "Projection",
    "Dropout", "SinusoidalPositionalEncoding", "RotaryEmbedding", "Identity", "Zero", "Scale",
    "GatedDeltaNet", "GatedDeltaNetMixer", "KimiDeltaAttention", "KimiDeltaAttentionMixer",
    "ShortConv", "ShortConvMixer", "Mamba2", "Mamba2Mixer", "AttentionMamba2Mixer", "ScaledGatedMLP",
    "ScaledDotProductAttention", "MultiHeadAttention", "GroupedQueryAttention", "GatedAttention",
    "MultiHeadLatentAttention",
    "TransformerEncoderBlock", "TransformerEncoder", "TransformerDecoderBlock", "TransformerDecoder",
    "Transformer", "LMBlock", "ParallelLMBlock", "MixerOnlyBlock", "MLPOnlyBlock", "CausalLM", "Seq2SeqTransformer",
    "KVOwnerAttention", "KVReaderAttention", "PerLayerInputs", "PerLayerInputBranch", "LayerwiseBlock",
    "PerLayerInputBlock",
]
