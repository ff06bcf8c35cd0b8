"""A cache goes back to a marked length and continues as if it had never gone further: for every family
(recurrent states, ring buffers, latents and shared keys included) the logits equal a fresh prefill of the
same ids."""
import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

# Rotary scalings that change with the sequence's length make cached and uncached runs differ by design.
LENGTH_DEPENDENT = ("llama_dynamic", "phi3_longrope")


@pytest.mark.parametrize("name", [name for name in FAMILY_MODELS if name not in LENGTH_DEPENDENT])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_going_back_to_a_mark_and_continuing_equals_a_fresh_prefill(tmp_path, name, dtype):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=dtype)
    ids = np.random.default_rng(11).integers(0, lm.config.vocab_size, size=(2, 13))
    other = (ids + 1) % lm.config.vocab_size  # a different continuation, decoded and then taken back
    cache = lm.new_cache(2)
    lm(ids[:, :6], cache=cache)
    assert cache.mark() == 6
    lm(other[:, 6:9], cache=cache)  # a chunk, then single steps
    for t in range(9, 11):
        lm(other[:, t:t + 1], cache=cache)
    cache.crop(6)
    assert cache.length == 6 and cache.token_ids.tolist() == ids[:, :6].tolist()
    got = lm(ids[:, 6:12], cache=cache)  # (B, 6, V)
    stepped = lm(ids[:, 12:13], cache=cache)  # (B, 1, V): a step after the restored prefix
    want = lm(ids)  # (B, 13, V)
    tolerance = 1e-11 if dtype == np.float64 else 1e-5
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want[:, 6:12], rtol=tolerance, atol=tolerance * scale)
    np.testing.assert_allclose(stepped, want[:, 12:], rtol=tolerance, atol=tolerance * scale)
