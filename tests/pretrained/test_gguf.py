"""GGUF files on attnkit, built offline in the test: tiny random transformers models written the way llama.cpp's
converter writes them (tests/gguf_models.py: its metadata, tensor names, q/k permutation, Gemma's norm offset,
GPT-2's transposes, the hybrids' Mamba-2 tensors and split input_linear), in every quantisation type attnkit reads.

References. Logits are compared with transformers' own GGUF loading of the same file
(``from_pretrained(folder, gguf_file=...)``) and with the float model the file was written from, within 2e-5
of the largest logit (float32 through two or three layers; F32 files are lossless). transformers' GGUF loader
does not read everything llama.cpp does (OLMo 2 at all; Qwen3's head_dim, Gemma's softcaps and
query_pre_attn_scalar, rotary scalings, Llama biases, Phi-3's longrope factors): those files are compared with
the float model only. Quantized files have no float twin: their logits are compared with transformers' loading,
and their weights with ``gguf.quants.dequantize`` of the stored blocks. Tokenizers are compared with
``AutoTokenizer.from_pretrained(folder, gguf_file=...)``.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
import gguf_models as gm  # noqa: E402
from attnkit.cli import main  # noqa: E402
from attnkit.pretrained import load, load_causal_lm  # noqa: E402
from attnkit.pretrained.gguf_file import read_gguf  # noqa: E402
from hf_models import build_hf_model, hf_greedy, hf_logits, left_padded_batch  # noqa: E402
from text_models import CHATML, CORPUS, LLAMA2, write_chat_tokenizer  # noqa: E402

TOL = 2e-5  # max |ours - theirs| / max |theirs| over the logits
# hf_models specs llama.cpp reads whole but transformers' GGUF loader does not (see the module docstring).
FLOAT_ONLY_HF = ("gpt2", "llama_gqa", "llama_yarn", "llama_llama3", "llama_linear", "qwen3", "olmo2",
                 "olmo2_bias_mqa", "phi3_longrope", "phi3_partial_window", "glm4", "lfm2", "lfm2_bias", "glm4_moe",
                 "glm4_moe_plain",
                 # llama.cpp's granitehybrid: Bamba (rotary, read as Granite 4 hybrid) and Granite 4 hybrid without
                 # experts (position-free, attention first, biases, a tied head)
                 "bamba", "granitemoehybrid_dense")
TEXTS = [" Héllo wörld, naïve café", "  two leading spaces", "日本語の文章です。", "emoji \U0001f600\U0001f680 €£¥",
         "mixed: Crème brûlée 😀 日本 \n\tnew line", "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Café? 日本語 😀"}, {"role": "assistant", "content": " ok, naïve"},
        {"role": "user", "content": "  again"}]


def _rel(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _written(root, name, model, **kwargs):
    path = root / f"{name}.gguf"
    if not path.exists():
        gm.write_gguf(model, path, **kwargs)
    return path


@pytest.mark.parametrize("name", [n for n in gm.TRANSFORMERS_READABLE if n != "llama_wide"])
def test_logits_equal_transformers_gguf_loading_and_the_float_model(name, root):
    model = gm.build_model(name)
    path = _written(root, name, model)
    lm = load_causal_lm(path)
    ids, mask = left_padded_batch(np.random.default_rng(3), (9, 4))
    ours = lm(ids, mask).astype(np.float64)
    theirs = hf_logits(gm.transformers_gguf_model(root, path.name), ids, mask)
    assert _rel(ours[mask], theirs[mask]) <= TOL
    assert _rel(ours[mask], hf_logits(model, ids, mask)[mask]) <= TOL


@pytest.mark.parametrize("name", FLOAT_ONLY_HF + tuple(gm.FLOAT_ONLY))
def test_logits_equal_the_float_model_where_transformers_reads_less(name, root):
    model = gm.build_model(name) if name in gm.FLOAT_ONLY else build_hf_model(name)
    lm = load_causal_lm(_written(root, f"float_{name}", model))
    # 12 tokens: past phi3_longrope's 8-token original context (its long factors) and past every window
    ids, mask = left_padded_batch(np.random.default_rng(4), (12, 5))
    ours = lm(ids, mask).astype(np.float64)
    assert _rel(ours[mask], hf_logits(model, ids, mask)[mask]) <= TOL


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen2", "gpt2"])
def test_greedy_tokens_equal_transformers_gguf_generate(name, root):
    path = _written(root, name, gm.build_model(name))
    lm = load_causal_lm(path)
    theirs = gm.transformers_gguf_model(root, path.name)
    ids, mask = left_padded_batch(np.random.default_rng(5), (5, 3))
    ours = lm.generate(ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(ours, hf_greedy(theirs, ids, mask, 8, eos_token_id=None, pad_token_id=0))


@pytest.mark.parametrize("name", ["granitemoehybrid_nope", "nemotron_h_no_floor"])
def test_greedy_tokens_of_a_hybrid_file_equal_the_float_models(name, root):
    """Decoding through the Mamba-2 layers' state caches of a GGUF-read hybrid (transformers reads neither file)."""
    model = gm.build_model(name)
    lm = load_causal_lm(_written(root, f"float_{name}", model))
    ids, mask = left_padded_batch(np.random.default_rng(5), (5, 3))
    ours = lm.generate(ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(ours, hf_greedy(model, ids, mask, 8, eos_token_id=None, pad_token_id=0))


def test_llama3_rope_freqs_become_the_rotary_divisors(root):
    lm = load_causal_lm(_written(root, "float_llama_llama3", build_hf_model("llama_llama3")))
    scaling = lm.config.rotary.scaling
    assert scaling["rope_type"] == "longrope" and scaling["short_factor"] == scaling["long_factor"]
    assert scaling["attention_factor"] == 1.0 and max(scaling["short_factor"]) == 8.0


def test_end_of_turn_ids_end_generation_as_in_llama_cpp(tmp_path):
    meta = {**gm.plain_vocabulary(96, 1, 95), "eot_token_id": 94}
    path = tmp_path / "eot.gguf"
    gm.write_gguf(gm.build_model("llama"), path, tokenizer=meta)
    lm, tokenizer = load(path)
    assert lm.config.tokens.eos == (95, 94) and tokenizer.eos_token_ids == (95, 94)


def test_mistral_is_written_and_read_as_llama(root):
    path = _written(root, "mistral", gm.build_model("mistral"))
    file = read_gguf(path)
    assert file.architecture == "llama" and load_causal_lm(path).config.family == "llama"


@pytest.mark.parametrize("name, family, types, window", [
    ("olmo3_yarn", "olmo3", ("sliding_attention",) * 3 + ("full_attention",), 3),
    ("olmo3_layer_types", "olmo3", ("full_attention", "sliding_attention", "full_attention"), 2),
    ("olmo2", "olmo2", ("full_attention",) * 2, None)])
def test_olmo3_is_written_as_olmo2_and_read_back_as_olmo3(name, family, types, window, root):
    """llama.cpp has no olmo3 architecture: its olmo2 files with a window and per-layer flags are OLMo 3's."""
    model = gm.build_model(name) if name in gm.FLOAT_ONLY else build_hf_model(name)
    path = _written(root, f"float_{name}", model)
    config = load_causal_lm(path).config
    assert read_gguf(path).architecture == "olmo2"
    assert (config.family, config.layer_types, config.attention.sliding_window) == (family, types, window)


def test_glm4moe_leaves_only_the_declared_multi_token_prediction_blocks_unread(tmp_path, monkeypatch):
    """llama.cpp keeps GLM-4.5's multi-token-prediction layer as a block after the model's; the float test reads
    past it as nextn_predict_layers says. A file that does not declare it has one more layer, whose NEXTN
    tensors are unexpected."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_nextn_predict_layers", lambda self, count: None)
    path = tmp_path / "undeclared.gguf"
    gm.write_gguf(build_hf_model("glm4_moe"), path)
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.3\.nextn\."):
        load_causal_lm(path)


# -- quantisation ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide(root):
    """The 256-wide Llama (rows of whole K-quant blocks) in every type: type -> (path, stored tensors)."""
    model = gm.build_model("llama_wide")
    files = {}
    for qtype in gm.QUANT_TYPES:
        path = root / f"wide_{qtype.name}.gguf"
        files[qtype] = (path, gm.write_gguf(model, path, qtype, rng=np.random.default_rng(int(qtype))))
    return model, files


@pytest.mark.parametrize("qtype", gm.QUANT_TYPES, ids=lambda q: q.name)
def test_quantized_logits_equal_transformers_gguf_loading(qtype, wide, root):
    _, files = wide
    path, _ = files[qtype]
    lm = load_causal_lm(path)
    ids, mask = left_padded_batch(np.random.default_rng(6), (7, 4))
    theirs = hf_logits(gm.transformers_gguf_model(root, path.name), ids, mask)
    assert _rel(lm(ids, mask).astype(np.float64)[mask], theirs[mask]) <= TOL


@pytest.mark.parametrize("qtype", gm.QUANT_TYPES, ids=lambda q: q.name)
def test_quantized_weights_equal_gguf_dequantize(qtype, wide):
    model, files = wide
    path, stored = files[qtype]
    lm = load_causal_lm(path, dtype=np.float64)
    params = dict(lm.named_parameters())
    cfg = model.config

    def dequantized(name):
        return gguf.quants.dequantize(stored[name], qtype if stored[name].dtype == np.uint8 else
                                      gguf.GGMLQuantizationType.F32 if stored[name].dtype == np.float32
                                      else gguf.GGMLQuantizationType.F16)

    # float64 parameters hold the float32 dequantized values exactly
    np.testing.assert_array_equal(params["embed.weight"], dequantized("token_embd.weight"))
    np.testing.assert_array_equal(params["layers.1.mlp.W_down"], dequantized("blk.1.ffn_down.weight").T)
    q = dequantized("blk.0.attn_q.weight")  # llama.cpp's row order: permuted back per head
    unpermuted = q.reshape(cfg.num_attention_heads, -1, 2, q.shape[1]).swapaxes(1, 2).reshape(q.shape)
    np.testing.assert_array_equal(params["layers.0.attention.W_Q"], unpermuted.T)
    np.testing.assert_array_equal(gm.llama_permute(unpermuted, cfg.num_attention_heads), q)
    if qtype in (gm.Q.F32, gm.Q.F16, gm.Q.BF16, gm.Q.Q8_0):  # the formats with a float twin, near it
        original = model.model.layers[0].self_attn.q_proj.weight.detach().numpy().T
        assert np.max(np.abs(params["layers.0.attention.W_Q"] - original)) < 0.02


def test_a_quantized_granite_hybrid_file_reads_the_parts_the_converter_split(root):
    """Granite 4 hybrid in Q8_0: each fused input_linear is read from its two quantized GGUF tensors (the experts'
    and the shared MLP's gate and up), q unpermuted; kept packed it computes what the dequantized model does."""
    model = gm.build_model("granitemoehybrid_nope")
    path = root / "granitehybrid_Q8_0.gguf"
    stored = gm.write_gguf(model, path, gm.Q.Q8_0)
    params = dict(load_causal_lm(path, dtype=np.float64).named_parameters())

    def dequantized(name):
        assert stored[name].dtype == np.uint8, name  # really quantized
        return gguf.quants.dequantize(stored[name], gm.Q.Q8_0)

    np.testing.assert_array_equal(params["layers.0.mlp.W_gate"], dequantized("blk.0.ffn_gate_exps.weight")
                                  .swapaxes(-1, -2))  # (E, D, F)
    np.testing.assert_array_equal(params["layers.2.mlp.W_up"], dequantized("blk.2.ffn_up_exps.weight").swapaxes(-1, -2))
    np.testing.assert_array_equal(params["layers.1.mlp.shared_expert.W_gate"],
                                  dequantized("blk.1.ffn_gate_shexp.weight").T)
    np.testing.assert_array_equal(params["layers.1.mlp.shared_expert.W_up"], dequantized("blk.1.ffn_up_shexp.weight").T)
    q = dequantized("blk.1.attn_q.weight")
    unpermuted = q.reshape(model.config.num_attention_heads, -1, 2, q.shape[1]).swapaxes(1, 2).reshape(q.shape)
    np.testing.assert_array_equal(params["layers.1.attention.W_Q"], unpermuted.T)
    ids, mask = left_padded_batch(np.random.default_rng(7), (9, 3))
    dense = load_causal_lm(path)(ids, mask).astype(np.float64)
    assert _rel(load_causal_lm(path, keep_quantized=True)(ids, mask)[mask], dense[mask]) <= TOL
    assert _rel(dense[mask], hf_logits(model, ids, mask)[mask]) < 0.05  # Q8_0's rounding, through three layers


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtype_is_the_requested_one(dtype, wide):
    _, files = wide
    lm = load_causal_lm(files[gm.Q.Q4_K][0], dtype=dtype)
    assert {p.dtype for _, p in lm.named_parameters()} == {np.dtype(dtype)}


def test_loading_memory_is_the_weights_plus_one_tensor_in_float32(tmp_path):
    """Measured with tracemalloc (NumPy reports its allocations; the mapped file is not an allocation)."""
    import tracemalloc

    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    path = tmp_path / "q4k.gguf"
    gm.write_gguf(transformers.LlamaForCausalLM(config).eval(), path, gm.Q.Q4_K)
    for dtype in (np.float32, np.float16):
        tracemalloc.start()
        try:
            lm = load_causal_lm(path, dtype=dtype)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        weights = sum(p.nbytes for p in lm.parameters())
        largest = 2048 * 256 * 4  # the embedding (and the head) dequantized to float32, 2 MB
        assert weights > 4e6 if dtype == np.float32 else weights > 2e6
        # one dequantized tensor (plus a chunk of gguf's temporaries); nothing is model-sized
        assert peak <= weights + 1.25 * largest + 1e6, (dtype, peak, weights)


# -- tokenizers and chat templates --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_files(root):
    """name -> GGUF file of a tiny model with a real vocabulary (byte-level BPE with three pre-tokenizers,
    SentencePiece as Llama, Gemma and Phi-3 read it)."""
    hf_tok = write_chat_tokenizer(root / "chat_tokenizer")
    files = {}
    for pre in ("default", "qwen2", "llama-bpe"):
        meta = gm.byte_level_metadata(hf_tok, pre)
        files[f"bpe_{pre}"] = _tokenizer_model(root, f"bpe_{pre}", "llama", meta)
    spm = gm.sentencepiece_metadata(CORPUS, chat_template=LLAMA2)
    for arch in ("llama", "gemma2", "phi3"):
        files[f"spm_{arch}"] = _tokenizer_model(root, f"spm_{arch}", arch, spm)
    return files


def _tokenizer_model(root, name, arch, meta):
    spec = {"llama": "llama", "gemma2": "gemma2_softcaps", "phi3": "phi3"}[arch]
    class_name, kwargs = {**gm.TRANSFORMERS_READABLE, **gm.FLOAT_ONLY}[spec]
    config = getattr(transformers, class_name)(**{**kwargs, "vocab_size": len(meta["tokens"]),
                                                   "eos_token_id": meta["eos_token_id"]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    path = root / f"{name}.gguf"
    gm.write_gguf(model, path, tokenizer=meta)
    return path


@pytest.mark.parametrize("name", ["bpe_default", "bpe_qwen2", "bpe_llama-bpe", "spm_llama", "spm_gemma2",
                                  "spm_phi3"])
def test_token_ids_equal_transformers_gguf_tokenizer(name, tokenizer_files):
    path = tokenizer_files[name]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _, ours = load(path)
    for text in TEXTS:
        for special in (True, False):
            expected = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id


@pytest.mark.parametrize("name", ["bpe_default", "spm_llama"])
def test_chat_template_renders_as_transformers_does(name, tokenizer_files):
    path = tokenizer_files[name]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _, ours = load(path)
    assert ours.get_chat_template() == (CHATML if name.startswith("bpe") else LLAMA2)
    chat = CHAT if name.startswith("bpe") else CHAT[:2] + [{"role": "assistant", "content": "ok"}, CHAT[3]]
    for prompt in (True, False):
        text = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == text
        assert ours.apply_chat_template(chat, add_generation_prompt=prompt)["input_ids"] == \
            theirs.encode(text, add_special_tokens=False)


def test_greedy_text_equals_transformers_gguf(tokenizer_files, root):
    path = tokenizer_files["bpe_default"]
    model, tokenizer = load(path)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = gm.transformers_gguf_model(path.parent, path.name)
    prompt = tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True)["input_ids"]
    ids = np.array([prompt])
    ours = model.generate(ids, max_new_tokens=12, eos_token_id=[])[0, len(prompt):]
    expected = hf_greedy(theirs, ids, np.ones_like(ids), 12, eos_token_id=None,
                         pad_token_id=theirs_tok.pad_token_id)[0, len(prompt):]
    assert tokenizer.decode(ours) == theirs_tok.decode(expected)
    np.testing.assert_array_equal(ours, expected)


# -- files attnkit refuses -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_file(root):
    return _written(root, "llama", gm.build_model("llama"))


@pytest.fixture
def no_model_built(monkeypatch):
    """Fail the test if a CausalLM is built: a bad file must be refused before any weight is allocated."""
    import attnkit.models

    def refuse(*args, **kwargs):
        raise AssertionError("a CausalLM was built for a file that should have been refused")

    monkeypatch.setattr(attnkit.models, "CausalLM", refuse)


def _raw_file(path, arch="llama", tensors=(), meta=None):
    """A small GGUF file written field by field: ``tensors`` are (name, array, raw type or None)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_string(key, value)
    for name, array, raw in tensors:
        writer.add_tensor(name, array, raw_shape=None if raw is None else array.shape, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rewritten(good_file, path, *, replace=None, add=None, drop=None):
    """A copy of ``good_file`` with tensors replaced or added (name -> (array, raw type or None)), or one dropped."""
    replace, add = dict(replace or {}), dict(add or {})
    file = read_gguf(good_file)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in gguf.GGUFReader(str(good_file)).fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for tensor_name, tensor in file.tensors.items():
        if tensor_name == drop:
            continue
        if tensor_name in replace:
            data, qtype = replace[tensor_name]
            writer.add_tensor(tensor_name, data, raw_shape=None if qtype is None else data.shape, raw_dtype=qtype)
        else:
            values = np.asarray(tensor.data).reshape(tuple(int(n) for n in reversed(tensor.shape)))
            writer.add_tensor(tensor_name, values)
    for tensor_name, (data, qtype) in add.items():
        writer.add_tensor(tensor_name, data, raw_shape=None if qtype is None else data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_that_is_not_gguf_is_refused(tmp_path, no_model_built):
    path = tmp_path / "model.gguf"
    path.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file: it starts with b'\{\"mo'"):
        load_causal_lm(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load(path)


def test_an_unknown_architecture_is_refused(tmp_path, no_model_built):
    path = _raw_file(tmp_path / "mamba.gguf", "mamba", [("token_embd.weight", np.zeros((4, 8), np.float32), None)])
    with pytest.raises(ValueError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not one attnkit loads; it "
                                         r"loads gemma2, gemma3, glm4, glm4moe, gpt2, granitehybrid, lfm2, llama, "
                                         r"nemotron_h, olmo2, phi3, qwen2, qwen3, qwen35$"):
        load_causal_lm(path)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.MXFP4,
                                   gguf.GGMLQuantizationType.I32])
def test_an_unsupported_tensor_type_is_refused(qtype, good_file, tmp_path, no_model_built):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 48, 32  # blk.0.ffn_up.weight: (F, D), rows of whole blocks of 32
    data = np.zeros((rows, cols // block * size), np.uint8) if qtype.name != "I32" else np.zeros((rows, cols),
                                                                                                 np.int32)
    path = _rewritten(good_file, tmp_path / "odd.gguf", replace={"blk.0.ffn_up.weight": (data, qtype)})
    with pytest.raises(ValueError, match=rf"odd\.gguf: tensor 'blk\.0\.ffn_up\.weight' is of type {qtype.name}, "
                                         r"which attnkit does not dequantize; it reads F32, F16, BF16, Q4_0"):
        load_causal_lm(path)


@pytest.mark.parametrize("keep", [0.0, 0.02, 0.5, 0.999])
def test_a_truncated_file_is_refused(keep, good_file, tmp_path, no_model_built):
    """Cut after the magic (0), in the vocabulary (2%), in the tensor data (50%) and in the last tensor."""
    data = good_file.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:max(4, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated"):
        load(path)


def _patched(data: bytes, after: bytes, skip: int, value: int, width: int) -> bytes:
    """``data`` with the ``width``-byte little-endian field ``skip`` bytes after the first ``after`` set to
    ``value``."""
    at = data.index(after) + len(after) + skip
    return data[:at] + value.to_bytes(width, "little") + data[at + width:]


@pytest.mark.parametrize("case, message", [
    ("version", r"GGUF version 7 is not read \(attnkit reads versions 2 and 3, little-endian\)"),
    ("counts", r"is truncated or corrupt \(\d+ bytes\): a header of 1099511627776 metadata entries"),
    ("array", r"is truncated or corrupt \(\d+ bytes\): metadata 'tokenizer\.ggml\.tokens' runs past the end"),
    ("type id", r"tensor 'token_embd\.weight' has tensor type id 99, which no GGUF reader knows"),
    ("dims", r"is corrupt: tensor 'token_embd\.weight' has 9 dimensions"),
])
def test_a_corrupt_header_is_refused_by_what_is_wrong(case, message, good_file, tmp_path, no_model_built):
    data = good_file.read_bytes()
    if case == "version":
        data = data[:4] + (7).to_bytes(4, "little") + data[8:]
    elif case == "counts":
        data = data[:16] + (1 << 40).to_bytes(8, "little") + data[24:]
    elif case == "array":  # the token list: key, value type 9, item type 8, then the count
        data = _patched(data, b"tokenizer.ggml.tokens", 8, 1 << 40, 8)
    elif case == "type id":  # the first tensor's entry: name, n_dims (4), two dims (16), then the type
        data = _patched(data, b"token_embd.weight", 20, 99, 4)
    else:
        data = _patched(data, b"token_embd.weight", 0, 9, 4)
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"corrupt\.gguf.*" + message):
        load(path)


def test_a_nemotron_h_file_reads_its_layer_kinds_from_the_per_layer_counts(root):
    """A layer with key/value heads is attention, one with an MLP width the MLP, one with neither Mamba-2; dt has
    no floor (llama.cpp's)."""
    model = gm.build_model("nemotron_h_bias_no_floor")
    lm = load_causal_lm(_written(root, "float_nemotron_h_bias_no_floor", model))
    assert lm.config.layer_types == ("mlp", "mamba2", "full_attention", "mamba2")
    shape = lm.config.layers[1].part
    assert shape.time_step_min == 0.0 and shape.proj_bias and not shape.conv_bias
    assert lm.config.mlp.bias and lm.config.mlp.intermediate_size == 40 and lm.config.num_kv_heads == 1


def test_a_bamba_file_with_mlp_biases_is_refused_by_its_tensors(tmp_path, no_model_built):
    """Granite 4 hybrid's MLP, which a Bamba file is read as, has no biases: Bamba's mlp_bias tensors are named."""
    path = tmp_path / "bamba_bias.gguf"
    gm.write_gguf(build_hf_model("bamba_bias"), path)
    with pytest.raises(ValueError, match=r"bamba_bias\.gguf: unexpected tensor 'blk\.0\.ffn_gate\.bias' \(and 5 more\) "
                                         r"for this granitehybrid model"):
        load_causal_lm(path)


@pytest.mark.parametrize("counts, message", [
    ([0, 2, 1], r"gives the layers different counts \[1, 2\]; attnkit reads one for every layer that has one"),
    ([0, 2], r"must hold a non-negative count for each of the 3 layers \('granitehybrid\.block_count'\), got "
             r"\[0, 2\]")])
def test_a_granite_hybrid_files_per_layer_kv_heads_are_checked(counts, message, tmp_path, no_model_built):
    meta = {"general.architecture": ("string", "granitehybrid"), "granitehybrid.block_count": ("uint32", 3),
            "granitehybrid.embedding_length": ("uint32", 32), "granitehybrid.attention.head_count": ("uint32", 4),
            "granitehybrid.attention.head_count_kv": ("array[uint32]", counts)}
    path = gm.write_raw_gguf(tmp_path / "hybrid.gguf", meta, (("token_embd.weight", np.zeros((4, 32))),))
    with pytest.raises(ValueError, match=r"hybrid\.gguf: metadata 'granitehybrid\.attention\.head_count_kv' "
                                         + message):
        load_causal_lm(path)


def test_missing_metadata_and_wrong_tensors_are_named(good_file, tmp_path, no_model_built):
    path = _raw_file(tmp_path / "bare.gguf", "llama", [("token_embd.weight", np.zeros((4, 8), np.float32), None)],
                     {"llama.embedding_length": 8})
    with pytest.raises(ValueError, match=r"bare\.gguf: the metadata has no 'llama\.attention\.head_count'"):
        load_causal_lm(path)
    path = _rewritten(good_file, tmp_path / "short.gguf", drop="blk.1.ffn_down.weight")
    with pytest.raises(ValueError, match=r"short\.gguf: the file has no tensor 'blk\.1\.ffn_down\.weight'"):
        load_causal_lm(path)
    extra = {"blk.0.ffn_gate.weight": (np.zeros((40, 32), np.float32), None)}
    path = _rewritten(good_file, tmp_path / "narrow.gguf", replace=extra)
    with pytest.raises(ValueError, match=r"narrow\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has shape \(40, 32\), "
                                         r"but the metadata implies \(48, 32\)"):
        load_causal_lm(path)
    extra = {"blk.0.attn_norm.bias": (np.zeros(32, np.float32), None), "rope_factors_long.weight": (
        np.ones(4, np.float32), None)}
    path = _rewritten(good_file, tmp_path / "extra.gguf", add=extra)
    with pytest.raises(ValueError, match=r"extra\.gguf: unexpected tensor 'blk\.0\.attn_norm\.bias' \(and 1 more\) "
                                         r"for this llama model"):
        load_causal_lm(path)
    extra = {"blk.0.attn_q.bias": (np.zeros(32, np.float32), None)}
    path = _rewritten(good_file, tmp_path / "biased.gguf", add=extra)
    with pytest.raises(ValueError, match=r"biased\.gguf: the file has no tensor 'blk\.0\.attn_k\.bias'"):
        load_causal_lm(path)


# -- the command line -----------------------------------------------------------------------------------------
def test_cli_generate_takes_a_gguf_file(tokenizer_files, capsys):
    path = tokenizer_files["bpe_default"]
    assert main(["generate", str(path), "--prompt", "Hello world", "--max-new-tokens", "5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    model, tokenizer = load(path)
    prompt = tokenizer.encode("Hello world")
    assert record["ids"] == model.generate(np.array([prompt]), max_new_tokens=5)[0].tolist()


def test_cli_chat_and_explain_take_a_gguf_file(tokenizer_files, tmp_path, monkeypatch, capsys):
    import io

    path = tokenizer_files["bpe_default"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", str(path), "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert main(["explain", str(path), "--prompt", "Hello world", "--html", str(tmp_path / "page.html")]) == 0
    assert (tmp_path / "page.html").stat().st_size > 0
    capsys.readouterr()


@pytest.mark.parametrize("name, flags, system", [("bpe_default", ["--chat"], None),
                                                  ("spm_llama", ["--system", "Be brief."], "Be brief.")])
def test_cli_generate_chat_renders_the_template_of_a_gguf_file(tokenizer_files, capsys, name, flags, system):
    """``generate FILE.gguf --chat`` and ``--system`` render the prompt with the header's
    ``tokenizer.chat_template``, as with a folder (ChatML; Llama 2's, which folds the system message into the
    first turn)."""
    path = tokenizer_files[name]
    assert main(["generate", str(path), "--prompt", "Hello world", *flags, "--max-new-tokens", "4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    model, tokenizer = load(path)
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": "user", "content": "Hello world"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expected = model.generate(np.array([prompt]), max_new_tokens=4, eos_token_id=list(tokenizer.eos_token_ids))
    assert record["ids"] == expected[0].tolist()


@pytest.mark.parametrize("command", [["generate", "--ids", "1"], ["chat"],
                                     ["explain", "--ids", "1", "--html", "x.html"]])
def test_cli_refuses_a_bad_gguf_file_in_one_line(command, tmp_path, capsys):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    args = [command[0], str(path), *command[1:]]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.gguf" in err and "truncated or corrupt" in err


def test_chat_templates_are_read_from_the_header_alone(tokenizer_files, good_file, tmp_path):
    """``read_chat_templates`` walks the metadata only: a file whose tensor data is cut off (which loading
    refuses) still tells its template, and a file without one says so."""
    from attnkit.pretrained import read_chat_templates
    from attnkit.pretrained.gguf_file import read_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tokenizer_files["bpe_default"].read_bytes()[:-1000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(cut)
    assert read_chat_templates(cut) == {"default": CHATML}
    assert read_chat_templates(tokenizer_files["spm_gemma2"]) == {"default": LLAMA2}
    assert read_chat_templates(good_file) == {}
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_chat_templates(junk)


def test_cli_chat_names_a_missing_chat_template(good_file, capsys):
    assert main(["chat", str(good_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tokenizer.chat_template in a GGUF file" in err


@pytest.mark.parametrize("template", [None, "chatml"])
def test_generate_chat_renders_with_a_gguf_files_tokenizer(tokenizer_files, tmp_path, template):
    """``generate --chat`` on a GGUF file: its own template, or a named one, with the tokenizer its metadata
    describes, gives the library's greedy reply."""
    from attnkit.cli.chat import terminal_safe
    from attnkit.pretrained import load
    from cli_helpers import run_attnkit

    path = tokenizer_files["bpe_default"]
    model, tok = load(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                  return_dict=False, chat_template=template)
    out = model.generate(np.array([ids]), max_new_tokens=4, do_sample=False, eos_token_id=list(tok.eos_token_ids))
    reply = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    extra = [] if template is None else ["--chat-template", template]
    proc = run_attnkit(["generate", str(path), "--prompt", "Hello", "--chat", "--max-new-tokens", "4", *extra],
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert reply and proc.stdout.rstrip("\n") == terminal_safe(reply)


def test_a_real_process_streams_from_a_gguf_file_and_refuses_a_cut_one(tokenizer_files, tmp_path):
    from cli_helpers import assert_one_line_error, run_attnkit

    path = tokenizer_files["bpe_default"]
    ok = run_attnkit(["generate", str(path), "--prompt", "Hello world", "--max-new-tokens", "3"], cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("Hello world"), ok.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:5000])
    bad = run_attnkit(["generate", str(cut), "--prompt", "Hello"], cwd=tmp_path)
    assert bad.returncode == 2
    assert_one_line_error(bad.stderr, "cut.gguf is truncated")
