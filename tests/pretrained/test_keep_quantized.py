"""Quantized files kept quantized: ``load(path, keep_quantized=True)`` on GGUF files of every quantized type and on
gpt-oss's MXFP4 experts, written in the test (tests/gguf_models.py, tests/hf_models.py).

Reference: the same file loaded with every tensor dequantized (``keep_quantized=False``, itself checked against
``gguf.quants.dequantize`` and transformers in tests/pretrained/test_gguf.py). Both hold the same float32 values
and differ only in the order BLAS sums the products (a packed weight is multiplied a block of rows at a time, in
another layout): logits within 1e-6 of the largest logit in float32, 1e-12 in float64, and the same greedy
tokens. Memory is tracemalloc's peak (NumPy reports its allocations to it; the mapped file is not one).
"""
from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
import gguf_models as gm  # noqa: E402
from attnkit.cli import main  # noqa: E402
from attnkit.explain import direct_logit_attribution, gradient_x_input, logit_lens  # noqa: E402
from attnkit.kernels._threads import default_num_threads  # noqa: E402
from attnkit.kernels.packed import PackedWeight  # noqa: E402
from attnkit.pretrained import load, load_causal_lm  # noqa: E402
from hf_models import build_hf_model, left_padded_batch, mxfp4_copy, mxfp4_folder  # noqa: E402

TOL = 1e-6  # max |packed - dequantized| / max |dequantized| over the logits, float32
PACKED_TYPES = tuple(q for q in gm.QUANT_TYPES if q not in (gm.Q.F32, gm.Q.F16, gm.Q.BF16))


