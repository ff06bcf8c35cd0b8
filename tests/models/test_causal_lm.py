"""CausalLM: exact gradients, parity with Hugging Face models, cache and padding invariances."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.models import CausalLM
from attnkit.models.causal_lm import positions_from_mask
from decoder_cases import hf_model, tiny_config, without_float32_internals

from helpers import assert_close_rel, assert_gradient, make_rng, randn

FAMILY_CASES = {
    "llama_gqa": {},
    "llama_mqa_tied": {"num_kv_heads": 1, "tie_word_embeddings": True},
    "llama_bias_gelu": {"attention": {"bias": True, "output_bias": True},
                        "mlp": {"bias": True, "activation": "gelu_tanh"}},
    "llama_linear": {"rotary": {"scaling": {"rope_type": "linear", "factor": 2.0}}},
    "llama_dynamic": {"rotary": {"scaling": {"rope_type": "dynamic", "factor": 2.0}}, "max_position_embeddings": 8},
    "llama_yarn": {"rotary": {"scaling": {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 16}}},
    "llama_llama3": {"rotary": {"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}},
    "mistral_window": {"family": "mistral", "attention": {"sliding_window": 3},
                       "layer_types": ("sliding_attention",) * 2},
    "qwen2_mixed_window": {"family": "qwen2", "attention": {"bias": True, "sliding_window": 2},
                           "layer_types": ("sliding_attention", "full_attention")},
    "gpt2": {"family": "gpt2"},
    "gpt2_untied": {"family": "gpt2", "tie_word_embeddings": False},
    "qwen3_window": {"family": "qwen3", "attention": {"qk_norm": "head", "bias": True, "output_bias": True,
                                                      "sliding_window": 2},
                     "layer_types": ("full_attention", "sliding_attention")},
}


def _model(case, rng, dtype=np.float64, scale=None, **extra):
    case = FAMILY_CASES[case]
    mlp = {**case.get("mlp", {}), **extra.pop("mlp", {})}
    cfg = tiny_config(**{**case, **extra, "mlp": mlp})
    lm = CausalLM(cfg, rng=rng).astype(dtype)
    if scale is not None:  # larger weights than the init so that every path matters
        for name, p in lm.named_parameters():
            if name.endswith(("gamma",)):
                p[...] = 1.0 + 0.3 * rng.standard_normal(p.shape)
            elif not name.endswith("beta"):
                p[...] = scale * rng.standard_normal(p.shape)
    return lm


def _left_padded(rng, vocab, lengths, total):
    ids = rng.integers(0, vocab, size=(len(lengths), total))
    mask = np.zeros((len(lengths), total), dtype=bool)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = True
    return ids, mask


@pytest.mark.parametrize("case", ["llama_gqa", "gpt2", "mistral_window", "llama_bias_gelu", "qwen3_window"])
def test_whole_model_gradients_by_finite_differences(case):
    rng = make_rng(len(case))
    lm = _model(case, rng, scale=0.3, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                mlp={"intermediate_size": 6}, vocab_size=7)
    ids, mask = _left_padded(rng, 7, [4, 2], 4)
    g = randn(rng, 2, 4, 7)

    def loss():
        return np.sum(lm(ids, mask) * g)

    lm.zero_grad()
    loss()
    lm.backward(g)
    grads = dict(lm.named_gradients())
    for name, p in lm.named_parameters():
        if name.endswith("b_K") and lm.rotary is None:
            # Without rotary a key bias adds the same score to every key of a query: softmax ignores it.
            assert np.max(np.abs(grads[name])) < 1e-12
            continue
        assert_gradient(loss, p, grads[name], name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_logits_and_gradients_match_hugging_face(case, dtype):
    rng = make_rng(len(case), 3)
    lm = _model(case, rng, scale=0.2)
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    theirs = hf_model(lm, tdtype)
    if dtype == np.float64:
        without_float32_internals(theirs, lm)
    lm.astype(dtype)
    ids, mask = _left_padded(rng, lm.config.vocab_size, [9, 6, 1], 9)
    g = randn(rng, *ids.shape, lm.config.vocab_size, dtype=dtype)
    g[~mask] = 0
    logits = lm(ids, mask)
    lm.backward(g)
    pos = positions_from_mask(mask, ids.shape[1])
    out = theirs(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                 position_ids=torch.from_numpy(pos))
    (out.logits * torch.from_numpy(g)).sum().backward()
    real = mask[..., None]
    hf_logits = out.logits.detach().numpy()
    assert logits.dtype == dtype and np.all(np.isfinite(logits))
    assert_close_rel(np.where(real, logits, 0), np.where(real, hf_logits, 0), dtype, f"{case} logits")
    hf_grads = {name: p.grad.numpy() for name, p in theirs.named_parameters()}
    mapping = _name_map(lm)
    for name, grad in lm.named_gradients():
        hf_name, transpose = mapping[name]
        expected = _hf_view(hf_grads[hf_name], name, lm, transpose)
        scale = None
        if name.endswith("b_K") and lm.rotary is None:
            # Mathematically zero without rotary (softmax ignores a per-query constant): both are rounding
            # noise, measured against the scale of the key weights' gradient.
            scale = float(np.max(np.abs(dict(lm.named_gradients())[name[:-3] + "W_K"])))
        assert_close_rel(grad, expected, dtype, f"{case} grad {name}", scale=scale)


def _name_map(lm):
    """attnkit parameter name -> (HF name, transpose) for the families built by decoder_cases.hf_model."""
    cfg = lm.config
    out = {}
    if cfg.family == "gpt2":
        out["embed.weight"] = ("transformer.wte.weight", False)
        out["pos_embed.weight"] = ("transformer.wpe.weight", False)
        for i in range(cfg.num_layers):
            pre, hf = f"layers.{i}.", f"transformer.h.{i}."
            for ours_norm, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[pre + ours_norm + ".gamma"] = (hf + theirs + ".weight", False)
                out[pre + ours_norm + ".beta"] = (hf + theirs + ".bias", False)
            for name in ("Q", "K", "V"):
                out[pre + f"attention.W_{name}"] = (hf + "attn.c_attn.weight", False)
                out[pre + f"attention.b_{name}"] = (hf + "attn.c_attn.bias", False)
            out[pre + "attention.W_O"] = (hf + "attn.c_proj.weight", False)
            out[pre + "attention.b_O"] = (hf + "attn.c_proj.bias", False)
            for ours_name, theirs in (("W1", "c_fc.weight"), ("b1", "c_fc.bias"), ("W2", "c_proj.weight"),
                                      ("b2", "c_proj.bias")):
                out[pre + "mlp." + ours_name] = (hf + "mlp." + theirs, False)
        out["norm.gamma"] = ("transformer.ln_f.weight", False)
        out["norm.beta"] = ("transformer.ln_f.bias", False)
        out["head.weight"] = ("lm_head.weight", False)
        return out
    out["embed.weight"] = ("model.embed_tokens.weight", False)
    for i in range(cfg.num_layers):
        pre, hf = f"layers.{i}.", f"model.layers.{i}."
        out[pre + "attn_norm.gamma"] = (hf + "input_layernorm.weight", False)
        out[pre + "mlp_norm.gamma"] = (hf + "post_attention_layernorm.weight", False)
        for norm in ("q_norm", "k_norm"):
            out[pre + f"attention.{norm}"] = (hf + f"self_attn.{norm}.weight", False)
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
            out[pre + f"attention.W_{name}"] = (hf + f"self_attn.{proj}.weight", True)
            out[pre + f"attention.b_{name}"] = (hf + f"self_attn.{proj}.bias", False)
        for name, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[pre + f"mlp.W_{name}"] = (hf + f"mlp.{proj}.weight", True)
            out[pre + f"mlp.b_{name}"] = (hf + f"mlp.{proj}.bias", False)
    out["norm.gamma"] = ("model.norm.weight", False)
    out["head.weight"] = ("lm_head.weight", False)
    return out


def _hf_view(hf_grad, name, lm, transpose):
    """The part of a HF gradient that corresponds to attnkit parameter ``name`` (GPT-2 fuses q, k, v)."""
    if lm.config.family == "gpt2" and ".attention." in name and name[-1] in "QKV" and "_O" not in name:
        d = lm.config.hidden_size
        part = "QKV".index(name[-1])
        return hf_grad[..., part * d:(part + 1) * d]
    return hf_grad.T if transpose else hf_grad


@pytest.mark.parametrize("case", ["llama_gqa", "mistral_window", "qwen2_mixed_window", "gpt2", "llama_dynamic"])
def test_left_padded_row_equals_the_row_alone(case):
    rng = make_rng(len(case), 5)
    lm = _model(case, rng, scale=0.3)
    ids, mask = _left_padded(rng, lm.config.vocab_size, [7, 4], 7)
    batch = lm(ids, mask)
    alone = lm(ids[1:, 3:])
    np.testing.assert_allclose(batch[1, 3:], alone[0], rtol=1e-12, atol=1e-13)
    assert np.all(np.isfinite(batch))


@pytest.mark.parametrize("case", ["llama_gqa", "mistral_window", "qwen2_mixed_window", "gpt2", "llama_mqa_tied"])
@pytest.mark.parametrize("max_length", [None, 12])
def test_cached_steps_equal_the_full_forward_past_the_window(case, max_length):
    rng = make_rng(len(case), 6)
    lm = _model(case, rng, scale=0.3)
    ids, mask = _left_padded(rng, lm.config.vocab_size, [11, 8], 11)
    full = lm(ids, mask)
    cache = lm.new_cache(2, max_length=max_length)
    pieces = [lm(ids[:, :4], mask[:, :4], cache=cache)]
    for t in range(4, 11):
        pieces.append(lm(ids[:, t:t + 1], mask[:, :t + 1], cache=cache))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-11, atol=1e-12)
    assert cache.length == 11
    with pytest.raises(RuntimeError, match="without a cache"):
        lm.backward(np.zeros_like(pieces[-1]))


def test_float32_model_and_cache_stay_float32():
    rng = make_rng(8)
    lm = _model("llama_gqa", rng, np.float32)
    cache = lm.new_cache(1)
    logits = lm(np.array([[1, 2, 3]]), cache=cache)
    assert logits.dtype == np.float32 and cache.dtype == np.float32


def test_parameter_names_follow_the_shared_interface():
    names = dict(CausalLM(tiny_config(), rng=0).named_parameters())
    assert {"embed.weight", "layers.0.attn_norm.gamma", "layers.1.attention.W_Q", "layers.1.attention.W_O",
            "layers.0.mlp.W_gate", "layers.0.mlp.W_up", "layers.0.mlp.W_down", "layers.0.mlp_norm.gamma",
            "norm.gamma", "head.weight"} == set(names) - {n for n in names if "attention.W_K" in n or
                                                          "attention.W_V" in n or n.startswith("layers.1.") and
                                                          "attention" not in n or "layers.0.attention" in n}
    assert names["layers.0.attention.W_K"].shape == (16, 8)
    gpt2 = dict(CausalLM(tiny_config("gpt2"), rng=0).named_parameters())
    assert "pos_embed.weight" in gpt2 and "head.weight" not in gpt2 and "layers.0.mlp.W1" in gpt2
    assert "layers.0.attention.b_O" in gpt2 and "layers.0.attn_norm.beta" in gpt2


@pytest.mark.parametrize("kwargs, match", [
    ({"input_ids": np.array([1, 2])}, "input_ids"),
    ({"input_ids": np.array([[1, 2]]), "attention_mask": np.ones((1, 3))}, "attention_mask"),
    ({"input_ids": np.array([[1, 2]]), "position_ids": np.array([[0]])}, "position_ids"),
    ({"input_ids": np.array([[1, 99]])}, "ids"),
])
def test_bad_inputs_name_themselves(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        CausalLM(tiny_config(), rng=0)(**kwargs)


def test_learned_positions_past_the_table_are_refused():
    lm = CausalLM(tiny_config("gpt2", max_position_embeddings=4), rng=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        lm(np.zeros((1, 5), dtype=np.int64))


@pytest.mark.parametrize("case", ["llama_mqa_tied", "gpt2_untied"])
def test_logits_to_keep_is_the_last_rows_and_their_exact_gradient(case):
    rng = make_rng(31, len(case))
    lm = _model(case, rng, scale=0.3)
    ids, mask = _left_padded(rng, 23, [5, 3], 5)
    full = lm(ids, mask)  # (2, 5, V)
    g = randn(rng, 2, 2, 23)
    lm.zero_grad()
    grad_full = lm.backward(np.concatenate([np.zeros((2, 3, 23)), g], axis=1))  # (2, 5, D)
    grads_full = {name: value.copy() for name, value in lm.grads.items()}
    lm.zero_grad()
    kept = lm(ids, mask, logits_to_keep=2)  # (2, 2, V)
    np.testing.assert_allclose(kept, full[:, -2:], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lm.backward(g), grad_full, rtol=1e-12, atol=1e-12)
    for name, value in lm.grads.items():
        np.testing.assert_allclose(value, grads_full[name], rtol=1e-12, atol=1e-12, err_msg=name)
    np.testing.assert_array_equal(lm(ids, mask, logits_to_keep=9), full)  # more than L keeps every row
    with pytest.raises(ValueError, match="logits_to_keep must be non-negative"):
        lm(ids, mask, logits_to_keep=-1)
    with pytest.raises(TypeError, match="logits_to_keep must be an integer"):
        lm(ids, mask, logits_to_keep=1.0)


def test_generation_computes_one_row_of_logits_per_step():
    """The prompt's prefill asks the head for its last position only; the tokens are those of full logits."""
    rng = make_rng(32)
    lm = _model("llama_gqa", rng, scale=0.3)
    shapes = []

    class Spy(CausalLM):
        def forward(self, *args, **kwargs):
            logits = super().forward(*args, **kwargs)
            shapes.append(logits.shape)
            return logits

    spy = Spy(lm.config)
    spy.load_state_dict(lm.state_dict())
    ids, mask = _left_padded(rng, 23, [6, 4], 6)
    out = spy.generate(ids, mask, max_new_tokens=4)
    assert shapes == [(2, 1, 23)] * 4
    history = ids  # greedy by hand, full logits every step: the same tokens
    for _ in range(4):
        step_mask = np.concatenate([mask, np.ones((2, history.shape[1] - 6), bool)], axis=1)
        history = np.concatenate([history, lm(history, step_mask)[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, history)
