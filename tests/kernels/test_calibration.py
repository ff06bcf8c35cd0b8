"""The calibration's decisions, with planted timings (a fake ``measure``): the fastest candidate wins only by the
margin, thresholds move only while one side wins, a busy machine keeps the defaults, and the same timings give
the same choices and the same questions."""
from __future__ import annotations

import pytest

from attnkit.kernels import calibration
from attnkit.kernels.calibration import MARGIN, NEVER_SPLIT, calibrate, thread_candidates, tile_candidates
from attnkit.kernels.tuning import DEFAULT_CHOICES, Choices


class Planted:
    """A fake ``measure``: 1 s for everything but the planted (setting, candidate) times; records the asks."""

    def __init__(self, times=None, product=None, decode=None):
        self.times = times or {}
        self.product = product or {}  # rows -> (split, one call)
        self.decode = decode or {}  # rows -> (one thread, all threads)
        self.asked = []

    def __call__(self, setting, candidate):
        self.asked.append((setting, candidate))
        if setting == "product":
            rows, split = candidate
            return self.product.get(rows, (1.0, 1.0))[0 if split else 1]
        if setting == "decode_blas":
            rows, single = candidate
            return self.decode.get(rows, (1.0, 1.0))[0 if single else 1]
        return self.times.get((setting, candidate), 1.0)


def _calibrate(measure, usable=2, busy=False):
    return calibrate(measure, busy=lambda: busy, usable=usable)


def test_a_planted_faster_tile_is_chosen():
    candidates = tile_candidates("q", 2)
    planted = candidates[-1]
    result = _calibrate(Planted({("tile_l2_forward", planted): 0.5, ("tile_l2_backward", candidates[1]): 0.5}))
    assert result.choices.tile_l2_forward == planted
    assert result.choices.tile_l2_backward == candidates[1] or candidates[1] not in tile_candidates("k", 2)
    assert [c for c, _ in result.trials["tile_l2_forward"]] == candidates
    assert not result.busy


def test_a_candidate_faster_by_less_than_the_margin_keeps_the_default():
    planted = tile_candidates("q", 2)[1]
    result = _calibrate(Planted({("tile_l2_forward", planted): MARGIN + 0.01, ("num_threads", 1): 0.91}))
    # equal one-row times decide one BLAS thread for one token (as the untuned per-process measurement does)
    assert result.choices == Choices(single_blas_rows=1)


def test_a_planted_faster_thread_count_is_chosen():
    assert _calibrate(Planted({("num_threads", 1): 0.5})).choices.num_threads == 1
    assert _calibrate(Planted({("num_threads", 2): 0.5}), usable=4).choices.num_threads == 2
    assert thread_candidates(2) == [2, 1] and thread_candidates(1) == [1]


@pytest.mark.parametrize("product, expected", [
    ({256: (1.0, 0.5), 512: (1.0, 0.5), 1024: (1.0, 1.0)}, 1024),  # one call wins up to 512 rows
    ({m: (1.0, 0.5) for m in calibration.SPLIT_ROW_CANDIDATES}, NEVER_SPLIT),  # one call wins everywhere
    ({128: (0.5, 1.0), 64: (0.5, 1.0)}, 64),  # the split wins below the default
    ({128: (0.5, 1.0), 64: (1.0, 1.0)}, 128),
    ({128: (0.95, 1.0)}, 256),  # within the margin: the default
])
def test_the_split_threshold_moves_only_while_one_side_wins(product, expected):
    assert _calibrate(Planted(product=product)).choices.split_rows == expected


@pytest.mark.parametrize("decode, expected", [
    ({}, 1),  # equal at one row: one thread (all threads must win by the margin)
    ({1: (1.0, 0.5)}, 0),  # all threads faster even for one row
    ({2: (0.5, 1.0), 4: (0.5, 1.0)}, 4),  # one thread wins up to 4 rows, ties at 8: all threads from 8
    ({2: (0.5, 1.0), 4: (0.5, 1.0), 8: (0.5, 1.0)}, 8),
])
def test_decoding_blas_threads_follow_the_planted_times(decode, expected):
    assert _calibrate(Planted(decode=decode)).choices.single_blas_rows == expected


def test_a_busy_machine_keeps_every_default():
    planted = Planted({("num_threads", 1): 0.1, ("tile_l2_forward", tile_candidates("q", 2)[1]): 0.1},
                      product={128: (0.1, 1.0)}, decode={2: (0.1, 1.0)})
    result = _calibrate(planted, busy=True)
    assert result.busy and result.choices == DEFAULT_CHOICES
    assert {f"{s}_kept" for s in ("tile_l2_forward", "split_rows", "num_threads")} <= set(result.trials)


def test_a_busy_machine_keeps_the_previous_tune():
    previous = Choices(tile_l2_backward=256 << 10, split_rows=1024, num_threads=1)
    result = calibrate(Planted({("num_threads", 1): 2.0}), busy=lambda: True, usable=2, keep=previous)
    assert result.choices == previous and result.trials["split_rows_kept"] == [["busy", 1024]]


def test_one_busy_phase_keeps_only_its_default():
    answers = iter([False, False, False, True, False, False])  # before, forward tiles, backward, split, ...
    planted = Planted({("num_threads", 1): 0.1}, product={128: (0.1, 1.0), 64: (0.1, 1.0)})
    result = calibrate(planted, busy=lambda: next(answers), usable=2)
    assert result.busy and result.choices.split_rows == 256 and result.choices.num_threads == 1


def test_one_core_measures_tiles_only():
    planted = Planted()
    result = _calibrate(planted, usable=1)
    assert {s for s, _ in planted.asked} == {"tile_l2_forward", "tile_l2_backward"}
    assert result.choices == Choices()


def test_the_same_timings_give_the_same_choices_and_questions():
    times = {("tile_l2_backward", tile_candidates("k", 2)[-1]): 0.3, ("num_threads", 1): 0.7}
    first, second = Planted(times, {128: (0.5, 1.0)}), Planted(times, {128: (0.5, 1.0)})
    assert _calibrate(first).choices == _calibrate(second).choices
    assert first.asked == second.asked


def test_the_record_is_json_ready():
    import json

    record = _calibrate(Planted({("num_threads", 1): 0.5})).record()
    assert json.loads(json.dumps(record))["trials"]["num_threads"] == [[None, 1.0], [1, 0.5]]
    assert record["margin"] == MARGIN and record["busy"] is False


def test_the_real_workloads_time_every_setting():
    """One tiny real run per setting: positive times, nothing pinned left behind."""
    from attnkit.kernels import tuning

    work = calibration.Workloads(repeats=1)
    for setting, candidate in (("tile_l2_forward", 256 << 10), ("tile_l2_backward", None), ("product", (64, True)),
                               ("product", (64, False)), ("decode_blas", (1, True)), ("num_threads", 1)):
        assert work(setting, candidate) > 0
    assert tuning.current_choices() == DEFAULT_CHOICES and not tuning._pins