def _rel(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def _write(model, path, qtype):
    with warnings.catch_warnings():  # random K-quant bits: gguf's own dequantizer may overflow on them
        warnings.simplefilter("ignore", RuntimeWarning)
        return gm.write_gguf(model, path, qtype, rng=np.random.default_rng(int(qtype)))


def _packed_names(lm) -> set[str]:
    return {name for name, p in lm.named_parameters() if isinstance(p, PackedWeight)}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The 256-wide Llama (rows of whole K-quant blocks): its transformers model and a folder for the files."""
    return gm.build_model("llama_wide"), tmp_path_factory.mktemp("keep_quantized")


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_a_packed_file_computes_the_logits_and_tokens_of_its_dequantized_load(qtype, wide):
    model, root = wide
    path = root / f"wide_{qtype.name}.gguf"
    stored = _write(model, path, qtype)
    dense, packed = load_causal_lm(path), load_causal_lm(path, keep_quantized=True)
    quantized = {name for name, data in stored.items() if data.dtype == np.uint8}
    assert len(_packed_names(packed)) == 2 * 7 + 2 == len(quantized)  # every matrix of every layer, embedding, head
    assert all(type(p) is np.ndarray and p.ndim == 1 for name, p in packed.named_parameters()
               if name not in _packed_names(packed))  # the norms
    assert sum(p.nbytes for p in packed.parameters()) < sum(p.nbytes for p in dense.parameters()) / 3
    ids, mask = left_padded_batch(np.random.default_rng(6), (7, 4))
    assert _rel(packed(ids, mask)[mask], dense(ids, mask)[mask]) <= TOL
    options = dict(max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(packed.generate(ids, mask, **options), dense.generate(ids, mask, **options))


@pytest.mark.parametrize("name, qtype", [("gpt2", gm.Q.Q8_0), ("phi3", gm.Q.Q4_0), ("gemma2", gm.Q.Q8_0),
                                         ("qwen3", gm.Q.Q5_0), ("qwen2", gm.Q.Q4_1), ("olmo2", gm.Q.Q8_0)])
def test_every_layout_llama_cpp_writes_stays_packed(name, qtype, tmp_path):
    """GPT-2's transposed, split c_attn and its tied head; Phi-3's fused qkv and gate_up cut by rows (its 48-wide
    down projection is written F32 and stays dense); Gemma 2's offset norms and tied head; Qwen3's and OLMo 2's
    q/k norms."""
    model = build_hf_model(name) if name == "olmo2" else gm.build_model(name)
    path = tmp_path / f"{name}.gguf"
    _write(model, path, qtype)
    ids, mask = left_padded_batch(np.random.default_rng(7), (9, 5))
    # float64: the same numbers in both loads, so any weight in a wrong place would show far above 1e-12
    dense, packed = load_causal_lm(path, np.float64), load_causal_lm(path, np.float64, keep_quantized=True)
    names = _packed_names(packed)
    assert "embed.weight" in names and "layers.1.attention.W_V" in names
    if name == "phi3":
        assert "layers.0.mlp.W_up" in names and "layers.0.mlp.W_down" not in names
    assert _rel(packed(ids, mask)[mask], dense(ids, mask)[mask]) <= 1e-12
    # the input gradient through every layer kind (GPT-2's plain MLP formed its weights' gradients even here)
    assert _rel(gradient_x_input(packed, ids[:1]), gradient_x_input(dense, ids[:1])) <= 1e-10
    dense, packed = load_causal_lm(path), load_causal_lm(path, keep_quantized=True)
    options = dict(max_new_tokens=5, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(packed.generate(ids, mask, **options), dense.generate(ids, mask, **options))


def test_float64_and_the_input_gradients_of_a_packed_model(wide):
    """The dtype asked for is the one packed weights are dequantized to; a backward for the inputs (what the
    explanations run) is exact, one for the weights is refused by name."""
    model, root = wide
    path = root / "wide_Q4_K_grad.gguf"
    _write(model, path, gm.Q.Q4_K)
    dense, packed = load_causal_lm(path, np.float64), load_causal_lm(path, np.float64, keep_quantized=True)
    assert packed.dtype == np.float64 and packed.layers[0].mlp.W_up.dtype == np.float64
    ids = np.array([[5, 9, 11, 3, 40, 2]])
    assert _rel(packed(ids), dense(ids)) <= 1e-12
    assert _rel(gradient_x_input(packed, ids), gradient_x_input(dense, ids)) <= 1e-10
    np.testing.assert_array_equal(logit_lens(packed, ids).token_ids, logit_lens(dense, ids).token_ids)
    ours, theirs = direct_logit_attribution(packed, ids, 7), direct_logit_attribution(dense, ids, 7)
    assert all(_rel(ours[k], theirs[k]) <= 1e-10 for k in ("heads", "mlp", "logit"))
    logits = packed(ids)
    with pytest.raises(TypeError, match=r"parameter '\w+' is a packed Q4_K weight \(kept quantized\): it has no "
                                        r"gradient"):
        packed.backward(np.ones_like(logits))


def _peaks(path, keep_quantized: bool, ids: np.ndarray) -> tuple[float, float]:
    """tracemalloc's peak of loading ``path``, and how far a forward of ``ids`` then rises above what was held."""
    tracemalloc.start()
    try:
        lm = load_causal_lm(path, keep_quantized=keep_quantized)
        loading, held = tracemalloc.get_traced_memory()[1], tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        lm(ids)
        forward = tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()
    return loading, forward


def test_loading_a_packed_file_costs_about_its_size(tmp_path):
    """A Q4_0 file of 8 MB (seven times that dequantized): loading it packed peaks within 1.3x its size, and a
    forward needs what the dequantized model's forward needs (its activations, kept for a backward) plus the
    dequantized block of a product on each thread (128K float32 values)."""
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    path = tmp_path / "q4_0.gguf"
    gm.write_gguf(transformers.LlamaForCausalLM(config).eval(), path, gm.Q.Q4_0)
    size = path.stat().st_size
    ids = np.arange(16)[None]  # (1, 16)
    loading, forward = _peaks(path, True, ids)
    dense_loading, dense_forward = _peaks(path, False, ids)
    assert size > 7e6 and dense_loading > 7 * size
    assert loading <= 1.3 * size, (loading, size)
    scratch = (default_num_threads() + 1) * (1 << 17) * 4
    assert forward <= dense_forward + scratch, (forward, dense_forward, scratch)


def test_gpt_oss_mxfp4_experts_stay_packed(tmp_path):
    folder = mxfp4_folder("gpt_oss_wide", tmp_path / "hf", tmp_path / "mxfp4")
    dense, packed = load_causal_lm(folder), load_causal_lm(folder, keep_quantized=True)
    experts = {f"layers.{i}.mlp.{name}" for i in range(dense.config.num_layers)
               for name in ("W_gate", "W_up", "W_down")}
    assert _packed_names(packed) == experts
    expert_bytes = sum(p.nbytes for name, p in packed.named_parameters() if name in experts)
    dense_bytes = sum(p.nbytes for name, p in dense.named_parameters() if name in experts)
    assert expert_bytes * 7 < dense_bytes  # 17 bytes per 32 values against 128
    ids, mask = left_padded_batch(np.random.default_rng(8), (9, 5))
    assert _rel(packed(ids, mask)[mask], dense(ids, mask)[mask]) <= TOL
    options = dict(max_new_tokens=5, eos_token_id=[], pad_token_id=0)
    np.testing.assert_array_equal(packed.generate(ids, mask, **options), dense.generate(ids, mask, **options))
    ids = np.array([[3, 9, 4, 17, 2]])
    dense, packed = load_causal_lm(folder, np.float64), load_causal_lm(folder, np.float64, keep_quantized=True)
    assert _rel(gradient_x_input(packed, ids), gradient_x_input(dense, ids)) <= 1e-10
    logits = packed(ids)
    with pytest.raises(TypeError, match=r"parameter 'W_\w+' is a packed MXFP4 weight \(kept quantized\)"):
        packed.backward(np.ones_like(logits))


def test_loading_packed_mxfp4_experts_costs_about_the_folders_size(tmp_path):
    """gpt-oss with 8 experts of width 256 in two layers (MXFP4 experts 1.7 MB, 13 MB dequantized; the rest of
    the folder float32): the packed load peaks within 1.3x the folder's size, the dequantized one far above."""
    config = transformers.GptOssConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                                       num_experts_per_tok=2, sliding_window=8)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    folder = mxfp4_copy(tmp_path / "hf", tmp_path / "mxfp4")
    size = sum(f.stat().st_size for f in folder.iterdir())
    loading, _ = _peaks(folder, True, np.arange(4)[None])
    dense_loading, _ = _peaks(folder, False, np.arange(4)[None])
    assert loading <= 1.3 * size < dense_loading, (loading, size, dense_loading)


