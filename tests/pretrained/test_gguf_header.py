"""GGUF headers: what reading one costs, and what it checks. Files are written byte by byte in the test
(``gguf_models.write_raw_gguf``: any header, of any size, quickly) or converted from tiny random transformers
models (``gguf_models.write_gguf``) and rewritten with one key changed.

Costs are asserted as ratios, never as wall-time thresholds: peak traced allocations (``tracemalloc``) against
the file's size, Python calls (``sys.setprofile``) against the count of items read, and, for the one cost only a
clock shows (slicing characters inside C), the time of a long input against a short one's.
"""
from __future__ import annotations

import re
import sys
import time
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
import gguf_models as gm  # noqa: E402
from attnkit.pretrained import load, load_causal_lm  # noqa: E402
from attnkit.pretrained.gguf_file import read_gguf, read_gguf_strings  # noqa: E402
from attnkit.pretrained.gguf_tokenizer import gguf_tokenizer  # noqa: E402

_TENSOR = (("token_embd.weight", np.zeros((4, 8), np.float32)),)


def _header_file(path, metadata=None, tensors=_TENSOR, **kwargs):
    """A llama file of ``metadata`` (beyond general.architecture) and ``tensors``, for what reading checks."""
    return gm.write_raw_gguf(path, {"general.architecture": ("string", "llama"), **(metadata or {})}, tensors,
                             **kwargs)


def _peak(fn) -> int:
    """Peak bytes traced while ``fn()`` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _calls(fn) -> int:
    """Python and C function calls made while ``fn()`` runs."""
    count = 0

    def tally(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(tally)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _fastest(fn, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _spm(tokens: list[str]) -> dict:
    """A SentencePiece vocabulary's metadata: <unk>, <s>, </s>, the 256 byte tokens, then ``tokens``, scored by
    their order (no merges: readers rebuild them)."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *tokens]
    return {"tokenizer.ggml.model": ("string", "llama"), "tokenizer.ggml.tokens": ("array[string]", pieces),
            "tokenizer.ggml.scores": ("array[float32]", -np.arange(len(pieces), dtype=np.float32)),
            "tokenizer.ggml.token_type": ("array[int32]", [2, 3, 3] + [6] * 256 + [1] * len(tokens)),
            "tokenizer.ggml.bos_token_id": ("uint32", 1), "tokenizer.ggml.eos_token_id": ("uint32", 2)}


# -- a header costs a bounded multiple of its bytes ------------------------------------------------------------
@pytest.mark.parametrize("kind, count", [("array[uint8]", 400_000), ("array[float32]", 100_000),
                                         ("array[bool]", 400_000)])
def test_a_large_numeric_array_is_one_copy_of_its_bytes(kind, count, tmp_path):
    """gguf's reader made a NumPy view per element: a 10 MB array took 166 s and 7 GB."""
    values = np.arange(count) % 2
    path = _header_file(tmp_path / "big.gguf", {"junk.values": (kind, values)})
    size = path.stat().st_size
    peak = _peak(lambda: read_gguf(path))
    assert peak <= size + (256 << 10), (peak, size)
    small = _header_file(tmp_path / "small.gguf", {"junk.values": (kind, values[:100])})
    # vectorised: the same calls whatever the count (gguf's reader made several per element)
    assert abs(_calls(lambda: read_gguf(path)) - _calls(lambda: read_gguf(small))) <= 8
    np.testing.assert_array_equal(read_gguf(path).metadata["junk.values"], values)


def test_a_large_string_array_costs_a_bounded_multiple_of_its_bytes(tmp_path):
    words = [f"w{i:07d}" for i in range(100_000)]  # 8 characters each: 16 bytes in the file
    path = _header_file(tmp_path / "words.gguf", {"junk.words": ("array[string]", words)})
    size = path.stat().st_size
    peak = _peak(lambda: read_gguf(path))
    assert peak <= 6 * size, (peak, size)  # one str (57 bytes) and one list slot (8) per 16 bytes read
    half = _header_file(tmp_path / "half.gguf", {"junk.words": ("array[string]", words[:50_000])})
    per_word = (_calls(lambda: read_gguf(path)) - _calls(lambda: read_gguf(half))) / 50_000
    assert per_word <= 4, per_word
    assert read_gguf(path).metadata["junk.words"] == words


