"""The in-place decoding step: the same tokens and logits as the general path, and the general path wherever
it does not serve (other layer kinds, padding, hooks, weights asked for)."""
import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit.models.decode_step import DecodeStep, decode_step_for  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402


def _general(lm):
    """``lm`` made to take the general path for every step."""
    object.__setattr__(lm, "_step", None)
    return lm


def _steps(lm, ids, mask=None, count=5):
    """Logits of a prompt's forward and ``count`` single-token steps after it, (B, count, V)."""
    cache = lm.new_cache(ids.shape[0])
    lm(ids, mask, cache=cache)
    rows, out = ids.shape[0], []
    for t in range(count):
        token = np.full((rows, 1), 3 + t)
        mask = None if mask is None else np.concatenate([mask, np.ones((rows, 1), bool)], axis=1)
        out.append(lm(token, mask, cache=cache))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa"])  # biases and an untied head; a tied head, MQA
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 3])
def test_steps_equal_the_general_path(tmp_path, name, dtype, rows):
    folder, _ = saved_model(name, tmp_path)
    fast, general = load_causal_lm(folder, dtype=dtype), _general(load_causal_lm(folder, dtype=dtype))
    assert isinstance(decode_step_for(fast), DecodeStep)
    ids = np.random.default_rng(rows).integers(0, fast.config.vocab_size, size=(rows, 6))
    got, want = _steps(fast, ids), _steps(general, ids)
    assert got.dtype == want.dtype == dtype and isinstance(fast.__dict__["_step"], DecodeStep)
    tolerance = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    new = dict(max_new_tokens=8, min_new_tokens=8, eos_token_id=[])
    np.testing.assert_array_equal(fast.generate(ids, **new), general.generate(ids, **new))


@pytest.mark.parametrize("name", ["gpt2", "gemma2", "mistral_window", "qwen3", "olmo2", "gpt_neox", "gpt_oss"])
def test_layers_it_does_not_know_take_the_general_path(tmp_path, name):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder)
    assert decode_step_for(lm) is None
    ids = np.array([[1, 2, 3]])
    lm.generate(ids, max_new_tokens=2, eos_token_id=[])
    assert lm.__dict__["_step"] is None


def test_padding_and_weights_take_the_general_path(tmp_path, monkeypatch):
    folder, _ = saved_model("llama_gqa", tmp_path)
    lm = load_causal_lm(folder)
    called = []
    monkeypatch.setattr(DecodeStep, "step", lambda self, *a: called.append(a) or pytest.fail("in-place step ran"))
    padded = np.array([[True, False, True, True]])
    ids = np.array([[5, 0, 6, 7]])
    _steps(lm, ids, padded, count=2)
    cache = lm.new_cache(1)
    lm(ids, cache=cache)
    logits, weights = lm(np.array([[4]]), cache=cache, output_attentions=True)
    assert logits.shape == (1, 1, lm.config.vocab_size) and weights[0].shape[-1] == 5 and not called


def test_a_hook_sends_the_step_through_the_modules_that_call_it(tmp_path):
    folder, _ = saved_model("llama_gqa", tmp_path)
    lm = load_causal_lm(folder)
    seen = []
    lm.layers[1].add_hook("hook_resid_post", lambda value, name: seen.append(value.shape),
                          full_name="blocks.1.hook_resid_post")
    ids = np.array([[1, 2, 3]])
    _steps(lm, ids, count=2)
    assert seen == [(1, 3, lm.config.hidden_size), (1, 1, lm.config.hidden_size), (1, 1, lm.config.hidden_size)]
