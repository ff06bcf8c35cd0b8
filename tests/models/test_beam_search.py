"""One beam search: a decoding state (the encoder-decoder's interface) and a decoder-only LM's KV cache drive
the same function and give the same hypotheses."""
import numpy as np
import pytest

from attnkit.decoding.beam_search import beam_search
from attnkit.models import CausalLM
from decoder_cases import tiny_config

from helpers import make_rng


class LMState:
    """A CausalLM behind the ``step``/``reorder`` interface an encoder-decoder's decoding state has."""

    def __init__(self, lm, context, total):
        self.lm, self.cache = lm, lm.new_cache(context.shape[0], max_length=context.shape[1] + total)
        lm(context, cache=self.cache)  # each row's own context before the search's first token

    def step(self, tokens, t):
        logits = self.lm(tokens[:, None], cache=self.cache)[:, -1].astype(np.float64)  # (R, V)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    def reorder(self, index):
        self.cache.reorder(index)


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never"),
                                                             (-1.0, False)])
def test_a_decoding_state_and_the_kv_cache_run_the_same_search(length_penalty, early_stopping):
    rng = make_rng(41)
    lm = CausalLM(tiny_config(vocab_size=9), rng=rng).astype(np.float32)
    for _, p in lm.named_parameters():
        p[...] = 0.4 * rng.standard_normal(p.shape)  # peaked enough that eos ends some hypotheses early
    bos, eos, pad, beams, new = 1, 5, 7, 3, 6  # 5: a token this model often picks, so hypotheses end early
    context = np.array([[3, 4, 0], [6, 8, 3]])
    through_state = beam_search(LMState(lm, context, 1 + new), 2, num_beams=beams, bos_token_id=bos,
                                eos_token_id=eos, max_new_tokens=new, length_penalty=length_penalty,
                                pad_token_id=pad, early_stopping=early_stopping)
    prompts = np.concatenate([context, np.full((2, 1), bos)], axis=1)  # (2, 4)
    through_cache = lm.generate(prompts, num_beams=beams, max_new_tokens=new, eos_token_id=eos, pad_token_id=pad,
                                length_penalty=length_penalty, early_stopping=early_stopping)
    np.testing.assert_array_equal(through_state, through_cache[:, context.shape[1]:])
    assert (through_state[:, 0] == bos).all()
    assert not np.array_equal(through_state[0], through_state[1])  # the rows' contexts matter