def test_an_array_of_arrays_is_refused_as_llama_cpp_refuses_it(tmp_path):
    nested = (9).to_bytes(4, "little") + (9).to_bytes(4, "little") + (1 << 30).to_bytes(8, "little")
    path = _header_file(tmp_path / "nested.gguf", {"junk.nested": ("raw", nested)})
    with pytest.raises(ValueError, match=r"metadata 'junk\.nested' is an array of arrays, which GGUF readers"):
        read_gguf(path)


def test_the_strings_alone_are_read_past_every_kind_of_value(tmp_path):
    """``read_gguf_strings`` walks the header without building what it passes: numbers, strings, arrays of numbers
    and of strings, and the nested array llama.cpp refuses (stepped over here: no value of it is wanted)."""
    nested = (9).to_bytes(4, "little") + (9).to_bytes(4, "little") + (1).to_bytes(8, "little") + \
        (6).to_bytes(4, "little") + (2).to_bytes(8, "little") + np.float32([1, 2]).tobytes()
    metadata = {"junk.count": ("uint32", 7), "junk.scale": ("float64", 0.5), "junk.note": ("string", "skip me"),
                "junk.ids": ("array[int32]", [1, 2, 3]), "junk.words": ("array[string]", ["a", "bc"]),
                "junk.nested": ("raw", nested), "tokenizer.chat_template": ("string", "{{ messages }}"),
                "tokenizer.chat_template.tool_use": ("string", "tools \u00e9")}
    path = _header_file(tmp_path / "strings.gguf", metadata)
    wanted = read_gguf_strings(path, lambda key: key.startswith("tokenizer.chat_template"))
    assert wanted == {"tokenizer.chat_template": "{{ messages }}", "tokenizer.chat_template.tool_use": "tools \u00e9"}
    assert read_gguf_strings(path, lambda key: key == "junk.note") == {"junk.note": "skip me"}
    data = path.read_bytes()
    end = data.index(b"{{ messages }}")
    for cut in (10, 40, end - 3, end + 5):  # inside the counts, a skipped value, a wanted value's length and bytes
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\.gguf is truncated or corrupt .* runs past the end of the file"):
            read_gguf_strings(tmp_path / "cut.gguf", lambda key: key.startswith("tokenizer."))
    (tmp_path / "notes.gguf").write_text("{}")
    with pytest.raises(ValueError, match=r"notes\.gguf is not a GGUF file: it starts with b'\{\}', not b'GGUF'"):
        read_gguf_strings(tmp_path / "notes.gguf", lambda key: True)


