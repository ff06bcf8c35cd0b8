"""Rows of different lengths given to an explanation are refused at its boundary by the model's own ``input_ids``
check, naming the argument: never NumPy's "inhomogeneous shape"."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit import explain
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

RAGGED = [[1, 2, 3], [4, 5]]
SAME = [[1, 2, 3], [1, 6, 3]]


@pytest.fixture(scope="module")
def lm():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    return CausalLM(cfg, rng=0)


class Letters:
    bos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [0] * add_special_tokens + [ord(c) - 96 for c in text]

    def decode(self, ids):
        return "".join(chr(i + 96) for i in ids)


# (call, the argument named): the ids of one sequence or a batch, and the other arguments that hold ids
CASES = [
    (lambda lm, tmp: explain.direct_logit_attribution(lm, RAGGED, target=1), "input_ids"),
    (lambda lm, tmp: explain.direct_logit_attribution(lm, SAME, target=[[1], [2, 3]]), "target"),
    (lambda lm, tmp: explain.run_with_cache(lm, RAGGED), "input_ids"),
    (lambda lm, tmp: explain.activation_patching(lm, RAGGED, SAME, (1, 2)), "clean_ids"),
    (lambda lm, tmp: explain.activation_patching(lm, SAME, RAGGED, (1, 2)), "corrupt_ids"),
    (lambda lm, tmp: explain.attribution_patching(lm, SAME, SAME, [[1, 2], [3]]), "answer_ids"),
    (lambda lm, tmp: explain.path_patching(lm, RAGGED, SAME, (1, 2), receivers=[(1, 0)]), "clean_ids"),
    (lambda lm, tmp: explain.logit_lens(lm, RAGGED), "ids"),
    (lambda lm, tmp: explain.gradient_x_input(lm, RAGGED), "ids"),
    (lambda lm, tmp: explain.saliency(lm, SAME, target_token=[[1, 2], [3]]), "target_token"),
    (lambda lm, tmp: explain.integrated_gradients(lm, RAGGED, target=1), "input_ids"),
    (lambda lm, tmp: explain.generation_attribution(lm, [1, 2], new_ids=[[3], [4, 5]]), "new_ids"),
    (lambda lm, tmp: explain.generation_attribution(lm, [1, 2], new_ids=[3, 4], foil=[[5], [6, 7]]), "foil"),
    (lambda lm, tmp: explain.explain_html(lm, RAGGED, tmp / "page.html"), "ids"),
    (lambda lm, tmp: explain.to_str_tokens(Letters(), RAGGED), "input"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_ragged_ids_are_refused_naming_the_argument(case, lm, tmp_path):
    call, name = CASES[case]
    with pytest.raises(ValueError, match=rf"^{name} must be a rectangular array: its rows have different lengths "
                                         rf"\[\d, \d\]"):
        call(lm, tmp_path)


def test_the_model_and_the_explanations_say_the_same(lm):
    """One check for all: the explanation's message is the model's own, with the argument's name."""
    with pytest.raises(ValueError) as model_error:
        lm(RAGGED)
    with pytest.raises(ValueError) as explain_error:
        explain.run_with_cache(lm, RAGGED)
    assert str(model_error.value) == str(explain_error.value)
    assert np.array_equal(explain.logit_lens(lm, SAME).token_ids.shape, (2, 2, 3, 5))  # rectangular rows still run
