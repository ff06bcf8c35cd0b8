"""Checking other implementations against attnkit: the attention conformance suite
(:func:`check_attention`, :mod:`attnkit.testing.conformance`) and its adapters for torch and transformers
(:mod:`attnkit.testing.attention_adapters`)."""
from .conformance import AttentionSpec, Case, ConformanceReport, check_attention, default_cases, reference_attention

__all__ = ["AttentionSpec", "Case", "ConformanceReport", "check_attention", "default_cases", "reference_attention"]
