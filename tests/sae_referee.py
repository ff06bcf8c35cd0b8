"""SAELens as a referee: its SAE classes (whose saver writes the folders attnkit loads) and its
``SAETransformerBridge`` (SAEs spliced into TransformerLens's bridge), imported without SAELens's package
``__init__``.

SAELens 6.54 declares transformer-lens<4, and its package ``__init__`` imports its training runners and evaluations
(nltk, babe, plotly, simple-parsing, python-dotenv, tenacity: none of them needed to encode, decode or splice). So
``import_sae_lens`` registers the package without running that ``__init__`` and lends TransformerLens 4 the two
modules SAELens names at import time and never uses on a bridge: ``transformer_lens.HookedTransformer`` (its
``HookedRootModule`` moved to the package's top level) and ``transformer_lens.components.mlps.can_be_used_as_mlp``
(a type only named in an annotation and an ``isinstance`` on a ``HookedTransformer``).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types


def import_sae_lens():
    """The modules ``(sae_lens.saes, sae_lens.analysis.sae_transformer_bridge)``, imported as above."""
    import torch.nn
    import transformer_lens

    if "transformer_lens.HookedTransformer" not in sys.modules:
        lent = types.ModuleType("transformer_lens.HookedTransformer")
        lent.HookedRootModule = transformer_lens.HookedRootModule

        class HookedTransformer(transformer_lens.HookedRootModule):
            """Never instantiated: SAELens's HookedSAETransformer subclasses it at import."""

        lent.HookedTransformer = HookedTransformer
        sys.modules[lent.__name__] = lent
    if "transformer_lens.components.mlps.can_be_used_as_mlp" not in sys.modules:
        for name in ("transformer_lens.components", "transformer_lens.components.mlps"):
            sys.modules.setdefault(name, types.ModuleType(name))
        mlp = types.ModuleType("transformer_lens.components.mlps.can_be_used_as_mlp")

        class CanBeUsedAsMLP(torch.nn.Module):
            """Never instantiated: named by SAELens's HookedSAETransformer only."""

        mlp.CanBeUsedAsMLP = CanBeUsedAsMLP
        sys.modules[mlp.__name__] = mlp
    if "sae_lens" not in sys.modules:
        spec = importlib.util.find_spec("sae_lens")
        if spec is None:
            raise ImportError("sae_lens is not installed")
        package = types.ModuleType("sae_lens")
        package.__path__ = list(spec.submodule_search_locations)
        package.__version__ = "6.54.12"
        package.logger = logging.getLogger("sae_lens")
        sys.modules["sae_lens"] = package
    saes = importlib.import_module("sae_lens.saes")
    bridge = importlib.import_module("sae_lens.analysis.sae_transformer_bridge")
    return saes, bridge
