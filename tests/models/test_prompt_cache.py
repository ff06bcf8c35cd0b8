"""A cache saved to a file and loaded back continues as the saved one would, on every family (recurrent states,
ring buffers past their window, latents, shared keys); a file that is not one, is damaged, or belongs to
another model or dtype is refused with one line and nothing from it is used; prefill reads only what a cache
lacks."""
import io
import json
import tracemalloc
import zipfile

import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit.decoding.prompt_cache import (  # noqa: E402
    PromptCacheError,
    fingerprint,
    load_prompt_cache,
    prefill,
    save_prompt_cache,
)
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

# Rotary scalings that change with the sequence's length make cached and uncached runs differ by design.
LENGTH_DEPENDENT = ("llama_dynamic", "phi3_longrope")


@pytest.mark.parametrize("name", [name for name in FAMILY_MODELS if name not in LENGTH_DEPENDENT])
def test_a_cache_loaded_from_its_file_continues_as_a_fresh_prefill(tmp_path, name):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=np.float64)
    ids = np.random.default_rng(5).integers(0, lm.config.vocab_size, size=(2, 19))
    cache = lm.new_cache(2)
    lm(ids[:, :16], cache=cache)  # past every tiny model's window, so rings have dropped slots
    path = save_prompt_cache(tmp_path / "prompt.cache", lm, cache)
    loaded = load_prompt_cache(path, lm)
    assert loaded.token_ids.tolist() == ids[:, :16].tolist() and loaded.length == 16
    got = lm(ids[:, 16:18], cache=loaded)  # (2, 2, V): a chunk, then a step
    stepped = lm(ids[:, 18:], cache=loaded)  # (2, 1, V)
    want = lm(ids)  # (2, 19, V)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want[:, 16:18], rtol=1e-11, atol=1e-11 * scale)
    np.testing.assert_allclose(stepped, want[:, 18:], rtol=1e-11, atol=1e-11 * scale)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder, _ = saved_model("llama_gqa", tmp_path_factory.mktemp("llama"))
    return folder


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """A float32 Llama and the file of its cache after 7 ids."""
    lm = load_causal_lm(llama, dtype=np.float32)
    cache = lm.new_cache(1)
    prefill(lm, cache, np.arange(1, 9)[None])
    return lm, save_prompt_cache(tmp_path_factory.mktemp("cache") / "p.cache", lm, cache)


def test_prefill_reads_only_what_the_cache_lacks_and_leaves_the_last_id(llama):
    lm = load_causal_lm(llama, dtype=np.float64)
    cache = lm.new_cache(1)
    assert prefill(lm, cache, [[3, 4, 5, 6, 7]]) == 4 and cache.token_ids.tolist() == [[3, 4, 5, 6]]
    assert prefill(lm, cache, [[3, 4, 5, 6, 7]]) == 0  # the same prompt again: nothing to read
    assert prefill(lm, cache, [[3, 4, 9, 9, 9, 9]]) == 3 and cache.token_ids.tolist() == [[3, 4, 9, 9, 9]]
    np.testing.assert_allclose(lm([[9]], cache=cache)[0, -1], lm([[3, 4, 9, 9, 9, 9]])[0, -1], rtol=1e-12,
                               atol=1e-12)


