"""Safetensors checkpoints: the name map covers exactly what save_pretrained writes for every family, headers are
validated before any tensor is read, tampered folders fail with errors naming the tensor or file, BF16/F16
tensors convert exactly."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from attnkit.pretrained import load_causal_lm
from attnkit.pretrained.causal_lm import read_decoder_config
from attnkit.pretrained.checkpoint import (
    HEAD_NAMES,
    INDEX_FILE,
    SINGLE_FILE,
    checkpoint_map,
    load_tensors_into,
    read_checkpoint_index,
    validate_checkpoint,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_models")


def state_from_checkpoint(folder):
    """attnkit name -> array, through the map, without building a model."""
    cfg = read_decoder_config(folder)
    index = read_checkpoint_index(folder)
    stored = validate_checkpoint(index, cfg)
    params = {}
    for m in stored.values():
        for name, shape in m.target_shapes().items():
            params.setdefault(name, np.zeros(shape, dtype=np.float64))  # a stacked parameter is filled by many
    load_tensors_into(params, index, stored)
    return cfg, params


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_map_covers_every_saved_tensor(name, hf_root):
    from safetensors import safe_open

    folder, _ = saved_model(name, hf_root)
    cfg = read_decoder_config(folder)
    stored = validate_checkpoint(read_checkpoint_index(folder), cfg)
    # the names on disk, as safetensors lists them: transformers renames some tensors between memory and disk
    # (GPT-NeoX's lm_head is embed_out; DeepSeek-V3's stacked experts are one tensor per expert)
    on_disk = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "np") as handle:
            on_disk |= set(handle.keys())
    expected = {k for k in on_disk if not (cfg.tie_word_embeddings and k in HEAD_NAMES)}
    assert set(stored) == expected


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "qwen2_mixed"])
def test_weights_land_transposed_and_split(name, hf_root):
    folder, model = saved_model(name, hf_root)
    cfg, params = state_from_checkpoint(folder)
    hf = {k: v.double().numpy() for k, v in model.state_dict().items()}
    if cfg.family == "gpt2":
        d = cfg.hidden_size
        fused = hf["transformer.h.1.attn.c_attn.weight"]  # (D, 3D), Conv1D (in, out)
        np.testing.assert_array_equal(params["layers.1.attention.W_K"], fused[:, d:2 * d])
        np.testing.assert_array_equal(params["layers.1.attention.b_V"], hf["transformer.h.1.attn.c_attn.bias"][2 * d:])
        np.testing.assert_array_equal(params["layers.0.mlp.W2"], hf["transformer.h.0.mlp.c_proj.weight"])
        np.testing.assert_array_equal(params["pos_embed.weight"], hf["transformer.wpe.weight"])
    else:
        np.testing.assert_array_equal(params["layers.1.attention.W_K"], hf["model.layers.1.self_attn.k_proj.weight"].T)
        np.testing.assert_array_equal(params["layers.0.mlp.W_down"], hf["model.layers.0.mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(params["layers.0.attention.b_Q"], hf["model.layers.0.self_attn.q_proj.bias"])
        np.testing.assert_array_equal(params["norm.gamma"], hf["model.norm.weight"])
    embed = "transformer.wte.weight" if cfg.family == "gpt2" else "model.embed_tokens.weight"
    np.testing.assert_array_equal(params["embed.weight"], hf[embed])
    assert ("head.weight" in params) == (not cfg.tie_word_embeddings)


def test_sharded_index_reads_every_shard(hf_root):
    folder, model = saved_model("llama_sharded", hf_root)
    assert (folder / INDEX_FILE).is_file() and not (folder / SINGLE_FILE).exists()
    index = read_checkpoint_index(folder)
    assert len({h.file for h in index.tensors.values()}) > 1
    _, params = state_from_checkpoint(folder)
    np.testing.assert_array_equal(params["head.weight"], model.lm_head.weight.detach().double().numpy())


@pytest.mark.parametrize("torch_dtype, tol", [(torch.bfloat16, 0.0), (torch.float16, 0.0)])
def test_half_precision_tensors_convert_exactly(torch_dtype, tol, tmp_path):
    from hf_models import build_hf_model

    model = build_hf_model("llama_gqa", dtype=torch_dtype)
    model.save_pretrained(tmp_path)
    index = read_checkpoint_index(tmp_path)
    assert {h.dtype for h in index.tensors.values()} == {"BF16" if torch_dtype == torch.bfloat16 else "F16"}
    _, params = state_from_checkpoint(tmp_path)
    want = model.model.layers[0].self_attn.q_proj.weight.detach().double().numpy().T
    np.testing.assert_array_equal(params["layers.0.attention.W_Q"], want)


# -- tampered folders ---------------------------------------------------------------------------------------
@pytest.fixture
def llama_copy(hf_root, tmp_path):
    folder, _ = saved_model("llama_gqa", hf_root)
    return shutil.copytree(folder, tmp_path / "copy")


def rewrite(folder, edit):
    tensors = safetensors_numpy.load_file(str(folder / SINGLE_FILE))
    edit(tensors)
    safetensors_numpy.save_file(tensors, str(folder / SINGLE_FILE))


def raises_before_building(folder, match, monkeypatch, error=ValueError):
    """load_causal_lm fails with ``match`` without ever constructing the model."""
    import attnkit.models as models

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was validated")

    monkeypatch.setattr(models, "CausalLM", never, raising=False)
    with pytest.raises(error, match=match):
        load_causal_lm(folder)


def test_missing_tensor_is_named(llama_copy, monkeypatch):
    rewrite(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    raises_before_building(llama_copy, r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'", monkeypatch)


def test_unexpected_tensor_is_named(llama_copy, monkeypatch):
    rewrite(llama_copy, lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight", np.zeros((48, 32), np.float32)))
    raises_before_building(llama_copy, r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'", monkeypatch)


def test_wrong_shape_is_named(llama_copy, monkeypatch):
    rewrite(llama_copy, lambda t: t.__setitem__("model.norm.weight", np.ones(31, np.float32)))
    raises_before_building(llama_copy, r"'model\.norm\.weight' has shape \(31,\).*\(32,\)", monkeypatch)


def test_integer_dtype_is_refused(llama_copy, monkeypatch):
    rewrite(llama_copy, lambda t: t.__setitem__("model.norm.weight", np.ones(32, np.int32)))
    raises_before_building(llama_copy, r"'model\.norm\.weight' has dtype I32", monkeypatch)


def test_config_that_disagrees_with_weights(hf_root, tmp_path, monkeypatch):
    from hf_models import edit_config

    folder, _ = saved_model("llama_gqa", hf_root)
    edited = edit_config(folder, tmp_path / "kv", num_key_value_heads=4)
    raises_before_building(edited, r"k_proj\.weight' has shape \(16, 32\).*\(32, 32\)", monkeypatch)
    untied = edit_config(saved_model("llama_mqa", hf_root)[0], tmp_path / "untied", tie_word_embeddings=False)
    raises_before_building(untied, r"no tensor 'lm_head\.weight'", monkeypatch)


def test_missing_files_and_bad_json(llama_copy, tmp_path, monkeypatch):
    raises_before_building(tmp_path / "nowhere", "is not a folder", monkeypatch, FileNotFoundError)
    (llama_copy / "config.json").write_text("{not json")
    raises_before_building(llama_copy, "config.json is not valid JSON", monkeypatch)
    (llama_copy / "config.json").write_text("[1, 2]")
    raises_before_building(llama_copy, "must hold a JSON object", monkeypatch)
    (llama_copy / "config.json").unlink()
    raises_before_building(llama_copy, "has no config.json", monkeypatch, FileNotFoundError)


def test_missing_weights_and_corrupt_header(llama_copy, monkeypatch):
    data = (llama_copy / SINGLE_FILE).read_bytes()
    (llama_copy / SINGLE_FILE).write_bytes(data[:8] + b"{garbage" + data[16:])
    raises_before_building(llama_copy, "not a readable safetensors file", monkeypatch)
    (llama_copy / SINGLE_FILE).unlink()
    raises_before_building(llama_copy, "neither model.safetensors nor", monkeypatch, FileNotFoundError)


def test_tampered_index(hf_root, tmp_path, monkeypatch):
    folder, _ = saved_model("llama_sharded", hf_root)
    copy = shutil.copytree(folder, tmp_path / "sharded")
    index = json.loads((copy / INDEX_FILE).read_text())
    some_shard = sorted(set(index["weight_map"].values()))[0]
    (copy / some_shard).unlink()
    raises_before_building(copy, f"lists the shard '{some_shard}'", monkeypatch)

    copy2 = shutil.copytree(folder, tmp_path / "sharded2")
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (copy2 / INDEX_FILE).write_text(json.dumps(index))
    raises_before_building(copy2, "outside.safetensors", monkeypatch)

    copy3 = shutil.copytree(folder, tmp_path / "sharded3")
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = list(index["weight_map"].values())
    name = next(k for k, v in index["weight_map"].items() if shards.count(v) > 1)  # its shard stays listed
    del index["weight_map"][name]
    (copy3 / INDEX_FILE).write_text(json.dumps(index))
    raises_before_building(copy3, "does not list", monkeypatch)
    (copy3 / INDEX_FILE).write_text("{}")
    raises_before_building(copy3, "weight_map", monkeypatch)


def test_bad_dtype_argument(hf_root):
    folder, _ = saved_model("llama_gqa", hf_root)
    with pytest.raises(TypeError, match="dtype must be float16, float32 or float64"):
        load_causal_lm(folder, dtype=np.int32)
    with pytest.raises(TypeError, match="dtype must be"):
        load_causal_lm(folder, dtype="nonsense")


def test_map_example_matches_gpt2_fused_attention():
    from attnkit.models import DecoderConfig, MLPConfig, NormConfig

    cfg = DecoderConfig(family="gpt2", vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                        head_dim=4, mlp=MLPConfig(16, kind="plain", activation="gelu_tanh"),
                        tie_word_embeddings=True, norm=NormConfig(kind="layernorm"), rotary=None)
    maps, prefix = checkpoint_map(cfg)
    fused = next(m for m in maps if m.source == "h.0.attn.c_attn.weight")
    assert prefix == "transformer." and fused.target_shapes() == {
        "layers.0.attention.W_Q": (8, 8), "layers.0.attention.W_K": (8, 8), "layers.0.attention.W_V": (8, 8)}
    assert not any(m.source == "lm_head.weight" for m in maps)


def test_missing_safetensors_names_the_install_command(hf_root, monkeypatch):
    import importlib

    folder, _ = saved_model("llama_gqa", hf_root)
    real = importlib.import_module

    def without_safetensors(name, *args, **kwargs):
        if name.split(".")[0] == "safetensors":
            raise ImportError("No module named 'safetensors'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_safetensors)
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[pretrained\]'"):
        load_causal_lm(folder)


@pytest.mark.parametrize("shape, sizes", [((), (1,)), ((6, 1, 3), (6, 3))])
def test_a_reshaped_tensor_gathers_back_to_its_checkpoint_shape(shape, sizes):
    """xIELU's 0-d beta (Apertus) and a depthwise convolution's (C, 1, K) weight go back to the checkpoint's own
    shape when saved."""
    from attnkit.pretrained.tensor_map import TensorMap

    m = TensorMap("t", shape, ("p",), "reshape", sizes=sizes)
    stored = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    params = m.convert(stored)
    assert params["p"].shape == sizes
    back = m.gather(params)
    assert back.shape == shape and back.flags.c_contiguous
    np.testing.assert_array_equal(back, stored)


@pytest.mark.parametrize("layout, shape, sizes", [("transpose", (3, 5, 4), ()),
                                                  ("row_split_transpose", (3, 6, 4), (2, 4)),
                                                  ("transpose", (5, 4), ()), ("row_split_transpose", (6, 4), (2, 4))])
def test_a_stack_of_matrices_is_transposed_matrix_by_matrix(layout, shape, sizes):
    """Granite 4 hybrid's experts (E, 2F, D) and (E, D, F): each expert's matrix split and transposed on its own,
    as one matrix is; and gathered back to the checkpoint's array."""
    from attnkit.pretrained.tensor_map import TensorMap

    targets = ("a", "b") if sizes else ("a",)
    m = TensorMap("t", shape, targets, layout, sizes=sizes)
    stored = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    params = m.convert(stored)
    rows = np.split(stored, np.cumsum(sizes)[:-1], axis=-2) if sizes else [stored]
    for target, part in zip(targets, rows, strict=True):
        expected = np.stack([p.T for p in part]) if stored.ndim == 3 else part.T
        np.testing.assert_array_equal(params[target], expected)
        assert params[target].shape == m.target_shapes()[target]
    back = m.gather(params)
    assert back.flags.c_contiguous
    np.testing.assert_array_equal(back, stored)
