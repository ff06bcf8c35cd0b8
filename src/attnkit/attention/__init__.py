"""Attention modules: every head implements :class:`attnkit.core.BaseAttention`."""
from .additive import AdditiveAttention
from .attention import Attention
from .causal import CausalAttention
from .gated import GatedAttention
from .grouped_query import GroupedQueryAttention
from .latent import LatentAttentionConfig, MultiHeadLatentAttention
from .learned_bias import LearnedBiasAttention
from .lightning_indexer import LightningIndexer, indexer_kl_loss
from .multi_head_attention import MultiHeadAttention
from .physics_guided import PhysicsGuidedAttention
from .scaled_dot_product import ScaledDotProductAttention
from .shared_kv import KVOwnerAttention, KVReaderAttention, SharedKV

__all__ = ["MultiHeadAttention", "ScaledDotProductAttention",
           "Attention", "AdditiveAttention", "CausalAttention", "LearnedBiasAttention", "PhysicsGuidedAttention",
           "GroupedQueryAttention", "GatedAttention", "MultiHeadLatentAttention", "LatentAttentionConfig",
           "LightningIndexer", "indexer_kl_loss",
           "KVOwnerAttention", "KVReaderAttention", "SharedKV"]
