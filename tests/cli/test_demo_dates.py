"""``attnkit demo --task dates`` end to end, with a tiny model so it takes seconds."""
import functools
import json

import numpy as np
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


def test_dates_demo_writes_cross_decoder_and_encoder_attention_pages(tmp_path, capsys, tiny_dates, monkeypatch):
    from page_data import assert_page_weights, embedded

    trained = {}
    real_train = seq2seq_demo.train

    def keep(config, on_step=None):
        trained["result"] = real_train(config, on_step)
        return trained["result"]

    monkeypatch.setattr(seq2seq_demo, "train", keep)
    assert main(["demo", "--task", "dates", "--steps", "3", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    for name in ("cross_attention.html", "decoder_attention.html", "encoder_attention.html"):
        assert f"wrote {tmp_path / name}" in out
    model = trained["result"].model
    cross = embedded(tmp_path / "cross_attention.html")
    decoder = embedded(tmp_path / "decoder_attention.html")
    encoder = embedded(tmp_path / "encoder_attention.html")
    text = "".join(cross["tokens"])
    maps = seq2seq_demo.attention_maps(model, text)
    assert cross["tokens"] == maps.source_tokens == list(text)
    assert cross["query_tokens"] == [f"{r}\u2192{w}" for r, w in zip(maps.decoder_tokens, maps.output_tokens)]
    assert_page_weights(cross["attention"], maps.cross)  # (1, 2, Lt, Ls): rows = decoder positions
    assert_page_weights(decoder["attention"], maps.decoder)
    assert_page_weights(encoder["attention"], maps.encoder)
    assert maps.cross.shape[-2:] == (len(maps.decoder_tokens), len(text))
    assert (np.triu(maps.decoder[0, 0], 1) == 0).all()  # the decoder's self-attention is causal
    np.testing.assert_allclose(maps.cross.sum(-1), 1, atol=1e-5)
    # The cross-attention equals the model's own cross_attention_weights on the same greedy output.
    from attnkit.demos import date_data

    src, mask = date_data.encode_batch([text])
    ids = model.generate(src, mask, bos_token_id=date_data.BOS, eos_token_id=date_data.EOS,
                         max_new_tokens=date_data.TARGET_LENGTH - 1, pad_token_id=date_data.PAD)
    np.testing.assert_allclose(maps.cross, model.cross_attention_weights(src, ids[:, :-1], mask)[:, 0], atol=1e-6)
