"""Explaining a prediction: which input tokens made the model say it, how attention moves information through
the layers, and what each layer would predict.

- :func:`gradient_x_input`, :func:`saliency`: input attributions from attnkit's own exact backward.
- :func:`attention_rollout`: Abnar and Zuidema's rollout of the attention weights over the layers;
  :func:`attention_flow` their maximum flow through the same graph (for short sequences).
- :func:`similarity_attribution`: the same for a sentence encoder, whose target is two sentences' cosine
  similarity.
- :func:`logit_lens`: every block's output read through the final norm and the output head.
- :func:`run_with_cache`, :func:`hooks`, :func:`hook_names`: activations by TransformerLens's names, read or
  replaced under forward, ``generate`` and the exact backward; the cache is an :class:`ActivationCache`, with
  TransformerLens's ``accumulated_resid``, ``decompose_resid`` and ``logit_attrs``.
- :func:`to_str_tokens`, :func:`test_prompt`: a prompt's tokens as text, and how the model ranks an answer.
- :func:`activation_patching`, :func:`attribution_patching`: which layer, position or head carries the
  difference between clean and corrupted prompts (for any metric, over a batch of pairs), patched or estimated
  from the exact gradient; :func:`path_patching` the part of one head's effect that reaches later heads' queries,
  keys or values; :func:`edge_attribution` every edge of the residual-stream graph (embeddings, heads, MLPs,
  logits) by edge attribution patching (EAP) or EAP-IG, from the exact gradient.
- :func:`integrated_gradients`: input attributions along a path from a baseline, with the completeness gap.
- :func:`generation_attribution`: per generated token, which tokens before it made the model choose it (inseq's
  matrix), with a contrastive variant against a foil.
- :func:`detect_head`: TransformerLens's head detector, every head's score as a previous-token, duplicate-token or
  induction head (:mod:`attnkit.explain.head_detector` has its detection patterns).
- :func:`direct_logit_attribution`: each head's, MLP's and the embeddings' share of a logit, summing to it.
- :func:`control_vector`, :func:`steering`: steering with control vectors (a :class:`ControlVector`): computed
  from contrastive prompt pairs as repeng computes them, added to each layer's output inside ``generate`` as
  llama.cpp adds them; :func:`load_control_vector` and :func:`save_control_vector` read and write llama.cpp's
  control-vector GGUF files.
- :func:`load_sae`, :func:`run_with_cache_with_saes`, :func:`saes`, :func:`feature_attribution`: sparse
  autoencoders and transcoders (an :class:`SAE`) from SAELens's folders, spliced in at a hook point with or
  without the error term, their features cached, ablated or steered by hooks, and attributed from the exact
  gradient.
- :func:`attribution_graph`: circuit-tracer's attribution graph of one prompt (an :class:`AttributionGraph`): every
  MLP replaced by its transcoder, attention patterns and norm scales frozen, the direct effects between features,
  error nodes, token embeddings and logits, pruned by influence (:func:`prune_graph`).
- :func:`explain_html`: all of it, with the attention of every head, in one offline HTML page;
  :func:`explain_similarity_html` the same for a sentence encoder and two sentences.
"""
from .attribution import gradient_x_input, saliency
from .attribution_graph import AttributionGraph, attribution_graph, prune_graph
from .cache import ActivationCache
from .control_vector_file import load_control_vector, save_control_vector
from .direct_logit import direct_logit_attribution
from .edge_attribution import EdgeAttribution, edge_attribution
from .flow import attention_flow
from .generation import GenerationAttribution, generation_attribution
from .head_detector import detect_head
from .hooks import hook_names, hooks, run_with_cache
from .integrated_gradients import IntegratedGradients, integrated_gradients
from .logit_lens import LogitLens, logit_lens
from .page import encode_attention, explain_html, explain_similarity_html
from .patching import activation_patching, attribution_patching
from .path_patching import path_patching
from .prompts import PromptTest, test_prompt, to_str_tokens
from .rollout import attention_rollout
from .sae import SAE, load_sae
from .sae_splice import FeatureAttribution, feature_attribution, run_with_cache_with_saes, saes
from .similarity import SimilarityAttribution, similarity_attribution
from .steering import ControlVector, control_vector, steering

__all__ = ["ActivationCache", "AttributionGraph", "ControlVector", "EdgeAttribution", "FeatureAttribution",
           "GenerationAttribution", "IntegratedGradients", "LogitLens", "PromptTest", "SAE", "SimilarityAttribution",
           "activation_patching", "attention_flow", "attention_rollout", "attribution_graph", "attribution_patching",
           "control_vector", "detect_head", "direct_logit_attribution", "edge_attribution", "encode_attention",
           "explain_html", "explain_similarity_html", "feature_attribution", "generation_attribution",
           "gradient_x_input", "hook_names", "hooks", "integrated_gradients", "load_control_vector", "load_sae",
           "logit_lens", "path_patching", "prune_graph", "run_with_cache", "run_with_cache_with_saes", "saes",
           "saliency", "save_control_vector", "similarity_attribution", "steering", "test_prompt", "to_str_tokens"]
