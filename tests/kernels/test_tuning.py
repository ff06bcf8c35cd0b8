"""The tuned choices: the cache file of this machine (round trip, atomic write, what is ignored), ATTNKIT_TUNE,
and each choice reaching the kernel it steers (tiles, product splits, threads, decoding BLAS threads)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from attnkit._cpu import l2_bytes
from attnkit.kernels import _threads, linear, tuning
from attnkit.kernels.reference import attention_forward as reference_forward
from attnkit.kernels.tiled import default_blocks, flash_attention_forward
from attnkit.kernels.tuning import DEFAULT_CHOICES, Choices, pinned

TUNED = Choices(tile_l2_forward=256 << 10, tile_l2_backward=2 << 20, split_rows=512, single_blas_rows=4,
                num_threads=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Tuning on, the cache folder in tmp_path, the process's cached reading forgotten before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ATTNKIT_TUNE", "1")
    tuning.forget_cached()
    yield tuning.cache_path()
    tuning.forget_cached()


def test_saved_choices_are_read_back_and_used(cache):
    assert cache.parent == cache.parent.parent / "attnkit" and cache.name.startswith("tuning-")
    assert tuning.current_choices() == DEFAULT_CHOICES and "not tuned" in tuning.choices_source()
    tuning.save_choices(cache, TUNED, {"seconds": 4.2})
    assert tuning.load_choices(cache) == TUNED
    tuning.forget_cached()
    assert tuning.current_choices() == TUNED and tuning.choices_source() == f"tuned ({cache})"
    assert json.loads(cache.read_text())["measured"] == {"seconds": 4.2}


def test_the_file_name_follows_the_machine_key():
    key = tuning.machine_key()
    assert {"cpu", "cores", "usable_cores", "numpy", "blas", "python", "attnkit"} <= set(key)
    assert tuning.cache_path(key) == tuning.cache_path()
    assert tuning.cache_path(dict(key, cpu="Intel Xeon")) != tuning.cache_path(key)


def _document(**changes):
    document = {"format": tuning.FORMAT, "machine": tuning.machine_key(),
                "choices": {"tile_l2_forward": None, "tile_l2_backward": None, "split_rows": 128,
                            "single_blas_rows": 2, "num_threads": 1}, "measured": {}}
    document.update(changes)
    return json.dumps(document).encode()


def _choices(**changes):
    return dict(json.loads(_document())["choices"], **changes)


IGNORED = {
    "not JSON": (b"\x89PNG\r\n\x1a\n binary", "not JSON"),
    "truncated": (_document()[:-20], "not JSON"),
    "another program's JSON": (b'{"tile_l2_forward": 262144}', "not an attnkit-tuning/1 file"),
    "a later format": (_document(format="attnkit-tuning/2"), "not an attnkit-tuning/1 file"),
    "a JSON list": (b"[1, 2]", "not an attnkit-tuning/1 file"),
    "another CPU": (_document(machine=dict(tuning.machine_key(), cpu="Intel(R) Xeon(R) Platinum 8375C")),
                    "another machine"),
    "more cores": (_document(machine=dict(tuning.machine_key(), cores=64)), "another machine"),
    "another numpy": (_document(machine=dict(tuning.machine_key(), numpy="1.26.4")), "other library versions"),
    "a value out of range": (_document(choices=_choices(split_rows=0)), "split_rows must be an integer"),
    "a count as text": (_document(choices=_choices(num_threads="2")), "num_threads must be an integer"),
    "a flag for a count": (_document(choices=_choices(single_blas_rows=True)), "single_blas_rows must be"),
    "a missing choice": (_document(choices={"split_rows": 128}), "must name exactly"),
    "an unknown choice": (_document(choices=_choices(tile_size=64)), "must name exactly"),
    "too large": (b" " * (tuning.MAX_FILE_BYTES + 1), "larger than"),
}


@pytest.mark.parametrize("case", sorted(IGNORED))
def test_a_foreign_corrupt_or_other_machines_file_is_ignored_for_the_defaults(case, cache):
    data, reason = IGNORED[case]
    cache.parent.mkdir(parents=True)
    cache.write_bytes(data)
    with pytest.raises(ValueError, match=reason):
        tuning.load_choices(cache)
    assert tuning.current_choices() == DEFAULT_CHOICES
    assert tuning.choices_source().startswith(f"defaults (ignored {cache}: ") and reason in tuning.choices_source()
    assert _threads.default_num_threads() == _threads._usable_count()  # the file's one thread is not used


def test_the_valid_variant_of_those_files_is_used(cache):
    """The documents above differ from a used one only by what each case changes."""
    cache.parent.mkdir(parents=True)
    cache.write_bytes(_document())
    assert tuning.current_choices() == Choices(split_rows=128, single_blas_rows=2, num_threads=1)


@pytest.mark.parametrize("value", ["0", "off", " false "])
def test_attnkit_tune_0_uses_the_defaults_whatever_the_file(value, cache, monkeypatch):
    tuning.save_choices(cache, TUNED)
    monkeypatch.setenv("ATTNKIT_TUNE", value)
    tuning.forget_cached()  # the environment is read with the file, once
    assert tuning.current_choices() == DEFAULT_CHOICES and tuning.choices_source() == "defaults (ATTNKIT_TUNE=0)"
    assert default_blocks(8, 4096, 4096) == default_blocks(8, 4096, 4096, l2=l2_bytes())


def test_a_bad_attnkit_tune_is_named(cache, monkeypatch):
    monkeypatch.setenv("ATTNKIT_TUNE", "maybe")
    tuning.forget_cached()
    with pytest.raises(ValueError, match="ATTNKIT_TUNE must be 0 .* got 'maybe'"):
        tuning.current_choices()


def test_the_tests_run_untuned():
    """tests/conftest.py turns tuning off before attnkit is imported."""
    assert os.environ["ATTNKIT_TUNE"] == "0" and tuning.current_choices() == DEFAULT_CHOICES


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(cache, monkeypatch):
    tuning.save_choices(cache, TUNED)
    before = cache.read_bytes()

    def no_rename(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="No space"):
        tuning.save_choices(cache, DEFAULT_CHOICES)
    assert cache.read_bytes() == before and os.listdir(cache.parent) == [cache.name]


def test_a_record_that_cannot_be_written_changes_nothing(cache):
    tuning.save_choices(cache, TUNED)
    before = cache.read_bytes()
    with pytest.raises(TypeError):
        tuning.save_choices(cache, DEFAULT_CHOICES, {"when": object()})
    assert cache.read_bytes() == before and os.listdir(cache.parent) == [cache.name]


@pytest.mark.parametrize("field, value", [("split_rows", 0), ("num_threads", 1025), ("tile_l2_forward", 1024),
                                          ("single_blas_rows", -1), ("split_rows", 2.0)])
def test_choices_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Choices(**{field: value})


def test_pinned_refuses_what_is_not_choices():
    with pytest.raises(TypeError, match="Choices"):
        with pinned({"split_rows": 64}):
            pass


# -- each choice reaches its kernel ---------------------------------------------------------------------------

def test_the_tile_choices_size_the_forward_and_backward_tiles():
    with pinned(Choices(tile_l2_forward=256 << 10, tile_l2_backward=2 << 20)):
        assert default_blocks(8, 4096, 4096, split="q") == (128, 128)
        assert default_blocks(8, 4096, 4096, split="k") == (512, 512)
        assert default_blocks(8, 4096, 4096, split="q", l2=2 << 20) == (512, 512)  # an explicit L2 wins
    with pinned(Choices(tile_l2_forward=2 << 20)):
        assert default_blocks(8, 4096, 4096, split="q") == (512, 512)


def test_a_tuned_tile_computes_the_same_attention(rng):
    """Another tile is another summation order: the same attention within float32 rounding, and the same bits
    run after run for one pinned choice."""
    q, k, v = (rng.standard_normal((1, 2, 300, 16)).astype(np.float32) for _ in range(3))
    expected = reference_forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)[0]
    outs = {}
    for l2 in (256 << 10, 2 << 20):
        with pinned(Choices(tile_l2_forward=l2)):
            outs[l2] = flash_attention_forward(q, k, v, causal=True, num_threads=1)[0]
            again = flash_attention_forward(q, k, v, causal=True, num_threads=1)[0]
        assert np.array_equal(outs[l2], again)
        np.testing.assert_allclose(outs[l2], expected, rtol=2e-5, atol=2e-6)


def test_the_split_threshold_decides_when_a_product_is_split(rng, monkeypatch):
    a = rng.standard_normal((300, 256)).astype(np.float32)  # (M, K): 300 * 256 * 512 multiply-adds > 2**25
    b = rng.standard_normal((256, 512)).astype(np.float32)  # (K, N)
    calls = []
    monkeypatch.setattr(linear, "split_product", lambda a, b, workers: calls.append(workers) or a @ b)
    with _threads.num_threads(2):
        with pinned(Choices(split_rows=256)):
            linear.product(a, b)
        with pinned(Choices(split_rows=512)):
            linear.product(a, b)
        with pinned(Choices(split_rows=1 << 20)):
            linear.product(a, b)
    assert calls == [2]


def test_the_thread_choice_is_the_default_count_below_set_num_threads():
    with pinned(Choices(num_threads=1)):
        assert _threads.default_num_threads() == 1
        with _threads.num_threads(3):
            assert _threads.default_num_threads() == 3
    with pinned(Choices(num_threads=1024)):  # never above the usable cores
        assert _threads.default_num_threads() == _threads._usable_count()


def test_decoding_steps_keep_blas_on_one_thread_up_to_the_tuned_tokens(monkeypatch):
    monkeypatch.setattr(_threads, "blas_single_thread", lambda: "one")
    monkeypatch.setattr(_threads, "blas_on_free_cores", lambda: "free")
    monkeypatch.setattr(_threads, "one_row_blas", lambda: "measured")
    monkeypatch.delenv("ATTNKIT_ONE_ROW_BLAS", raising=False)
    with pinned(Choices(single_blas_rows=4)):
        assert [_threads.decode_blas(n) for n in (1, 4, 5, 64)] == ["one", "one", "free", "free"]
        monkeypatch.setenv("ATTNKIT_ONE_ROW_BLAS", "all")  # the environment still decides one token
        assert _threads.decode_blas(1) == "measured"
    monkeypatch.delenv("ATTNKIT_ONE_ROW_BLAS")
    with pinned(Choices(single_blas_rows=0)):
        assert [_threads.decode_blas(n) for n in (1, 2)] == ["free", "free"]
    assert [_threads.decode_blas(n) for n in (1, 2)] == ["measured", "free"]  # untuned: as before tuning


def test_every_benchmark_says_which_choices_it_ran_with():
    """attnkit bench and the benchmark modules print attnkit.benchmarks.machine.describe() first."""
    from attnkit.benchmarks.machine import describe, machine_info

    line = next(x for x in describe() if x.startswith("# tuning: "))
    assert line.endswith("threads all; defaults (ATTNKIT_TUNE=0)") and "split from 256 rows" in line
    with pinned(TUNED):
        assert "# tuning: tiles for 256 KiB / 2048 KiB (fwd / bwd); split from 512 rows; 1 BLAS thread to 4 tokens; " \
               "threads 1; pinned" in describe()
        assert machine_info()["tuning"].startswith("tiles for 256 KiB")


def test_the_described_decoding_blas_choice_reads_right_at_every_value():
    lines = [tuning.describe_choices(Choices(single_blas_rows=n), "x") for n in (None, 0, 2)]
    assert ["1 token if faster" in lines[0], "BLAS threaded at every size" in lines[1],
            "1 BLAS thread to 2 tokens" in lines[2]] == [True, True, True]