def test_keep_quantized_is_a_flag(wide):
    _, root = wide
    with pytest.raises(TypeError, match="keep_quantized must be True or False, got str 'yes'"):
        load_causal_lm(root / "absent.gguf", keep_quantized="yes")
    with pytest.raises(TypeError, match="keep_quantized must be True or False"):
        load(root / "absent.gguf", keep_quantized=1)


def test_the_model_commands_take_keep_quantized(wide, capsys):
    """generate prints the same tokens with and without it; explain's page (attributions, direct logit
    attribution, patching, generation) is made from a packed model."""
    model, root = wide
    path = root / "cli_Q4_0.gguf"
    _write(model, path, gm.Q.Q4_0)
    outputs = []
    for flags in ([], ["--keep-quantized"]):
        assert main(["generate", str(path), "--ids", "1,2,3", "--max-new-tokens", "4", "--json", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and '"new_ids"' in outputs[0]
    page = root / "cli_Q4_0.html"
    assert main(["explain", str(path), "--ids", "1,2,3,4,5", "--corrupt-ids", "1,2,9,4,5", "--generate", "2",
                 "--html", str(page), "--keep-quantized"]) == 0
    assert page.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["bench", "attention", "--keep-quantized"]) == 2
    assert "--keep-quantized belongs to attnkit bench runtime MODEL" in capsys.readouterr().err