def test_the_fingerprint_follows_the_weights_and_the_dtype(llama, tmp_path):
    a32, b32 = load_causal_lm(llama, dtype=np.float32), load_causal_lm(llama, dtype=np.float32)
    assert fingerprint(a32) == fingerprint(b32)
    assert fingerprint(load_causal_lm(llama, dtype=np.float64)) != fingerprint(a32)
    weights = [array for _, array in b32.named_parameters()]
    weights[len(weights) // 2] += np.float32(1e-3)  # one tensor nudged, as any fine-tune nudges them
    assert fingerprint(b32) != fingerprint(a32)


def rewrite(path, target, edit):
    """A copy of the prompt-cache zip at ``path`` with ``edit(name, bytes) -> bytes or None`` (None drops it)."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(target, "w") as out:
        for info in source.infolist():
            data = edit(info.filename, source.read(info))
            if data is not None:
                out.writestr(info.filename, data)
    return target


def npy(array):
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def header_with(**changes):
    def edit(name, data):
        if name != "header.npy":
            return data
        header = json.loads(np.load(io.BytesIO(data)).tobytes())
        return npy(np.frombuffer(json.dumps({**header, **changes}).encode(), np.uint8))
    return edit


@pytest.mark.parametrize("edit, words", [
    (lambda name, data: data[:len(data) // 2] if name == "layers.0.keys.npy" else data, "cut short"),
    (lambda name, data: data + b"\0" * 8 if name == "token_ids.npy" else data, "cut short or padded"),
    (lambda name, data: None if name == "header.npy" else data, "no header"),
    (lambda name, data: None if name == "layers.1.values.npy" else data, "no 'layers.1.values'"),
    (header_with(version=2), "another version of attnkit"),
    (header_with(format="something else"), "another format"),
    (header_with(fingerprint="0" * 32), "written for another model"),
    (header_with(dtype="float64"), "written for float64"),
    (header_with(length=3), "header says 3 positions but its arrays hold 7"),
    (header_with(batch_size=0), "a damaged header"),
    (lambda name, data: npy(np.zeros((1, 7), np.float64)) if name == "token_ids.npy" else data, "int64"),
    (lambda name, data: npy(np.array([[object()]], dtype=object)) if name == "token_ids.npy" else data,
     "of objects"),
    (lambda name, data: data if name != "header.npy" else npy(np.frombuffer(b"not json", np.uint8)), "not JSON"),
])
def test_a_damaged_or_foreign_file_is_refused_with_one_line(saved, tmp_path, edit, words):
    lm, path = saved
    bad = rewrite(path, tmp_path / "bad.cache", edit)
    with pytest.raises(PromptCacheError, match=words) as caught:
        load_prompt_cache(bad, lm)
    assert "\n" not in str(caught.value)


def test_a_file_that_is_no_zip_at_all_or_is_truncated_is_refused(saved, tmp_path):
    lm, path = saved
    (tmp_path / "text.cache").write_text("hello")
    (tmp_path / "cut.cache").write_bytes(path.read_bytes()[:-40])
    for name in ("text.cache", "cut.cache"):
        with pytest.raises(PromptCacheError, match="not a prompt cache file"):
            load_prompt_cache(tmp_path / name, lm)


def test_another_models_file_is_refused(saved, tmp_path):
    lm, path = saved
    folder, _ = saved_model("qwen3", tmp_path)
    with pytest.raises(PromptCacheError, match="written for another model"):
        load_prompt_cache(path, load_causal_lm(folder, dtype=np.float32))


def test_a_header_claiming_a_huge_array_is_refused_before_anything_is_read(saved, tmp_path):
    lm, path = saved

    def huge(name, data):
        if name != "layers.0.keys.npy":
            return data
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (1, 2, 10**9, 4)})
        return header.getvalue() + data[len(header.getvalue()):]
    bad = rewrite(path, tmp_path / "huge.cache", huge)
    tracemalloc.start()
    try:
        with pytest.raises(PromptCacheError, match="cut short or padded"):
            load_prompt_cache(bad, lm)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**22  # the claimed array is 32 GB


def test_saving_writes_atomically_and_refuses_a_cache_left_between_layers(saved, tmp_path):
    lm, path = saved
    cache = load_prompt_cache(path, lm)
    before = path.read_bytes()
    first = next(entry for entry in cache.entries if entry is not None)
    step = np.zeros((first.batch_size, first.num_kv_heads, 1, first.head_dim), first.dtype)  # (B, Hkv, 1, Dh)
    first.update(step, step)  # as a forward stopped after its first layer leaves it
    with pytest.raises(ValueError, match="stopped part-way"):
        save_prompt_cache(path, lm, cache)
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == [path.name]
