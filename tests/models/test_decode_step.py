"""A decoding step runs through every layer's own ``step``: for every family, the same logits as the whole
sequence run without a cache, on a left-padded batch, and the sequence path wherever a caller asks for what only
it gives (attention weights, hooks)."""
import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

# Rotary scalings that change with the sequence's length (dynamic NTK past the context, longrope's switch of
# factors) make a cached step differ from the whole sequence by design, as in transformers.
LENGTH_DEPENDENT = ("llama_dynamic", "phi3_longrope")


def _stepped(lm, ids, mask, prompt):
    """Logits (B, L - prompt, V) of the positions after ``prompt``, decoded one token per row after a prefill."""
    cache = lm.new_cache(ids.shape[0])
    lm(ids[:, :prompt], mask[:, :prompt], cache=cache)
    out = [lm(ids[:, t:t + 1], mask[:, :t + 1], cache=cache) for t in range(prompt, ids.shape[1] - 1)]
    return np.concatenate(out, axis=1)


def _count_steps(lm, monkeypatch):
    """Wrap every block's ``step`` and ``forward``; returns the calls counted as {"step": n, "forward": n}."""
    calls = {"step": 0, "forward": 0}
    for layer in lm.layers:
        for name in calls:
            bound = getattr(layer, name)

            def counted(*args, _bound=bound, _name=name, **kwargs):
                calls[_name] += 1
                return _bound(*args, **kwargs)
            monkeypatch.setitem(layer.__dict__, name, counted)
    return calls


@pytest.mark.parametrize("name", [name for name in FAMILY_MODELS if name not in LENGTH_DEPENDENT])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_steps_equal_the_uncached_sequence_on_a_padded_batch(tmp_path, monkeypatch, name, dtype):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=dtype)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, lm.config.vocab_size, size=(3, 11))
    mask = np.ones(ids.shape, bool)
    mask[1, :3] = mask[2, :1] = False  # left padding: rows of 8 and 10 real tokens beside one of 11
    ids[~mask] = 0
    want = lm(ids, mask)[:, 6:-1]  # (B, 4, V): the logits after inputs 6 to 9, the steps' inputs
    calls = _count_steps(lm, monkeypatch)
    got = _stepped(lm, ids, mask, prompt=6)
    assert calls == {"step": 4 * lm.config.num_layers, "forward": lm.config.num_layers}  # one prefill, then steps
    assert got.dtype == want.dtype == dtype
    tolerance = 1e-11 if dtype == np.float64 else 3e-5
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_every_part_of_a_step_has_a_step_of_its_own(tmp_path, monkeypatch, name):
    """No module on any family's decoding path falls back to ``Module.step`` (its forward on a sequence of one)."""
    from attnkit.core.module import Module

    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder)
    cache = lm.new_cache(2)
    lm(np.array([[0, 5, 6], [4, 5, 6]]), np.array([[False, True, True], [True, True, True]]), cache=cache)

    def refused(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} decodes through Module.step's forward on a sequence of one")

    monkeypatch.setattr(Module, "step", refused)
    calls = _count_steps(lm, monkeypatch)
    logits = lm(np.array([[7], [8]]), np.ones((2, 4), bool), cache=cache)
    assert logits.shape == (2, 1, lm.config.vocab_size) and calls["step"] == lm.config.num_layers


@pytest.mark.parametrize("name", ["llama_gqa", "gemma2", "gpt_oss", "qwen3_next", "gemma4_text", "deepseek_v3"])
def test_greedy_tokens_of_the_steps_equal_the_sequence_path(tmp_path, monkeypatch, name):
    """Greedy decoding of a batch equals decoding with a hook installed (a hook that changes nothing, which
    sends every step through the sequence path), token for token."""
    folder, _ = saved_model(name, tmp_path)
    fast, slow = load_causal_lm(folder, dtype=np.float64), load_causal_lm(folder, dtype=np.float64)
    slow.add_hook("hook_embed", lambda value, name: None, full_name="hook_embed")
    calls = _count_steps(slow, monkeypatch)
    ids = np.random.default_rng(3).integers(0, fast.config.vocab_size, size=(2, 5))
    new = dict(max_new_tokens=8, min_new_tokens=8, eos_token_id=[])
    np.testing.assert_array_equal(fast.generate(ids, **new), slow.generate(ids, **new))
    assert calls["step"] == 0 and calls["forward"] == 8 * slow.config.num_layers


def test_weights_asked_for_take_the_sequence_path(tmp_path, monkeypatch):
    folder, _ = saved_model("llama_gqa", tmp_path)
    lm = load_causal_lm(folder)
    ids = np.array([[5, 6, 7]])
    cache = lm.new_cache(1)
    lm(ids, cache=cache)
    calls = _count_steps(lm, monkeypatch)
    logits, weights = lm(np.array([[4]]), cache=cache, output_attentions=True)
    assert logits.shape == (1, 1, lm.config.vocab_size) and weights[0].shape[-1] == 4
    assert calls == {"step": 0, "forward": lm.config.num_layers}


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_5_text"])
def test_a_hook_sends_the_step_through_the_modules_that_call_it(tmp_path, name):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder)
    seen = []
    lm.layers[1].add_hook("hook_resid_post", lambda value, name: seen.append(value.shape),
                          full_name="blocks.1.hook_resid_post")
    cache = lm.new_cache(1)
    for ids in ([[1, 2, 3]], [[4]], [[5]]):
        lm(np.array(ids), cache=cache)
    d = lm.config.hidden_size
    assert seen == [(1, 3, d), (1, 1, d), (1, 1, d)]


def test_the_decoding_blas_threads_are_chosen_by_the_tokens_of_a_call(tmp_path, monkeypatch):
    """A model forward asks kernels._threads.decode_blas with its token count (B * L), so the tuned
    single_blas_rows decides batch-1 and small-batch decoding steps alike."""
    from contextlib import nullcontext

    from attnkit.models import causal_lm

    folder, _ = saved_model("llama_gqa", tmp_path)
    lm = load_causal_lm(folder)
    asked = []
    monkeypatch.setattr(causal_lm, "decode_blas", lambda tokens: asked.append(tokens) or nullcontext())
    ids = np.array([[1, 2, 3, 4]] * 3)  # (3, 4)
    cache = lm.new_cache(3)
    lm(ids, cache=cache)  # a prefill of 3 x 4 tokens
    lm(ids[:, :1], cache=cache)  # a step: one token per row
    lm(ids[:1, :1])  # one token, no cache
    assert asked == [12, 3, 1]
