"""KVCache: growing, fixed-size and ring-buffer layers hold exactly the slots attention needs."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.decoding.cache import KVCache

from helpers import make_rng, randn

B, H, DH = 2, 3, 4


def _chunks(rng, lengths, dtype=np.float32):
    return [(randn(rng, B, H, n, DH, dtype=dtype), randn(rng, B, H, n, DH, dtype=dtype)) for n in lengths]


@pytest.mark.parametrize("max_length", [None, 16])
def test_full_layer_returns_every_slot_in_order(max_length):
    rng = make_rng(1)
    cache = KVCache(1, B, H, DH, max_length=max_length)
    chunks = _chunks(rng, [5, 1, 1, 3])
    for k, v in chunks:
        out = cache.update(0, k, v)
    all_k = np.concatenate([k for k, _ in chunks], axis=2)
    all_v = np.concatenate([v for _, v in chunks], axis=2)
    np.testing.assert_array_equal(out.keys, all_k)
    np.testing.assert_array_equal(out.values, all_v)
    np.testing.assert_array_equal(out.slots, np.arange(10))
    assert cache.length == 10


@pytest.mark.parametrize("window", [1, 3, 4, 8, 16])
def test_ring_layer_keeps_last_window_and_returns_needed_keys(window):
    """Windows 8 and 16 fill in place before the ring comes round (17 slots in all), then wrap."""
    rng = make_rng(2, window)
    cache = KVCache(2, B, H, DH, windows=[None, window])
    chunks = _chunks(rng, [5, 1, 2, 1, 1, 6, 1])
    seen_k, seen_v = [], []
    for k, v in chunks:
        past = cache.length
        cache.update(0, k, v)
        out = cache.update(1, k, v)
        seen_k.append(k)
        seen_v.append(v)
        all_k = np.concatenate(seen_k, axis=2)
        all_v = np.concatenate(seen_v, axis=2)
        expected = np.arange(max(0, past - window), past + k.shape[2])
        np.testing.assert_array_equal(out.slots, expected)
        np.testing.assert_array_equal(out.keys, all_k[:, :, expected])
        np.testing.assert_array_equal(out.values, all_v[:, :, expected])
    assert cache.entries[1].capacity == window  # memory stays O(W)


def test_fixed_size_allocates_once_and_refuses_overflow():
    cache = KVCache(2, B, H, DH, max_length=6)
    assert cache.nbytes == 2 * 2 * B * H * 6 * DH * 4
    k = np.zeros((B, H, 4, DH), np.float32)
    cache.update(0, k, k)
    with pytest.raises(ValueError, match="max_length=6"):
        cache.update(0, np.zeros((B, H, 3, DH), np.float32), np.zeros((B, H, 3, DH), np.float32))


def test_growing_cache_nbytes_follows_capacity():
    cache = KVCache(1, 1, 1, 2, dtype=np.float64)
    assert cache.nbytes == 0
    k = np.zeros((1, 1, 3, 2))
    cache.update(0, k, k)
    assert cache.nbytes == 2 * 3 * 2 * 8
    cache.update(0, k[:, :, :1], k[:, :, :1])
    assert cache.nbytes == 2 * 6 * 2 * 8  # doubled, amortised O(1) per step


def test_update_casts_to_the_cache_dtype():
    cache = KVCache(1, B, H, DH, dtype=np.float32)
    out = cache.update(0, np.ones((B, H, 2, DH)), np.ones((B, H, 2, DH)))
    assert out.keys.dtype == np.float32


def test_crop_then_continue_equals_never_written():
    rng = make_rng(3)
    a, b, c = _chunks(rng, [4, 3, 2])
    cache = KVCache(2, B, H, DH, windows=[None, 8])
    for layer in range(2):
        cache.update(layer, *a)
        cache.update(layer, *b)
    cache.crop(4)
    assert cache.length == 4
    ref = KVCache(2, B, H, DH, windows=[None, 8])
    for layer in range(2):
        ref.update(layer, *a)
        got, want = cache.update(layer, *c), ref.update(layer, *c)
        np.testing.assert_array_equal(got.keys, want.keys)
        np.testing.assert_array_equal(got.slots, want.slots)


def test_crop_refuses_an_overwritten_ring():
    cache = KVCache(1, 1, 1, 2, windows=[2])
    k = np.zeros((1, 1, 3, 2), np.float32)
    cache.update(0, k, k)
    with pytest.raises(ValueError, match="layer 0 keeps a ring of 2 slots and has overwritten slots before 1"):
        cache.crop(2)
    cache.crop(3)  # a no-op crop is fine
    with pytest.raises(ValueError, match="length"):
        cache.crop(4)


@pytest.mark.parametrize("windows", [[None], [2]])
def test_reorder_with_repeats_and_select(windows):
    rng = make_rng(4)
    cache = KVCache(1, 3, H, DH, windows=windows)
    k, v = randn(rng, 3, H, 3, DH, dtype=np.float32), randn(rng, 3, H, 3, DH, dtype=np.float32)
    cache.update(0, k, v)
    cache.reorder(np.array([2, 2, 0, 1]))
    assert cache.batch_size == 4
    step_k = randn(rng, 4, H, 1, DH, dtype=np.float32)
    out = cache.update(0, step_k, step_k)
    kept = out.slots[:-1]
    np.testing.assert_array_equal(out.keys[:, :, :-1], k[[2, 2, 0, 1]][:, :, kept])
    cache.select(np.array([True, False, False, True]))
    assert cache.batch_size == 2
    out = cache.update(0, step_k[:2], step_k[:2])
    np.testing.assert_array_equal(out.keys[:, :, -2], step_k[[0, 3], :, 0])
    with pytest.raises(ValueError, match="repeat"):
        cache.select([0, 0])


@pytest.mark.parametrize("call, match", [
    (lambda c: c.update(2, np.zeros((B, H, 1, DH)), np.zeros((B, H, 1, DH))), "layer"),
    (lambda c: c.update(0, np.zeros((B, H, 1, DH + 1)), np.zeros((B, H, 1, DH + 1))), "k_new"),
    (lambda c: c.update(0, np.zeros((B, H, 1, DH)), np.zeros((B, H, 2, DH))), "same shape"),
    (lambda c: c.reorder([5]), "index"),
    (lambda c: c.select([[0]]), "rows"),
])
def test_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        call(KVCache(2, B, H, DH))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="windows"):
        KVCache(2, 1, 1, 2, windows=[None])
    with pytest.raises(ValueError, match="max_length"):
        KVCache(2, 1, 1, 2, max_length=0)
    with pytest.raises(TypeError, match="dtype"):
        KVCache(2, 1, 1, 2, dtype=np.int32)


def _hybrid_cache():
    """Layers 0 and 2 keep keys and values, layer 1 a Gated DeltaNet state."""
    from attnkit.layers import GatedDeltaNet

    gdn = GatedDeltaNet(4, num_key_heads=1, num_value_heads=2, key_head_dim=2, value_head_dim=3, rng=0)
    return gdn, KVCache(3, 2, 1, 2, np.float64, states={1: gdn.new_cache(2, dtype=np.float64)})


def test_a_state_layer_holds_a_fixed_size_state_beside_keys_and_values():
    gdn, cache = _hybrid_cache()
    k = np.ones((2, 1, 3, 2))
    for layer in (0, 2):
        cache.update(layer, k, k)
    assert cache.length == 0  # the state layer has not run yet
    state = cache.state(1)
    before = state.nbytes
    gdn(np.ones((2, 3, 4)), cache=state)
    assert cache.length == 3 and state.length == 3
    cache.update(0, k[:, :, :1], k[:, :, :1])
    cache.update(2, k[:, :, :1], k[:, :, :1])
    gdn(np.ones((2, 1, 4)), cache=state)
    assert cache.length == 4
    assert state.nbytes == before == state.conv_state.nbytes + state.recurrent_state.nbytes  # whatever the length
    assert cache.nbytes == state.nbytes + sum(e.nbytes for i, e in enumerate(cache.entries) if i != 1)
    with pytest.raises(ValueError, match="keeps a state, not keys and values"):
        cache.update(1, k, k)
    with pytest.raises(ValueError, match="keeps keys and values, not a state"):
        cache.state(0)


def test_reorder_and_select_move_the_states_rows_with_the_keys():
    gdn, cache = _hybrid_cache()
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 1, 2, 2))
    cache.update(0, keys, keys)
    cache.update(2, keys, keys)
    gdn(rng.standard_normal((2, 2, 4)), cache=cache.state(1))
    recurrent = cache.state(1).recurrent_state.copy()
    cache.reorder(np.array([1, 1, 0]))
    assert cache.batch_size == 3
    np.testing.assert_array_equal(cache.state(1).recurrent_state, recurrent[[1, 1, 0]])
    np.testing.assert_array_equal(cache.update(0, keys[[0, 0, 0], :, :1], keys[[0, 0, 0], :, :1]).keys[:, :, 0],
                                  keys[[1, 1, 0], :, 0])
    cache.select(np.array([False, True, True]))
    np.testing.assert_array_equal(cache.state(1).recurrent_state, recurrent[[1, 0]])


def test_crop_refuses_to_forget_what_a_state_absorbed():
    gdn, cache = _hybrid_cache()
    k = np.ones((2, 1, 3, 2))
    cache.update(0, k, k)
    cache.update(2, k, k)
    gdn(np.ones((2, 3, 4)), cache=cache.state(1))
    cache.crop(3)  # nothing to forget: allowed
    with pytest.raises(ValueError, match="cannot go back to 2 positions: layer 1 keeps a recurrent state of 3 "
                                         r"positions; mark the length first .*marked lengths: \[\]"):
        cache.crop(2)


def test_a_state_must_be_a_state():
    with pytest.raises(TypeError, match=r"states\[1\] must have length, nbytes, reorder, copy and cleared"):
        KVCache(2, 1, 1, 2, states={1: np.zeros(3)})
    with pytest.raises(ValueError, match="both a window and a state"):
        KVCache(2, 1, 1, 2, windows=[None, 4], states={1: _hybrid_cache()[0].new_cache(1)})


def test_a_marked_length_is_one_a_state_and_a_ring_can_return_to():
    gdn, cache = _hybrid_cache()
    rng = make_rng(5)
    k = randn(rng, 2, 1, 3, 2, dtype=np.float32)
    for layer in (0, 2):
        cache.update(layer, k, k)
    gdn(np.ones((2, 3, 4)), cache=cache.state(1))
    state = cache.state(1).copy()
    assert cache.mark() == 3 and cache.marks == [3]
    for layer in (0, 2):
        cache.update(layer, k[:, :, :2], k[:, :, :2])
    gdn(np.full((2, 2, 4), 0.5), cache=cache.state(1))
    assert cache.can_crop(3) and not cache.can_crop(4)
    with pytest.raises(ValueError, match="cannot go back to 4 positions.*marked lengths: \\[3\\]"):
        cache.crop(4)
    cache.crop(3)
    np.testing.assert_array_equal(cache.state(1).recurrent_state, state.recurrent_state)
    np.testing.assert_array_equal(cache.state(1).conv_state, state.conv_state)
    assert cache.length == 3 and cache.state(1).length == 3 and cache.marks == [3]


@pytest.mark.parametrize("rollback", [0, 3])
def test_a_ring_goes_back_within_its_rollback_slots_or_to_a_mark(rollback):
    rng = make_rng(6)
    window = 4
    chunks = _chunks(rng, [5, 3, 2])
    cache = KVCache(1, B, H, DH, windows=[window], rollback=rollback)
    cache.update(0, *chunks[0])
    marked = cache.mark()
    cache.update(0, *chunks[1])  # slots 5..7 overwrite 1..3 of a 4-slot ring, not of a 7-slot one
    assert cache.can_crop(6) == (rollback >= 2) and cache.can_crop(marked)
    cache.crop(marked)
    ref = KVCache(1, B, H, DH, windows=[window])
    ref.update(0, *chunks[0])
    got, want = cache.update(0, *chunks[2]), ref.update(0, *chunks[2])
    np.testing.assert_array_equal(got.keys[:, :, -window - 2:], want.keys[:, :, -window - 2:])
    np.testing.assert_array_equal(got.slots[-window - 2:], want.slots[-window - 2:])


def test_token_ids_follow_crop_and_reorder():
    cache = KVCache(1, 2, H, DH)
    cache.record(np.array([[1, 2, 3], [4, 5, 6]]))
    cache.update(0, np.zeros((2, H, 3, DH)), np.zeros((2, H, 3, DH)))
    cache.crop(2)
    cache.reorder(np.array([1, 1, 0]))
    assert cache.token_ids.tolist() == [[4, 5], [4, 5], [1, 2]]
