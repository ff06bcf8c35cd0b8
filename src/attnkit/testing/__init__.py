"""Checking other implementations against attnkit.

:func:`compare` runs the same token ids through two implementations of a decoder (attnkit in float32 or float64,
a transformers model, a PyTorch module, recorded activations) and finds the first operation where they part,
judging each against attnkit's float64 run (:mod:`attnkit.testing.divergence`; the names it compares are in
:mod:`attnkit.testing.trace`); ``attnkit compare`` is its command line. :func:`check_attention` runs any attention
function over a grid of cases against attnkit's float64 kernels and names the semantic differences it finds
(:mod:`attnkit.testing.conformance`, with adapters for torch and transformers in
:mod:`attnkit.testing.attention_adapters`); :mod:`attnkit.testing.error_tables` measures every family against
transformers.
"""
from .conformance import AttentionSpec, Case, ConformanceReport, check_attention, default_cases, reference_attention
from .divergence import FACTOR, FLOOR_ULPS, Comparison, Reference, Row, as_side, compare
from .sides import (
    AttnkitSide,
    RecordedSide,
    TorchSide,
    load_torch_weights,
    torch_side_from_folder,
    transformers_side,
)
from .trace import OPS, scores_from_probs

__all__ = ["compare", "Comparison", "Row", "Reference", "as_side", "FACTOR", "FLOOR_ULPS", "OPS",
           "scores_from_probs", "AttnkitSide", "RecordedSide", "TorchSide", "transformers_side",
           "torch_side_from_folder", "load_torch_weights",
           "AttentionSpec", "Case", "ConformanceReport", "check_attention", "default_cases", "reference_attention"]
