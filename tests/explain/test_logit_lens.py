"""logit_lens against the same computation on Hugging Face's output_hidden_states."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from attnkit.explain import logit_lens  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = np.array([5, 17, 3, 60, 42, 9, 77])


def hf_lens_probs(hf, ids):
    """(N, L, V) float64: every block's output through HF's final norm and lm_head (the last is already normed)."""
    final_norm = hf.transformer.ln_f if hasattr(hf, "transformer") else hf.model.norm
    with torch.no_grad():
        states = hf(torch.from_numpy(ids[None]), output_hidden_states=True).hidden_states[1:]
        logits = [hf.lm_head(final_norm(h)) for h in states[:-1]] + [hf.lm_head(states[-1])]
        return np.stack([torch.softmax(z[0].double(), -1).numpy() for z in logits])


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "qwen2_mixed"])
def test_matches_hf_hidden_states(name, tmp_path):
    folder, hf = saved_model(name, tmp_path)
    lm = load_causal_lm(folder)
    want = hf_lens_probs(hf, IDS)  # (N, L, V)
    lens = logit_lens(lm, IDS, top_k=5)
    assert lens.token_ids.shape == lens.probs.shape == (lm.config.num_layers, len(IDS), 5)
    np.testing.assert_allclose(lens.probs, np.take_along_axis(want, lens.token_ids, -1), atol=2e-6)
    np.testing.assert_allclose(lens.probs, -np.sort(-want, -1)[..., :5], atol=2e-6)
    assert (np.diff(lens.probs, axis=-1) <= 0).all()
    # The last layer is the model's own output.
    logits = lm(IDS[None])[0]
    np.testing.assert_array_equal(lens.token_ids[-1, :, 0], logits.argmax(-1))
    assert not np.array_equal(lens.token_ids[0], lens.token_ids[-1])  # layers differ: the lens is not a copy


def test_batch_and_errors():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=0)
    batch = np.array([[1, 2, 3], [4, 5, 6]])
    lens = logit_lens(lm, batch, top_k=13)
    assert lens.probs.shape == (2, 2, 3, 13)
    np.testing.assert_allclose(lens.probs.sum(-1), 1, atol=1e-5)
    np.testing.assert_array_equal(logit_lens(lm, batch[1], top_k=13).token_ids, lens.token_ids[1])
    for bad, error, message in ((0, ValueError, "positive, got 0"), (14, ValueError, "at most 13, got 14"),
                                (2.0, TypeError, "an integer, got float"), (True, TypeError, "an integer, got bool")):
        with pytest.raises(error, match=f"top_k must be {message}"):
            logit_lens(lm, batch, top_k=bad)
