"""``attnkit demo --task dates`` end to end, with a tiny model so it takes seconds."""
import functools
import json

import pytest

from attnkit.cli import main
from attnkit.demos import dates as seq2seq_demo


@pytest.fixture
def tiny_dates(monkeypatch):
    small = functools.partial(seq2seq_demo.DatesConfig, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                              eval_size=10, num_beams=2)
    monkeypatch.setattr(seq2seq_demo, "DatesConfig", small)


def test_dates_demo_prints_both_exact_match_rates_and_writes_its_files(tmp_path, capsys, tiny_dates):
    assert main(["demo", "--task", "dates", "--steps", "3", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "held-out exact match" in out and "greedy" in out and "beam search (2 beams)" in out
    assert "training (dates)" in err
    for name in ("alignment.png", "loss.png", "model.npz", "model.json"):
        assert (tmp_path / name).stat().st_size > 0 and f"{tmp_path / name}" in out
    meta = json.loads((tmp_path / "model.json").read_text())
    assert meta["training"]["steps"] == 3 and set(meta["heldout_exact_match"]) == {"greedy", "beam_2"}


def test_dates_demo_uses_its_own_defaults(tmp_path, capsys, tiny_dates, monkeypatch):
    seen = {}
    real_train = seq2seq_demo.train

    def spy(config, on_step=None):
        seen["config"] = config
        return real_train(config.__class__(**{**config.__dict__, "steps": 2}), on_step)

    monkeypatch.setattr(seq2seq_demo, "train", spy)
    assert main(["demo", "--task", "dates", "--out", str(tmp_path), "--no-progress"]) == 0
    assert seen["config"].steps == seq2seq_demo.DatesConfig().steps
    assert seen["config"].lr == seq2seq_demo.DatesConfig().lr
