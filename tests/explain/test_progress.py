"""The long-running explain functions take ``progress=``: True draws a line on stderr that counts every step to
the end, False writes nothing; the results are the same either way."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit import _progress
from attnkit.explain import (
    activation_patching,
    attribution_patching,
    edge_attribution,
    explain_html,
    integrated_gradients,
    path_patching,
)
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

CFG = DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1,
                    head_dim=4, mlp=MLPConfig(12))
CLEAN, CORRUPT, ANSWERS = [1, 2, 3, 4], [1, 5, 3, 4], (6, 7)


@pytest.fixture
def plain(monkeypatch):
    """The plain line (as without tqdm), drawn at every step, so that its last drawing is the full count."""
    monkeypatch.setattr(_progress, "_tqdm", lambda: None)
    monkeypatch.setattr(_progress, "_REFRESH", 0.0)


@pytest.fixture
def lm():
    return CausalLM(CFG, rng=0).astype(np.float64)


def _last_drawn(err: str) -> str:
    return [part for part in err.split("\r") if part.strip()][-1]


CALLS = {
    # name: (call, what its finished line says): N = 3 layers
    "activation patching": (lambda lm, progress: activation_patching(lm, CLEAN, CORRUPT, ANSWERS, hook="z",
                                                                      progress=progress),
                            "activation patching (z): 100% 4/4 forwards"),  # the clean run and N patched layers
    "attribution patching": (lambda lm, progress: attribution_patching(lm, CLEAN, CORRUPT, ANSWERS,
                                                                        progress=progress),
                             "attribution patching (resid_pre): 100% 9/9 layers"),  # N per pass, 3 passes
    "path patching": (lambda lm, progress: path_patching(lm, CLEAN, CORRUPT, ANSWERS, receivers=[(2, 0)],
                                                          progress=progress),
                      "path patching: 100% 6/6 forwards"),  # 2 caches, 2 forwards for each of 2 sender layers
    "edge attribution": (lambda lm, progress: edge_attribution(lm, CLEAN, CORRUPT, ANSWERS, method="eap-ig", steps=3,
                                                                progress=progress).scores,
                         "edge attribution (eap-ig): 100% 5/5 runs"),  # 2 caches and 3 points
    "integrated gradients": (lambda lm, progress: integrated_gradients(lm, CLEAN, target=5, steps=10, batch_size=4,
                                                                        progress=progress).attributions,
                             "integrated gradients: 100% 12/12 points"),  # 10 points and the two ends
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_true_counts_every_step_and_false_writes_nothing(plain, capsys, lm, name):
    call, finished = CALLS[name]
    shown = call(lm, True)
    err = capsys.readouterr().err
    assert _last_drawn(err).startswith(finished), err[-300:]
    assert "\n" not in err and err.endswith("\r")  # one line, cleared at the end
    hidden = call(lm, False)
    assert capsys.readouterr() == ("", "")
    np.testing.assert_array_equal(shown, hidden)


def test_the_page_names_its_steps_and_shows_the_patching_as_their_detail(plain, capsys, lm, tmp_path):
    data = explain_html(lm, CLEAN, tmp_path / "page.html", candidates=2, corrupt=CORRUPT, generate=2, progress=True)
    drawn = [part.rstrip() for part in capsys.readouterr().err.split("\r") if part.strip()]
    # the attention, 2 lenses, 2 candidates, rollout, 2 patchings, the generation and the page: 10 steps
    assert drawn[-1].startswith("explain: writing the page: 100% 10/10 steps")
    assert any(part.startswith("explain: attributions:") for part in drawn)
    assert any("[activation patching (resid_pre) 4/4]" in part for part in drawn)  # the inner line, one line
    quiet = explain_html(lm, CLEAN, tmp_path / "quiet.html", candidates=2, corrupt=CORRUPT, generate=2,
                         progress=False)
    assert capsys.readouterr() == ("", "")
    assert quiet["patching"] == data["patching"] and quiet["generation"] == data["generation"]


def test_a_bad_progress_argument_is_refused_by_name(lm, tmp_path):
    with pytest.raises(TypeError, match="progress must be None"):
        activation_patching(lm, CLEAN, CORRUPT, ANSWERS, progress="on")
    with pytest.raises(TypeError, match="progress must be None"):
        explain_html(lm, CLEAN, tmp_path / "page.html", progress=1)
