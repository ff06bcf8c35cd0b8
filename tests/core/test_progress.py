"""The progress line (attnkit._progress): on stderr when asked or when stderr is a terminal, nothing otherwise;
tqdm when installed, else a plain line of its own; one line at a time. Loading and generate take ``progress=``."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from attnkit import _progress
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

CFG = DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp=MLPConfig(24))


@pytest.fixture
def plain(monkeypatch):
    """The plain line (as without tqdm), drawn at every step."""
    monkeypatch.setattr(_progress, "_tqdm", lambda: None)
    monkeypatch.setattr(_progress, "_REFRESH", 0.0)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_true_writes_to_stderr_and_false_writes_nothing(capsys):
    with _progress.progress(3, "counting", enabled=True) as line:
        line.update(3)
    assert "counting" in capsys.readouterr().err
    with _progress.progress(3, "counting", enabled=False) as line:
        line.update(3)
    assert capsys.readouterr() == ("", "")
    assert line.count == 3  # a hidden line still counts


def test_auto_follows_whether_stderr_is_a_terminal(monkeypatch, capsys):
    with _progress.progress(2, "on a pipe") as line:  # capsys's stderr is not a terminal
        line.update(2)
    assert capsys.readouterr().err == ""
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with _progress.progress(2, "on a terminal") as line:
        line.update(2)
    assert "on a terminal" in terminal.getvalue()
    assert _progress.wanted(None, Terminal()) and not _progress.wanted(None, io.StringIO())


def test_the_plain_line_counts_rewrites_itself_and_is_cleared(plain, capsys):
    with _progress.progress(4, "loading", unit="tensor", enabled=True) as line:
        line.update()
        line.update(3)
    err = capsys.readouterr().err
    drawn = [part for part in err.split("\r") if part.strip()]
    assert drawn[0].startswith("loading:   0% 0/4 tensors") and drawn[-1].startswith("loading: 100% 4/4 tensors")
    assert "\n" not in err and err.endswith("\r")  # one line, rewritten, then blanked
    assert err.rstrip("\r").endswith(" " * len(drawn[-1].rstrip()))


def test_large_counts_are_scaled(plain, capsys):
    with _progress.progress(135_000_000, "loading weights", unit="B", enabled=True, scale=True) as line:
        line.update(55_300_000)
    assert "41% 55.3M/135M B " in capsys.readouterr().err


def test_an_inner_step_is_the_outer_lines_detail(plain, capsys):
    with _progress.progress(2, "explain", enabled=True) as outer:
        with _progress.progress(3, "patching", enabled=True) as inner:
            inner.update(2)
        outer.update()
    drawn = [part.rstrip() for part in capsys.readouterr().err.split("\r") if part.strip()]
    assert any(part.startswith("explain:   0% 0/2 steps") and part.endswith("[patching 2/3]") for part in drawn)
    assert drawn[-1].startswith("explain:  50% 1/2 steps") and "[" not in drawn[-1]  # detail gone with its step


def test_a_bad_progress_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="progress must be None \\(on a terminal\\), True or False, got 1"):
        _progress.progress(1, "x", enabled=1)
    with pytest.raises(TypeError, match="progress must be None"):
        CausalLM(CFG, rng=0).generate(np.array([[1, 2]]), max_new_tokens=1, progress="yes")


@pytest.mark.parametrize("num_beams, name", [(1, "generating"), (2, "beam search")])
def test_generate_shows_its_steps_when_asked(plain, capsys, num_beams, name):
    lm = CausalLM(CFG, rng=0)
    shown = lm.generate(np.array([[1, 2, 3]]), max_new_tokens=4, num_beams=num_beams, progress=True)
    assert f"{name}: 100% 4/4" in capsys.readouterr().err
    hidden = lm.generate(np.array([[1, 2, 3]]), max_new_tokens=4, num_beams=num_beams, progress=False)
    assert capsys.readouterr() == ("", "")
    np.testing.assert_array_equal(shown, hidden)


def test_loading_counts_the_bytes_of_every_tensor(plain, capsys, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    from attnkit.pretrained import load_causal_lm
    from attnkit.pretrained.checkpoint import checkpoint_map
    from attnkit.pretrained.hf_config import decoder_config_from_hf

    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    maps, prefix = checkpoint_map(decoder_config_from_hf(hf))
    rng = np.random.default_rng(0)
    tensors = {("" if m.source == "lm_head.weight" else prefix) + m.source:
               rng.standard_normal(m.shape).astype(np.float32) for m in maps}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    total = sum(t.nbytes for t in tensors.values())
    shown = load_causal_lm(tmp_path, progress=True)
    err = capsys.readouterr().err
    assert f"loading weights: 100% {total / 1e3:.3g}k/{total / 1e3:.3g}k B" in err and err.endswith("\r")
    hidden = load_causal_lm(tmp_path, progress=False)
    assert capsys.readouterr() == ("", "")
    for (name, a), (_, b) in zip(shown.named_parameters(), hidden.named_parameters(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
