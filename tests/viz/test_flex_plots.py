"""Drawing flex variants: the block-mask picture shows the kernel's own tile plan and the mask cell by cell;
the score-modifier picture shows the modifier's own output and blanks what the mask removes."""
import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="attnkit.viz needs the viz extra: pip install 'attnkit[viz]'")
import matplotlib.pyplot as plt  # noqa: E402

import attnkit.flex as F  # noqa: E402
from attnkit.viz import _DENSE_LIMIT, plot_block_mask, plot_score_mod  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _codes(fig):
    return np.asarray(fig.axes[0].images[0].get_array()).astype(int)


@pytest.mark.parametrize("mask_mod, lq", [(F.causal_mask, 21), (F.sliding_window_mask(5), 21),
                                          (F.document_mask(np.repeat([0, 1, 2], 7)), 21),
                                          (F.causal_lower_right(9, 21), 9)])
def test_block_mask_picture_is_the_tile_plan_and_the_mask(mask_mod, lq):
    bm = F.create_block_mask(mask_mod, None, None, lq, 21, block_size=(4, 8))
    codes = _codes(plot_block_mask(bm))
    dense = bm.to_dense()[0, 0]  # (Lq, Lk)
    tiles = np.repeat(np.repeat(bm.kinds[0, 0], 4, axis=0), 8, axis=1)[:lq, :21]
    assert codes.shape == (lq, 21)
    np.testing.assert_array_equal(codes == 0, tiles == 0)  # skipped tiles
    np.testing.assert_array_equal(codes == 3, tiles == 2)  # full tiles
    np.testing.assert_array_equal(codes == 2, (tiles == 1) & dense)  # attended cells of partial tiles
    assert not np.any(dense & (codes <= 1))  # nothing attended is drawn as skipped or masked


def test_block_mask_per_batch_row_and_a_coarse_picture_beyond_the_cell_limit(monkeypatch):
    keep = np.ones((2, 40), dtype=bool)
    keep[1, 24:] = False
    bm = F.create_block_mask(F.padding_mask(keep), 2, None, 40, 40, block_size=8)
    assert np.all(_codes(plot_block_mask(bm, batch=0)) == 3)
    assert np.all(_codes(plot_block_mask(bm, batch=1))[:, 24:] == 0)
    monkeypatch.setattr("attnkit.viz._DENSE_LIMIT", 100)
    coarse = _codes(plot_block_mask(bm, batch=1))
    assert coarse.shape == (5, 5) and np.all(coarse[:, 3:] == 0) and np.all(coarse[:, :3] == 3)
    assert _DENSE_LIMIT >= 4_000_000
    with pytest.raises(ValueError, match="batch must be in"):
        plot_block_mask(bm, batch=2)
    with pytest.raises(TypeError, match="BlockMask"):
        plot_block_mask(np.ones((4, 4)))


def test_score_mod_picture_holds_the_raw_and_modified_scores():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 3, 6, 4)), rng.normal(size=(2, 3, 10, 4))
    slopes = F.alibi_slopes(3)
    fig = plot_score_mod(F.alibi(slopes), q, k, mask_mod=F.causal_lower_right(6, 10), batch=1, head=2)
    raw = np.asarray(fig.axes[0].images[0].get_array())
    after = np.asarray(fig.axes[1].images[0].get_array())
    expected_raw = q[1, 2] @ k[1, 2].T / 2.0  # (6, 10), scale 4 ** -0.5
    np.testing.assert_allclose(raw, expected_raw, rtol=1e-12)
    distance = np.arange(10)[None] - np.arange(6)[:, None]  # kv_idx - q_idx
    keep = distance <= 4
    np.testing.assert_allclose(after[keep], (expected_raw + slopes[2] * distance)[keep], rtol=1e-12)
    assert np.all(np.isnan(after[~keep]))
    with pytest.raises(ValueError, match="q must be"):
        plot_score_mod(F.softcap(2.0), q, k[:, :2])
