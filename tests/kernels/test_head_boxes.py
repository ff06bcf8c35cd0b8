"""Heads per tile: boxes of heads give the reference results, cover every head once, and never share a
gradient between two tasks."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.kernels import _tile_sizes
from attnkit.kernels.reference import attention_backward, attention_forward
from attnkit.kernels.tiled import flash_attention_backward, flash_attention_forward
from attnkit.kernels.tiled.plan import _head_boxes, _splittable_axes

from kernel_cases import RelativeTable, run_attention

B, H, G, L, D = 2, 3, 2, 21, 8


def _case(kind, rng):
    """``(q, k, v, grad, keywords)`` of one layout; k/v/bias shapes decide which axes may be split."""
    q = rng.standard_normal((B, H, L, D))  # (B, H, L, D)
    k, v = rng.standard_normal((2, B, H, L, D))  # (B, H, L, D) each
    kw = {}
    if kind == "grouped":  # keys shared by G query heads: that axis stays whole
        q = rng.standard_normal((B, H, G, L, D))  # (B, Hkv, G, L, D)
        k, v = rng.standard_normal((2, B, H, 1, L, D))  # (B, Hkv, 1, L, D)
    elif kind == "head bias":
        kw["bias"] = rng.standard_normal((B, H, L, L))
    elif kind == "shared bias":  # one bias for every head: its gradient sums over heads
        kw["bias"] = rng.standard_normal((B, 1, L, L))
    elif kind == "broadcast query":
        q = rng.standard_normal((1, H, L, D))
    elif kind == "head mask":
        kw["mask"] = rng.random((B, H, L, L)) < 0.6
    elif kind == "window":
        kw.update(causal=True, window=5)
    elif kind == "score bias":
        kw["bias"] = RelativeTable(rng.standard_normal((H, 9)))
    elif kind == "dropout":
        kw.update(dropout_p=0.3, dropout_seed=11)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    grad = rng.standard_normal(lead + (L, D))
    return q, k, v, grad, kw


KINDS = ["plain", "grouped", "head bias", "shared bias", "broadcast query", "head mask", "window", "score bias",
         "dropout"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", ["1", "2", "5"])
@pytest.mark.parametrize("threads", [1, 2])
def test_boxes_of_heads_give_the_reference_results(monkeypatch, kind, heads, threads):
    q, k, v, grad, kw = _case(kind, np.random.default_rng(len(kind)))
    monkeypatch.setenv("ATTNKIT_TILE_HEADS", heads)

    def fwd(*args, **more):
        return flash_attention_forward(*args, block_q=8, block_k=6, num_threads=threads, **more)

    mine = run_attention(fwd, flash_attention_backward, q, k, v, grad, **kw)
    ref = run_attention(attention_forward, attention_backward, q, k, v, grad, **kw)
    assert mine.keys() == ref.keys()
    for name in ref:
        assert mine[name].shape == ref[name].shape, name
        np.testing.assert_allclose(mine[name], ref[name], rtol=0, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("kind", ["plain", "grouped", "shared bias"])
def test_boxes_are_bitwise_reproducible_across_threaded_runs(monkeypatch, kind):
    q, k, v, grad, kw = _case(kind, np.random.default_rng(3))
    q, k, v, grad = (x.astype(np.float32) for x in (q, k, v, grad))
    kw = {name: (val.astype(np.float32) if isinstance(val, np.ndarray) else val) for name, val in kw.items()}
    monkeypatch.setenv("ATTNKIT_TILE_HEADS", "1")
    runs = [run_attention(lambda *a, **m: flash_attention_forward(*a, block_q=8, block_k=6, num_threads=2, **m),
                 flash_attention_backward, q, k, v, grad, **kw) for _ in range(3)]
    for other in runs[1:]:
        assert other.keys() == runs[0].keys()
        for name in other:
            assert other[name].tobytes() == runs[0][name].tobytes(), name


def test_splittable_axes_follow_the_gradients():
    lead = (2, 4, 3)
    assert _splittable_axes(lead, (2, 4, 3, 9, 8), (2, 4, 3, 9, 8), None, False) == (True, True, True)
    assert _splittable_axes(lead, (2, 4, 1, 9, 8), (2, 4, 1, 9, 8), None, False) == (True, True, False)
    assert _splittable_axes(lead, (4, 3, 9, 8), (2, 4, 3, 9, 8), None, False) == (False, True, True)
    assert _splittable_axes(lead, (2, 4, 3, 9, 8), (2, 4, 3, 9, 8), np.zeros((4, 1, 9, 9)), False) == (
        False, True, False)
    assert _splittable_axes(lead, (2, 4, 3, 9, 8), (2, 4, 3, 9, 8), None, True) == (False, False, False)
    assert _splittable_axes((1, 4), (1, 4, 9, 8), (1, 4, 9, 8), None, False) == (False, True)


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=1, max_size=3), group=st.integers(1, 40),
       data=st.data())
def test_boxes_cover_every_head_once(lead, group, data):
    lead = tuple(lead)
    splittable = tuple(data.draw(st.lists(st.booleans(), min_size=len(lead), max_size=len(lead))))
    boxes = _head_boxes(lead, splittable, group)
    seen = np.zeros(lead, int)
    for box in boxes:
        seen[box] += 1
        for axis, (cut, n) in enumerate(zip(box, lead, strict=True)):
            if not splittable[axis]:
                assert cut.indices(n)[:2] == (0, n)  # an axis that may not be split is taken whole
    assert (seen == 1).all()
    sizes = [np.prod([len(range(*c.indices(n))) for c, n in zip(box, lead, strict=True)]) for box in boxes]
    if all(splittable):
        assert max(sizes) <= max(group, 1)


def test_chooser_puts_many_short_heads_in_a_tile_and_few_long_ones():
    l2 = 512 << 10
    assert _tile_sizes.choose_heads(64, 256, 256, 32, l2=l2) == 4  # measured best: 1.3x faster than 1 or 64
    assert _tile_sizes.choose_heads(384, 48, 48, 32, l2=l2) == 64
    assert _tile_sizes.choose_heads(1, 256, 256, 64, l2=l2) == 1
    groups = [_tile_sizes.choose_heads(64, 256, 256, 64, l2=kib << 10) for kib in (256, 512, 1024, 2048)]
    assert groups == sorted(groups)  # a larger cache never holds fewer heads
    for kib in (256, 512, 1024, 2048):
        tq, tk = _tile_sizes.choose_tiles(64, 64, l2=kib << 10)
        g = _tile_sizes.choose_heads(64, tq, tk, 64, l2=kib << 10)
        assert g * _tile_sizes.working_set(tq, tk, 64, 64, 4) <= 4.5 * (kib << 10)


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_heads_variable_names_itself(monkeypatch, value):
    monkeypatch.setenv("ATTNKIT_TILE_HEADS", value)
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=f"ATTNKIT_TILE_HEADS must be a positive integer.*{value!r}"):
        flash_attention_forward(q, q, q)


def test_default_choice_splits_a_bert_batch_into_boxes(monkeypatch):
    """Without overrides, 64 heads of L = 512, D = 32 run 4 to a tile on a 512 KiB L2."""
    seen = []
    real = _head_boxes
    monkeypatch.setattr("attnkit.kernels.tiled.plan._head_boxes",
                        lambda *a: seen.append(a) or real(*a))
    monkeypatch.setattr(_tile_sizes, "l2_bytes", lambda root: 512 << 10)
    q = np.zeros((8, 8, 512, 32), np.float32)
    flash_attention_forward(q, q, q, num_threads=1)
    assert seen[0] == ((8, 8), (True, True), 4)
    assert len(real(*seen[0])) == 16


def test_every_box_layout_is_a_product_of_cuts():
    boxes = _head_boxes((3, 5), (True, True), 2)
    rows = sorted({box[0].indices(3)[:2] for box in boxes})
    cols = sorted({box[1].indices(5)[:2] for box in boxes})
    assert rows == [(0, 1), (1, 2), (2, 3)] and cols == [(0, 2), (2, 4), (4, 5)]
    assert len(boxes) == len(list(itertools.product(rows, cols)))
