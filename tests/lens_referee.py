"""TransformerLens as a referee: its ``TransformerBridge`` booted offline on a tiny model saved by ``hf_models``, and
the one table of where its hook names differ from attnkit's.

TransformerLens 4 has no ``HookedTransformer``; ``TransformerBridge.boot_transformers(folder, hf_model=...,
tokenizer=...)`` wraps the transformers model already in memory (no download: the config is the model's, the
tokenizer is read from the folder) and, by default, processes no weights, so its cache holds the model's own
activations.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import numpy as np

from hf_models import EOS, build_hf_model, saved_model, write_word_tokenizer

# The families TransformerLens 4.3 does not load, and why (what it says when asked).
NOT_LOADED = {
    "ministral": "its architecture list has Ministral3 only, not MinistralForCausalLM",
    "gpt_neox_sequential": "its GPT-NeoX adapter needs the attention biases (attention_bias=False fails an assert "
                           "in split_qkv_matrix)",
    "deepseek_v32": "no adapter for DeepseekV32ForCausalLM",
    "deepseek_v32_mixed": "no adapter for DeepseekV32ForCausalLM",
    "granitemoehybrid_dense": "its Granite 4 hybrid adapter needs the rotary embedding: without one (NoPE) the "
                              "forward raises 'Original component not set for model.rotary_emb'",
    "kimi_linear": "it has no adapter for KimiLinearForCausalLM",
    "kimi_linear_plain": "it has no adapter for KimiLinearForCausalLM",
}


@contextlib.contextmanager
def offline():
    """``HF_HUB_OFFLINE`` set while TransformerLens boots, and restored. Booting needs nothing from the hub without it
    too (it succeeds with every HTTP proxy pointed at a closed port); this keeps a future hub call from waiting on
    the network."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def tokenizer_for(folder: Path):
    """A ``transformers`` tokenizer saved in ``folder`` and read back from it (TransformerLens reloads a tokenizer by
    its ``name_or_path`` to add a BOS, so it must come from a folder)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not (folder / "tokenizer_config.json").is_file():
        fast = PreTrainedTokenizerFast(tokenizer_file=str(write_word_tokenizer(folder)), bos_token="w1",
                                       eos_token=f"w{EOS}", unk_token="w0")
        fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


_BRIDGES: dict[str, tuple] = {}


def boot(name: str, root: Path):
    """(TransformerBridge, folder) of the tiny model ``name``, offline, its weights unprocessed; booted once per
    session (a second bridge around the same transformers model wraps its already wrapped modules again)."""
    from transformer_lens.model_bridge import TransformerBridge

    if name in _BRIDGES:
        return _BRIDGES[name]
    shared, _ = saved_model(name, root)
    folder = Path(root) / "lens" / name  # a copy: the tokenizer written into it must not reach other tests' folder
    if not folder.exists():
        shutil.copytree(shared, folder)
    tokenizer = tokenizer_for(folder)
    with offline(), warnings.catch_warnings():  # TransformerLens's own notices are not attnkit's to fix
        warnings.simplefilter("ignore")
        # a model of its own, built as the saved one was: the bridge wraps its modules, and the shared one carries
        # what other tests ran through it (a dynamic rotary's tables grown by a longer sequence)
        hf = build_hf_model(name)
        hf.config.architectures = [type(hf).__name__]  # what save_pretrained writes, and the bridge reads
        bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf, tokenizer=tokenizer, device="cpu")
    _BRIDGES[name] = bridge, folder
    return _BRIDGES[name]


def lens_cache(bridge, ids: np.ndarray) -> dict[str, np.ndarray]:
    """TransformerLens's ``run_with_cache`` on token ids (B, L) (no BOS added), as NumPy arrays by name."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits, cache = bridge.run_with_cache(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
    out = {name: value.detach().numpy() for name, value in cache.cache_dict.items() if isinstance(value, torch.Tensor)}
    out["logits"] = logits.detach().numpy()
    return out


def lens_name(name: str, lens: dict, norm_after_rotary: bool = False) -> str | None:
    """TransformerLens's name for attnkit's hook point ``name``, or None where it has no such point.

    The same name except: a query or key after a q/k norm (Qwen3, OLMo 2, Gemma 3/4, Qwen3.5, Qwen3-Next), and
    Gemma 4's value after its v-norm, are TransformerLens's ``attn.q_norm.hook_out`` / ``k_norm`` / ``v_norm``
    (its ``hook_q`` is the projection's output, before the norm, and in Qwen3.5's gated layers holds the gate too);
    ``ln_final.hook_normalized`` is its ``ln_final.hook_out`` (its ``hook_normalized`` is before the norm's weight);
    a Gated DeltaNet layer's ``hook_attn_out`` is its ``linear_attn.hook_out``; the router's weights of the chosen
    experts (B, L, k) are its ``mlp.hook_expert_weights`` (B*L, E) (every expert's, zero where not chosen) at the
    chosen experts; Gemma 4's ``hook_per_layer_out`` its
    ``post_per_layer_input_norm.hook_out``. Where the q/k norm follows the rotation (HunYuan), attnkit's
    ``hook_q`` / ``hook_k`` are the projections, TransformerLens's own ``hook_q`` / ``hook_k``, and its
    ``hook_rot_q`` / ``hook_rot_k`` (rotated, then normed) are TransformerLens's ``q_norm`` / ``k_norm.hook_out``."""
    head, _, point = name.rpartition(".")
    candidates = [name]
    if point in ("hook_q", "hook_k", "hook_v") and head.endswith(".attn") and not norm_after_rotary:
        candidates.insert(0, f"{head}.{point[-1]}_norm.hook_out")
    elif point in ("hook_rot_q", "hook_rot_k") and head.endswith(".attn") and norm_after_rotary:
        candidates.insert(0, f"{head}.{point[-1]}_norm.hook_out")
    elif name == "ln_final.hook_normalized":
        candidates = ["ln_final.hook_out"]
    elif point == "hook_attn_out":
        candidates.append(f"{head}.linear_attn.hook_out")
    elif point == "hook_router_weights":
        candidates = [f"{head}.hook_expert_weights"]
    elif point == "hook_per_layer_out":
        candidates = [f"{head}.post_per_layer_input_norm.hook_out"]
    return next((c for c in candidates if c in lens), None)


