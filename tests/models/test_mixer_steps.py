"""Decoding the families of linear attention, Mamba-2, latent attention and mixtures of experts: every part of a
decoding step runs a ``step`` of its own (``Module.step``'s forward on a sequence of one is never reached), and
twelve greedy tokens of a left-padded batch through the steps are the tokens of the uncached forward run on the
whole sequence each time, with the same logits (float64 to 1e-11, float32 to 3e-5 relative, as the other step
tests)."""
import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit.attention.latent import MultiHeadLatentAttention  # noqa: E402
from attnkit.core.module import Module  # noqa: E402
from attnkit.layers.experts import MixtureOfExperts  # noqa: E402
from attnkit.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from attnkit.layers.mamba2 import Mamba2  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import left_padded_batch, saved_model  # noqa: E402

# family -> the classes whose own step its decoding must run (Kimi Delta Attention is a GatedDeltaNet)
FAMILIES = {
    "qwen3_next": (GatedDeltaNet, MixtureOfExperts),
    "qwen3_5_text": (GatedDeltaNet,),
    "qwen3_5_moe_text": (GatedDeltaNet, MixtureOfExperts),
    "kimi_linear": (GatedDeltaNet, MultiHeadLatentAttention, MixtureOfExperts),
    "bamba": (Mamba2,),
    "granitemoehybrid": (Mamba2, MixtureOfExperts),
    "nemotron_h": (Mamba2,),
    "falcon_h1": (Mamba2,),
    "deepseek_v3": (MultiHeadLatentAttention, MixtureOfExperts),
    "deepseek_v32": (MultiHeadLatentAttention, MixtureOfExperts),
    "gpt_oss": (MixtureOfExperts,),
    "qwen3_moe": (MixtureOfExperts,),
    "mixtral": (MixtureOfExperts,),
}
NEW_TOKENS = 12


def _count_steps(monkeypatch, classes) -> dict:
    """Count the calls of each class's own step; make ``Module.step`` (the sequence-of-one default) fail."""
    calls = {cls: 0 for cls in classes}

    def refused(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} decoded through Module.step's forward on a sequence of one")

    monkeypatch.setattr(Module, "step", refused)
    for cls in classes:
        own = cls.step

        def counted(self, *args, _own=own, _cls=cls, **kwargs):
            calls[_cls] += 1
            return _own(self, *args, **kwargs)
        monkeypatch.setattr(cls, "step", counted)
    return calls


def _greedy_by_steps(lm, ids, mask):
    """Greedy tokens (B, T) and the logits (B, T, V) each was chosen from, decoded with a cache one token a step."""
    cache = lm.new_cache(ids.shape[0])
    logits = lm(ids, mask, cache=cache)[:, -1]  # (B, V)
    tokens, chosen_from = [], []
    for _ in range(NEW_TOKENS):
        chosen_from.append(logits)
        tokens.append(logits.argmax(axis=-1))  # (B,)
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), bool)], axis=1)  # (B, P + 1)
        logits = lm(tokens[-1][:, None], mask, cache=cache)[:, 0]  # (B, V)
    return np.stack(tokens, axis=1), np.stack(chosen_from, axis=1)


def _greedy_by_sequence(lm, ids, mask):
    """The same, every token from the uncached forward of the whole sequence so far."""
    tokens, chosen_from = [], []
    for _ in range(NEW_TOKENS):
        logits = lm(ids, mask)[:, -1]  # (B, V)
        chosen_from.append(logits)
        tokens.append(logits.argmax(axis=-1))  # (B,)
        ids = np.concatenate([ids, tokens[-1][:, None]], axis=1)  # (B, L + 1)
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), bool)], axis=1)  # (B, L + 1)
    return np.stack(tokens, axis=1), np.stack(chosen_from, axis=1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_steps_equal_the_uncached_sequence(tmp_path, monkeypatch, name, dtype):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=dtype)
    ids, mask = left_padded_batch(np.random.default_rng(5), (6, 4))  # row 1 left-padded by two
    want_tokens, want_logits = _greedy_by_sequence(lm, ids, mask)
    calls = _count_steps(monkeypatch, FAMILIES[name])
    got_tokens, got_logits = _greedy_by_steps(lm, ids, mask)
    assert all(calls[cls] > 0 for cls in FAMILIES[name]), calls
    assert got_logits.dtype == dtype
    tolerance = 1e-11 if dtype == np.float64 else 3e-5
    np.testing.assert_allclose(got_logits, want_logits, rtol=tolerance, atol=tolerance * np.abs(want_logits).max())
    np.testing.assert_array_equal(got_tokens, want_tokens)