def test_a_long_sentencepiece_piece_costs_what_its_characters_do(tmp_path):
    """The merge rebuild sliced every split of every piece: a 1.2 MB piece took over 150 s."""
    base = ["\u2581", "a", "b", "ab", "\u2581ab"]  # ids 259 .. 263: "ab" = a + b, "\u2581ab" = \u2581 + ab
    times = {}
    for length in (20_000, 320_000):
        path = _header_file(tmp_path / f"long{length}.gguf", _spm(base + ["ab" * (length // 2)]))
        file = read_gguf(path)
        times[length] = _fastest(lambda file=file: gguf_tokenizer(file))
        assert gguf_tokenizer(file).encode("ab ab", add_special_tokens=False) == [263, 263]
    # 16 times the characters: quadratic slicing took 256 times as long; now both cost about the vocabulary
    assert times[320_000] < 4 * times[20_000], times


def test_a_vocabulary_of_pieces_that_split_every_way_is_refused_within_a_budget(tmp_path):
    """Pieces 'a' * 1 .. 'a' * 700 split in every way: their merges would hold ~k**3 / 3 characters."""
    path = _header_file(tmp_path / "ladder.gguf", _spm(["a" * n for n in range(2, 701)]))
    size = path.stat().st_size
    file = read_gguf(path)
    peak = _peak(lambda: pytest.raises(ValueError, gguf_tokenizer, file))
    with pytest.raises(ValueError, match=r"ladder\.gguf: metadata 'tokenizer\.ggml\.tokens' holds pieces that split "
                                         r"in too many ways"):
        gguf_tokenizer(file)
    assert peak <= 32 * size, (peak, size)  # the merges kept stop at 8 characters per character of the vocabulary


def test_merges_rebuilt_from_scores_equal_transformers(tmp_path):
    """The faster rebuild keeps transformers' order exactly: ties of score, of lengths, duplicate pieces."""
    from transformers.tokenization_utils_base import generate_merges

    rng = np.random.default_rng(0)
    pieces = ["a", "b", "c", "\u2581"]
    while len(pieces) < 3000:
        joined = pieces[int(len(pieces) * rng.random() ** 2)] + pieces[int(len(pieces) * rng.random() ** 2)]
        if len(joined) <= 8 and joined not in pieces:
            pieces.append(joined)
    tokens = pieces + pieces[100:110]  # duplicates: the last id wins, the first place
    from attnkit.pretrained import gguf_tokenizer as module

    file = read_gguf(_header_file(tmp_path / "v.gguf"))
    for tie in (1, 7, 1000):  # distinct scores, groups of 7, groups of 1000
        scores = dict(zip(tokens, [-float(i // tie) for i in range(len(tokens))]))
        vocab = {t: i for i, t in enumerate(tokens)}
        assert module._merges_from_scores(file, tokens, scores) == generate_merges(vocab, scores)


def test_reading_a_vocabulary_costs_a_few_calls_per_token(tmp_path):
    """The GGUF load was 8x the folder's: the reader made ~80 Python calls per token and per merge."""
    tokens = [f"t{i}" for i in range(8000)]
    merges = [f"t{i} t{i + 1}" for i in range(0, 7000, 7)]
    tokens += [f"t{i}t{i + 1}" for i in range(0, 7000, 7)]
    meta = {"tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "default"),
            "tokenizer.ggml.tokens": ("array[string]", tokens), "tokenizer.ggml.merges": ("array[string]", merges),
            "tokenizer.ggml.token_type": ("array[int32]", [1] * len(tokens))}
    path = _header_file(tmp_path / "bpe.gguf", meta)
    items = len(tokens) + len(merges)
    assert _calls(lambda: read_gguf(path)) <= 4 * items + 2000
    file = read_gguf(path)
    assert _calls(lambda: gguf_tokenizer(file)) <= 2 * items + 2000


# -- every key attnkit reads has its GGUF type checked; tensor data aligned, inside, not overlapping ---------
@pytest.mark.parametrize("key, value, expected", [
    ("tokenizer.ggml.eot_token_id", ("float32", 3.0), "is a float32, but attnkit reads it as an integer"),
    ("tokenizer.ggml.add_bos_token", ("string", "true"), "is a string, but attnkit reads it as a bool"),
    ("llama.context_length", ("float64", 64.0), "is a float64, but attnkit reads it as an integer"),
    ("llama.rope.freq_base", ("string", "1e4"), "is a string, but attnkit reads it as a number"),
    ("tokenizer.ggml.tokens", ("array[uint8]", [1, 2]), "is an array[uint8], but attnkit reads it as an array "
                                                        "of strings"),
    ("tokenizer.ggml.scores", ("array[string]", ["1"]), "is an array[string], but attnkit reads it as an array "
                                                        "of numbers"),
    ("tokenizer.chat_template.tool_use", ("uint32", 1), "is a uint32, but attnkit reads it as a string"),
    ("general.alignment", ("uint64", 32), "is a uint64, but GGUF readers read it as a uint32"),
])
def test_metadata_of_another_type_is_refused_naming_the_key(key, value, expected, tmp_path):
    path = _header_file(tmp_path / "typed.gguf", {key: value})
    with pytest.raises(ValueError, match=re.escape(f"typed.gguf: metadata '{key}' {expected}")):
        read_gguf(path)


_TWO = (("a.weight", np.zeros((4, 8), np.float32)), ("b.weight", np.zeros((4, 8), np.float32)))


@pytest.mark.parametrize("offsets, alignment, message", [
    ([0, 36], None, r"tensor 'b\.weight' starts at data offset 36, not a multiple of general\.alignment \(32\)"),
    ([0, 96], 64, r"tensor 'b\.weight' starts at data offset 96, not a multiple of general\.alignment \(64\)"),
    ([0, 0], None, r"tensors 'a\.weight' \(data bytes 0 to 128\) and 'b\.weight' \(from 0\) overlap"),
    ([0, 64], None, r"tensors 'a\.weight' \(data bytes 0 to 128\) and 'b\.weight' \(from 64\) overlap"),
    ([0, 1 << 20], None, r"is truncated: tensor 'b\.weight' needs bytes up to \d+, the file has \d+"),
])
def test_tensor_data_misaligned_overlapping_or_outside_the_file_is_refused(offsets, alignment, message, tmp_path):
    meta = {} if alignment is None else {"general.alignment": ("uint32", alignment)}
    path = _header_file(tmp_path / "layout.gguf", meta, _TWO, offsets=offsets, alignment=alignment or 32)
    with pytest.raises(ValueError, match=r"layout\.gguf.*" + message):
        read_gguf(path)
    good = _header_file(tmp_path / "good.gguf", meta, _TWO, alignment=alignment or 32)
    assert set(read_gguf(good).tensors) == {"a.weight", "b.weight"}


# -- files converted from a model, one key changed ------------------------------------------------------------
@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("gguf_header") / "llama.gguf"
    gm.write_gguf(gm.build_model("llama"), path)
    return path


def _changed(source, path, **changes):
    """``source`` (an F32 file) rewritten with metadata keys changed: key -> (type, value), or None to drop it."""
    reader = gguf.GGUFReader(str(source))
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = field.types[0].name.lower()
        if kind == "array":
            kind = f"array[{field.types[-1].name.lower()}]"
        metadata[key] = (kind, field.contents())
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    tensors = [(t.name, np.asarray(t.data).reshape(tuple(int(n) for n in reversed(t.shape)))) for t in reader.tensors]
    return gm.write_raw_gguf(path, metadata, tuple(tensors))


@pytest.mark.parametrize("changes, message", [
    (dict(llama__attention__head_count_kv=("uint32", 3)),
     r"metadata 'llama\.attention\.head_count_kv' = 3 must divide 'llama\.attention\.head_count' = 4"),
    (dict(llama__context_length=("uint64", 1 << 40)),
     r"metadata 'llama\.context_length' must be a positive integer up to 2147483647, got 1099511627776"),
    (dict(llama__embedding_length=("uint32", 30)),
     r"metadata 'llama\.embedding_length' = 30 is not a multiple of 'llama\.attention\.head_count' = 4"),
    (dict(llama__rope__dimension_count=("uint32", 5)),
     r"metadata 'llama\.rope\.dimension_count' = 5 must be an even number of at most the 8 features of a head"),
    (dict(tokenizer__ggml__merges=("array[string]", ["t1 t2 t3"])),
     r"metadata 'tokenizer\.ggml\.merges' item 0 is 't1 t2 t3', not two tokens joined by a space"),
    (dict(tokenizer__ggml__merges=("array[string]", ["t1 t2"])),  # tokenizers aborted the process on this one
     r"metadata 'tokenizer\.ggml\.merges' item 0 \('t1 t2'\) needs the token 't1t2', which tokenizer\.ggml\.tokens "
     r"does not hold"),
    (dict(tokenizer__ggml__token_type=("array[int32]", [1, 1])),
     r"metadata 'tokenizer\.ggml\.token_type' has 2 entries; it must have one per token \(96"),
    (dict(tokenizer__ggml__tokens=None),
     r"metadata 'tokenizer\.ggml\.tokens' must be a non-empty array of strings, and the file has none"),
])
def test_messages_name_the_files_own_keys(changes, message, model_file, tmp_path):
    path = _changed(model_file, tmp_path / "changed.gguf", **changes)
    with pytest.raises(ValueError, match=r"changed\.gguf: " + message) as info:
        load(path)
    for internal in ("PyMerges", "index out of range", "num_key_value_heads", "max_position_embeddings",
                     "partial_factor", " config: "):
        assert internal not in str(info.value)


# -- special ids inside the vocabulary ------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["eot_token_id", "eom_token_id", "padding_token_id", "bos_token_id",
                                 "unknown_token_id", "seperator_token_id", "eos_token_id"])
def test_special_ids_past_the_vocabulary_are_refused_naming_the_key(key, model_file, tmp_path):
    path = _changed(model_file, tmp_path / "ids.gguf", **{f"tokenizer__ggml__{key}": ("uint32", 96)})
    for loader in (load, load_causal_lm):  # the model alone reads eos, eot, eom, bos and pad into its config
        with pytest.raises(ValueError, match=rf"ids\.gguf: metadata 'tokenizer\.ggml\.{key}' = 96 is not a token "
                                             rf"id of the vocabulary \(tokenizer\.ggml\.tokens holds 96 tokens\)"):
            loader(path)


def test_special_ids_past_the_models_vocab_size_are_refused(model_file, tmp_path):
    path = _changed(model_file, tmp_path / "small.gguf", llama__vocab_size=("uint32", 50))
    with pytest.raises(ValueError, match=r"small\.gguf: metadata 'tokenizer\.ggml\.eos_token_id' = 95 is not a "
                                         r"token id of the vocabulary \(llama\.vocab_size = 50\)"):
        load_causal_lm(path)
    model, tokenizer = load(model_file)
    assert model.generate(np.array([[1, 2]]), max_new_tokens=2).shape == (1, 4)  # the unchanged file runs