def in_attnkit_layout(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """TransformerLens's array in attnkit's layout: as it is; with heads and positions swapped (its DeepSeek-V3
    ``hook_q`` / ``hook_k`` / ``hook_v`` and the normed q/k of Qwen3, Gemma 3, Qwen3.5, Qwen3-Next and Qwen3-MoE are
    (B, H, L, Dh)); or the same values read in attnkit's shape (OLMo 2's normed q/k (B, L, H*Dh), the experts
    (B*L, k), DeepSeek-V3's ``hook_z``). Equal values are then equal activations: the
    comparison itself decides."""
    if value.shape == shape:
        return value
    if value.ndim == 4 and value.swapaxes(1, 2).shape == shape:
        return value.swapaxes(1, 2)
    if value.size == int(np.prod(shape)):
        return value.reshape(shape)
    raise AssertionError(f"TransformerLens's {value.shape} cannot be read as attnkit's {shape}")


def interleaved_rotary_order(config) -> np.ndarray | None:
    """For DeepSeek-V3 with interleaved rotary features: the order in which TransformerLens holds attnkit's query
    and key features (transformers de-interleaves the rotary part, pairs (0, 1), (2, 3) ... to halves)."""
    latent = next((p for p in config.mixer_parts if type(p).__name__ == "LatentAttentionConfig"), None)
    if latent is None or not latent.rope_interleaved:
        return None
    nope, rope = latent.qk_nope_head_dim, latent.qk_rope_head_dim
    return np.concatenate([np.arange(nope), nope + np.arange(0, rope, 2), nope + np.arange(1, rope, 2)])


def in_attnkit_meaning(lm, lens: dict) -> dict:
    """TransformerLens's cache with its Falcon-H1 points brought to attnkit's meaning (other families: as it is).

    TransformerLens's Falcon-H1 bridge hooks transformers' modules before the muP multipliers the decoder layer and
    the model apply: its ``hook_embed`` is before ``embedding_multiplier``, its ``hook_attn_out`` is the attention's
    output alone before ``attention_out_multiplier`` (the Mamba-2 mixer's is its ``mamba.hook_out``, before
    ``ssm_out_multiplier``), and its ``hook_rot_k`` is after ``key_multiplier``, which attnkit folds into the
    attention's scale (its keys are the projection's). attnkit's ``hook_attn_out`` is what the layer adds to the
    residual stream: both mixers, scaled."""
    if lm.config.family != "falcon_h1":
        return lens
    out, c = dict(lens), lm.config
    out["hook_embed"] = lens["hook_embed"] * np.float32(c.scales.embedding)
    key_multiplier = c.attention.scale * c.head_dim ** 0.5
    for i in range(c.num_layers):
        factors = c.layers[i].part
        out[f"blocks.{i}.attn.hook_rot_k"] = lens[f"blocks.{i}.attn.hook_rot_k"] / np.float32(key_multiplier)
        out[f"blocks.{i}.hook_attn_out"] = (lens[f"blocks.{i}.hook_attn_out"] * np.float32(factors.attention_out)
                                            + lens[f"blocks.{i}.mamba.hook_out"] * np.float32(factors.mamba_out))
    return out


def compare(lm, cache, lens: dict) -> tuple[dict[str, float], list[str]]:
    """``({attnkit name: max |attnkit - TransformerLens| / max(1, max |TransformerLens|)}, [attnkit names
    TransformerLens does not have])``, TransformerLens's points read in attnkit's meaning
    (:func:`in_attnkit_meaning`)."""
    lens = in_attnkit_meaning(lm, lens)
    diffs, absent = {}, []
    order = interleaved_rotary_order(lm.config)
    for name, ours in cache.items():
        other = lens_name(name, lens, getattr(lm.config.attention, "qk_norm", None) == "head_after_rotary")
        if other is None:
            absent.append(name)
            continue
        if name.endswith("hook_router_weights"):
            chosen = cache[name.replace("hook_router_weights", "hook_expert_indices")]  # (B, L, k)
            theirs = np.take_along_axis(lens[other].reshape(chosen.shape[:2] + (-1,)), chosen, axis=-1)
        else:
            theirs = in_attnkit_layout(lens[other], ours.shape)
        if order is not None and name.endswith(("attn.hook_q", "attn.hook_k")):
            ours = ours[..., order]
        if ours.dtype.kind in "iu":
            if name.endswith("hook_expert_indices"):  # the chosen experts as a set: torch's top-k leaves them unsorted
                ours, theirs = np.sort(ours, axis=-1), np.sort(theirs, axis=-1)
            diffs[name] = float(np.abs(ours - theirs).max())
            continue
        scale = max(1.0, float(np.abs(theirs).max()))
        diffs[name] = float(np.abs(ours.astype(np.float64) - theirs).max()) / scale
    return diffs, absent
