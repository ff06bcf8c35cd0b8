"""load_causal_lm on tiny random HF models of every family (GPT-2 tied/untied, Llama GQA/MQA and each rope
scaling, Mistral with a window shorter than the text, Qwen2 with mixed full/sliding layers, a sharded
checkpoint): logits against HF on a left-padded batch, greedy tokens against HF generate, cached against
uncached decoding past the window, a padded batch against each row alone."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.decoding.sampling import generate  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import EOS, FAMILY_MODELS, hf_greedy, hf_logits, left_padded_batch, saved_model  # noqa: E402

LOGIT_TOL = 2e-5  # max |ours - HF| / max |HF| over the real positions, float32
NEAR_TIE = 1e-4  # relative gap of the two best logits under which float32 rounding may pick either
PARITY: dict[str, float] = {}


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_causal_lm")


_LOADED: dict[str, object] = {}


def loaded(name, root):
    """(attnkit model, hf model) of a saved tiny model, loaded once per session."""
    folder, hf = saved_model(name, root)
    if name not in _LOADED:
        _LOADED[name] = load_causal_lm(folder)
    return _LOADED[name], hf


def relative(ours, theirs, mask):
    ours, theirs = np.asarray(ours, np.float64)[mask], np.asarray(theirs, np.float64)[mask]
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_logits_match_hf_on_a_left_padded_batch(name, hf_root):
    lm, hf = loaded(name, hf_root)
    ids, mask = left_padded_batch(np.random.default_rng(0), (7, 12, 4))
    ours = lm(ids, mask)
    assert ours.dtype == np.float32 and ours.shape == (3, 12, 96)
    assert np.all(np.isfinite(ours))  # padded positions too
    err = relative(ours, hf_logits(hf, ids, mask), mask)
    PARITY[name] = err
    print(f"{name}: max relative logit difference to HF {err:.2e}")
    assert err <= LOGIT_TOL


def first_divergence_is_a_near_tie(lm, ours, theirs, mask_prompt):
    """Where two greedy continuations first differ, the two best logits of that step must nearly tie."""
    for row in range(ours.shape[0]):
        differ = np.flatnonzero(ours[row] != theirs[row])
        if differ.size == 0:
            continue
        at = differ[0]
        prefix = ours[row:row + 1, :at]
        row_mask = np.concatenate([mask_prompt[row:row + 1], np.ones((1, at - mask_prompt.shape[1]), bool)], 1)
        last = np.asarray(lm(prefix, row_mask)[0, -1], np.float64)
        top2 = np.sort(last)[-2:]
        assert top2[1] - top2[0] <= NEAR_TIE * np.max(np.abs(last)), (row, at, top2)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_greedy_tokens_equal_hf_generate(name, hf_root):
    lm, hf = loaded(name, hf_root)
    ids, mask = left_padded_batch(np.random.default_rng(1), (5, 3))
    ours = generate(lm, ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=0)
    theirs = hf_greedy(hf, ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=0)
    assert ours.shape == theirs.shape
    first_divergence_is_a_near_tie(lm, ours, theirs, mask)


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_mixed", "qwen2_layer_types", "llama_dynamic", "gpt2",
                                  "qwen3_window", "smollm3_window", "gemma2", "gemma3_text", "gemma4_text",
                                  "olmo3", "glm4", "granite",
                                  "phi3_longrope", "phi3_partial_window", "gpt_oss", "gpt_oss_clamped",
                                  "qwen3_5_text",
                                  "qwen3_5_moe_text", "qwen3_next", "qwen3_moe", "qwen3_moe_window", "mixtral",
                                  "deepseek_v3", "deepseek_v3_plain", "deepseek_v32", "deepseek_v32_mixed", "lfm2",
                                  "lfm2_bias", "bamba", "bamba_bias", "seed_oss", "exaone4", "ernie4_5",
                                  "hunyuan_v1_dense", "apertus", "glm4_moe", "glm4_moe_plain", "granitemoehybrid",
                                  "granitemoehybrid_dense", "nemotron_h", "nemotron_h_bias", "falcon_h1",
                                  "falcon_h1_bias", "kimi_linear", "kimi_linear_plain", "llama4_text",
                                  "llama4_text_tuned"])
def test_cached_generation_equals_uncached_argmax_past_the_window(name, hf_root):
    lm, _ = loaded(name, hf_root)
    ids, mask = left_padded_batch(np.random.default_rng(2), (3, 2))
    cached = generate(lm, ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    seq, seq_mask = ids.copy(), mask.copy()
    for _ in range(12):  # the whole text again at every step, no cache
        logits = lm(seq, seq_mask)[:, -1]
        seq = np.concatenate([seq, np.argmax(logits, axis=-1)[:, None]], axis=1)
        seq_mask = np.concatenate([seq_mask, np.ones((2, 1), bool)], axis=1)
    assert seq.shape[1] > 4 + 3  # well past the windows (4 and 3) of the sliding layers
    first_divergence_is_a_near_tie(lm, cached, seq, mask)


# Not lfm2_bias, bamba_bias, granitemoehybrid_dense and nemotron_h_bias: as in transformers, a padded position's
# input is zeroed before projections with biases, so those biases reach the convolution window of a row's first
# real tokens.
@pytest.mark.parametrize("name", ["llama_gqa", "gpt2_untied", "qwen2_mixed", "mistral_window", "qwen3", "olmo2",
                                  "gpt_neox", "gpt_oss", "qwen3_5_text",
                                  "qwen3_5_moe_text", "qwen3_next", "qwen3_moe", "qwen3_moe_window",
                                  "mixtral", "gemma4_text", "deepseek_v3", "deepseek_v3_plain", "deepseek_v32",
                                  "deepseek_v32_mixed", "lfm2", "bamba", "olmo3", "glm4", "granite", "seed_oss",
                                  "exaone4", "ernie4_5", "hunyuan_v1_dense", "apertus", "glm4_moe", "glm4_moe_plain",
                                  "granitemoehybrid", "nemotron_h", "falcon_h1", "falcon_h1_bias", "kimi_linear",
                                  "kimi_linear_plain", "llama4_text", "llama4_text_tuned"])
def test_left_padded_batch_equals_each_row_alone(name, hf_root):
    lm, _ = loaded(name, hf_root)
    lengths = (6, 2, 4)
    ids, mask = left_padded_batch(np.random.default_rng(3), lengths)
    batch = lm(ids, mask)
    out = generate(lm, ids, mask, max_new_tokens=6, eos_token_id=[])
    for row, n in enumerate(lengths):
        alone = lm(ids[row:row + 1, -n:])
        err = relative(batch[row:row + 1, -n:], alone, np.ones(alone.shape[:2], bool))
        assert err <= 1e-5, (row, err)
        solo = generate(lm, ids[row:row + 1, -n:], max_new_tokens=6, eos_token_id=[])
        np.testing.assert_array_equal(out[row, -6:], solo[0, -6:])


def test_llama4_query_temperature_matches_hf_by_position(hf_root):
    """With the temperature acting (floor_scale 2), logits and greedy tokens equal transformers' on unpadded rows, and
    a left-padded row equals transformers' run of that row alone: attnkit counts a row's positions from its first
    real token, transformers the cache's slots (pads included), so on padded rows only the former is the row's."""
    lm, hf = loaded("llama4_text_tuned", hf_root)
    ids = np.random.default_rng(9).integers(2, 90, (2, 11))
    err = relative(lm(ids), hf_logits(hf, ids, np.ones(ids.shape, bool)), np.ones(ids.shape, bool))
    PARITY["llama4_text_tuned"] = err
    assert err <= LOGIT_TOL
    ours = generate(lm, ids[:, :5], max_new_tokens=8, eos_token_id=EOS, pad_token_id=0)
    theirs = hf_greedy(hf, ids[:, :5], np.ones((2, 5), bool), max_new_tokens=8, eos_token_id=EOS, pad_token_id=0)
    first_divergence_is_a_near_tie(lm, ours, theirs, np.ones((2, 5), bool))
    padded, mask = left_padded_batch(np.random.default_rng(10), (9, 4))
    batch = lm(padded, mask)
    for row, n in enumerate((9, 4)):
        alone = padded[row:row + 1, -n:]
        theirs = hf_logits(hf, alone, np.ones(alone.shape, bool))
        assert relative(batch[row:row + 1, -n:], theirs, np.ones(alone.shape, bool)) <= LOGIT_TOL
    assert relative(batch, hf_logits(hf, padded, mask), mask) > 1e-3  # transformers' padded row is another text


# HF computes rotary cos/sin in float32 even for a float64 model, which bounds the rotary families' agreement.
@pytest.mark.parametrize("name, tol", [("gpt2_untied", 1e-12), ("llama_gqa", 1e-6)])
def test_float64_load_matches_float64_hf(name, tol, hf_root):
    folder, hf = saved_model(name, hf_root)
    lm = load_causal_lm(folder, dtype=np.float64)
    ids, mask = left_padded_batch(np.random.default_rng(4), (5, 8))
    ours = lm(ids, mask)
    assert ours.dtype == np.float64
    # HF's eager attention yields NaN in float64 with left padding; its sdpa path is the float64 reference.
    hf.double().set_attn_implementation("sdpa")
    try:
        err = relative(ours, hf_logits(hf, ids, mask), mask)
    finally:
        hf.float().set_attn_implementation("eager")
    print(f"{name} float64: max relative logit difference to HF {err:.2e}")
    assert err <= tol


def test_model_carries_its_config_and_generate_delegates(hf_root):
    lm, _ = loaded("qwen2_mixed", hf_root)
    assert lm.config.family == "qwen2" and lm.config.layer_types[1] == "sliding_attention"
    prompt = np.array([[5, 6, 7]])
    np.testing.assert_array_equal(lm.generate(prompt, max_new_tokens=4, do_sample=True, seed=3),
                                  generate(lm, prompt, max_new_tokens=4, do_sample=True, seed=3))


def test_no_torch_or_transformers_imported_at_runtime(hf_root, tmp_path):
    import subprocess
    import sys

    folder, _ = saved_model("llama_mqa", hf_root)
    code = ("import sys, numpy as np; from attnkit.pretrained import load_causal_lm; "
            f"lm = load_causal_lm({str(folder)!r}); "
            "from attnkit.decoding.sampling import generate; generate(lm, np.array([[1, 2]]), max_new_tokens=2); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05),
                                      dict(temperature=1.3, top_p=0.6), dict(top_k=3, min_p=0.3),
                                      dict(temperature=0.5)])
def test_warp_logits_equals_the_processor_list_hf_generate_builds(settings, hf_root):
    from transformers import GenerationConfig

    from attnkit.decoding.sampling import warp_logits

    _, hf = loaded("llama_gqa", hf_root)
    full = {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None, **settings}
    procs = hf._get_logits_processor(GenerationConfig(do_sample=True, **full), input_ids_seq_length=1)
    logits = (np.random.default_rng(8).standard_normal((6, 96)) * 3).astype(np.float32)
    theirs = procs(torch.zeros((6, 1), dtype=torch.long), torch.from_numpy(logits)).numpy()
    ours = warp_logits(logits, **settings)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    np.testing.assert_allclose(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)], rtol=1e-6)


BEAM_SETTINGS = [dict(num_beams=3), dict(num_beams=4, length_penalty=0.5, early_stopping=True, num_return_sequences=2),
                 dict(num_beams=2, length_penalty=2.0, early_stopping="never", num_return_sequences=2),
                 dict(num_beams=3, num_return_sequences=3, repetition_penalty=1.3, no_repeat_ngram_size=2,
                      min_new_tokens=3)]


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "qwen2_mixed", "mistral_window", "gemma2", "phi3_longrope",
                                  "gpt_oss", "qwen3_5_text",
                                  "qwen3_5_moe_text", "qwen3_next", "qwen3_moe", "mixtral", "gemma4_text",
                                  "deepseek_v3", "deepseek_v3_plain", "deepseek_v32", "deepseek_v32_mixed", "lfm2",
                                  "lfm2_bias", "bamba", "bamba_bias", "olmo3", "glm4", "granite", "seed_oss", "exaone4",
                                  "ernie4_5", "hunyuan_v1_dense", "apertus", "glm4_moe", "glm4_moe_plain",
                                  "granitemoehybrid", "granitemoehybrid_dense", "nemotron_h", "nemotron_h_bias",
                                  "falcon_h1", "falcon_h1_bias", "kimi_linear", "kimi_linear_plain", "llama4_text"])
@pytest.mark.parametrize("setting", range(len(BEAM_SETTINGS)))
def test_beam_search_equals_transformers(name, setting, hf_root):
    """Sequences equal to transformers' generate(num_beams=...) token for token, on a left-padded batch, with
    an eos list that ends some hypotheses early (a token the model often picks), so finished beams, padding
    after eos and the early-stopping rules all take part."""
    lm, hf = loaded(name, hf_root)
    ids, mask = left_padded_batch(np.random.default_rng(1), (5, 3))
    often = int(np.bincount(generate(lm, ids, mask, max_new_tokens=8, eos_token_id=[])[:, 5:].ravel()).argmax())
    options = dict(BEAM_SETTINGS[setting], max_new_tokens=8, eos_token_id=[EOS, often], pad_token_id=0)
    ours = generate(lm, ids, mask, **options)
    with torch.no_grad():
        theirs = hf.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                             do_sample=False, top_k=None, top_p=None, temperature=None, **options).numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert ours.shape[0] == 2 * options.get("num_return_sequences", 1)


def test_beam_search_reaches_eos_in_these_settings(hf_root):
    lm, _ = loaded("llama_gqa", hf_root)
    ids, mask = left_padded_batch(np.random.default_rng(1), (5, 3))
    often = int(np.bincount(generate(lm, ids, mask, max_new_tokens=8, eos_token_id=[])[:, 5:].ravel()).argmax())
    out = generate(lm, ids, mask, max_new_tokens=8, num_beams=4, num_return_sequences=4, eos_token_id=[often],
                   pad_token_id=0)
    assert np.any(out[:, 5:] == often)  # some hypotheses finished on the eos


def test_beam_search_arguments_are_checked(hf_root):
    lm, _ = loaded("llama_gqa", hf_root)
    ids = np.array([[3, 4, 5]])
    for options, message in ((dict(num_beams=2, do_sample=True), "beam sampling"),
                             (dict(num_beams=2, num_return_sequences=3), "at most num_beams"),
                             (dict(num_beams=2, early_stopping="sometimes"), "early_stopping"),
                             (dict(num_beams=2, length_penalty=float("nan")), "length_penalty"),
                             (dict(num_beams=0), "num_beams")):
        with pytest.raises((ValueError, TypeError), match=message):
            generate(lm, ids, max_new_tokens=3, **options)
    one = generate(lm, ids, max_new_tokens=5, num_beams=1, eos_token_id=[])
    np.testing.assert_array_equal(one, generate(lm, ids, max_new_tokens=5, eos_token_id=[]))
