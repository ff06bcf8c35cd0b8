"""The dates task (human-written dates -> ISO) and a seconds-long run of the dates demo."""
import datetime as dt

import numpy as np
import pytest

from attnkit.demos import date_data as date_task
from attnkit.demos import dates as seq2seq_demo

MARCH_3_1998 = {
    "ordinal_of": "3rd of March 1998", "the_ordinal_of": "the 3rd of march, 1998", "mon_d_yy": "Mar 3, '98",
    "month_d_yyyy": "March 3, 1998", "month_dth_yyyy": "March 3rd, 1998", "d_month_yyyy": "3 March 1998",
    "d_mon_yyyy": "3 Mar 1998", "d_mon_yyyy_dashes": "3-Mar-1998", "weekday_d_month_yyyy": "tuesday 3 march 1998",
    "wkd_d_mon_yyyy": "Tue 3 Mar 1998", "weekday_month_dth_yyyy": "Tuesday, March 3rd, 1998",
    "ymd_slashes": "1998/3/3", "dmy_dots": "03.03.1998", "dmy_dots_short": "3.3.98", "iso": "1998-03-03",
    "compact": "19980303", "mon_dth_yy": "mar 3rd '98",
}


def test_every_format_writes_the_date_as_people_do():
    assert set(MARCH_3_1998) == set(date_task.FORMATS)
    for fmt, text in MARCH_3_1998.items():
        assert date_task.render(dt.date(1998, 3, 3), fmt) == text, fmt
    assert date_task.render(dt.date(2011, 11, 12), "ordinal_of") == "12th of November 2011"
    assert date_task.render(dt.date(2001, 6, 22), "month_dth_yyyy", case="upper") == "JUNE 22ND, 2001"
    assert date_task.render(dt.date(2005, 1, 1), "mon_d_yy") == "Jan 1, '05"


def test_weekdays_are_true_and_two_digit_years_are_unambiguous():
    sources, targets = date_task.make_examples(3000, rng=1)
    for source, target in zip(sources, targets, strict=True):
        date = dt.date.fromisoformat(target)
        assert dt.date(1950, 1, 1) <= date <= dt.date(2049, 12, 31)
        words = source.lower().replace(",", " ").split()
        for day in ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"):
            if day in words or day[:3] in words:
                assert date.strftime("%A").lower().startswith(words[0]), source


def test_heldout_dates_never_occur_in_training():
    rng = np.random.default_rng(2)
    train = set(date_task.make_examples(20000, rng)[1])
    test = set(date_task.make_examples(2000, rng, heldout=True)[1])
    assert train and test and not train & test
    day = np.arange((date_task.LAST_DATE - date_task.FIRST_DATE).days + 1)
    assert 0.09 < date_task.is_heldout(day).mean() < 0.11


def test_encoding_pads_sources_and_frames_targets():
    src, mask, tgt = date_task.encode_batch(["1998/3/3", "3rd of March 1998"], ["1998-03-03", "1998-03-03"])
    assert src.shape == mask.shape == (2, 17) and mask.sum(1).tolist() == [8, 17]
    assert np.all(src[~mask] == date_task.PAD)
    assert tgt.shape == (2, 12) and np.all(tgt[:, 0] == date_task.BOS) and np.all(tgt[:, -1] == date_task.EOS)
    assert date_task.TARGET_VOCAB.decode(tgt[0]) == "1998-03-03"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        date_task.encode_batch(["3 März 1998"])


def test_short_demo_run_learns_and_saves(tmp_path):
    config = seq2seq_demo.DatesConfig(steps=200, batch_size=32, lr=3e-3, d_model=32, num_heads=2, num_layers=1,
                                      d_ff=64, eval_size=40, num_beams=2)
    result = seq2seq_demo.train(config)
    assert len(result.losses) == 200 and result.losses[-1] < 0.5 * result.losses[0]
    sources, targets = date_task.make_examples(40, np.random.default_rng([config.seed, 3]), heldout=True)
    outputs = seq2seq_demo.normalise(result.model, sources)
    pairs = zip(outputs, targets, strict=True)
    chars = np.mean([a == b for out, want in pairs for a, b in zip(out.ljust(10), want, strict=False)])
    # Chance: the most frequent training character at each position (the dashes, "19"/"20", ...).
    training = date_task.make_examples(2000, np.random.default_rng(5))[1]
    majority = [max(set(col), key=col.count) for col in ([t[i] for t in training] for i in range(10))]
    chance = np.mean([want[i] == majority[i] for want in targets for i in range(10)])
    assert chars > chance + 0.1
    assert 0.0 <= result.greedy_exact_match <= 1.0 and 0.0 <= result.beam_exact_match <= 1.0
    weights, out_tokens, src_tokens = seq2seq_demo.alignment(result.model, "3rd of March 1998")
    assert weights.shape == (len(out_tokens), len(src_tokens)) and np.allclose(weights.sum(-1), 1.0)
    model_path, config_path = seq2seq_demo.save_model(result, tmp_path)
    loaded = seq2seq_demo.build_model(config)
    loaded.load(model_path)
    np.testing.assert_array_equal(loaded.head.W, result.model.head.W)
    assert "heldout_exact_match" in config_path.read_text()


def test_a_beam_count_beyond_the_bound_is_refused_before_training():
    steps = []
    config = seq2seq_demo.DatesConfig(steps=5, batch_size=4, d_model=8, num_heads=2, num_layers=1, d_ff=8,
                                      eval_size=4, num_beams=10**6)
    with pytest.raises(ValueError, match="num_beams must be at most 1024"):
        seq2seq_demo.train(config, on_step=lambda *args: steps.append(args))
    assert steps == []
