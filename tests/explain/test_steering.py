"""Control vectors against their referees: computed from prompt pairs they equal repeng 0.4's vectors on the same
model (float32; both PCA methods, Llama, GPT-2 and Qwen3 models); applied with ``steering`` the logits equal
transformers' with torch forward hooks adding the same vector to the same layers' outputs (every family, 1e-5),
and repeng's own ``ControlModel``; llama.cpp's GGUF files read and write as repeng and llama.cpp read them."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
gguf = pytest.importorskip("gguf")
from attnkit.explain import (  # noqa: E402
    ControlVector,
    control_vector,
    hooks,
    load_control_vector,
    save_control_vector,
    steering,
)
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from attnkit.pretrained import load_causal_lm, load_tokenizer  # noqa: E402
from hf_models import FAMILY_MODELS, hf_layers, hf_logits, left_padded_batch, saved_model  # noqa: E402

# float32 on both sides: repeng reads float32 hidden states; the directions are unit vectors whose entries
# differ by a few 1e-6 (measured: at most 4.6e-6), as the hidden states they come from do.
DIRECTION_TOL = 2e-5
LOGIT_TOL = 1e-5  # measured: at most 8.3e-7 over every family (steered logits of order 1, moved by about 2)

PAIRS = [("Act happy: Hello world", "Act sad: Hello world"),
         ("Act happy: The quick brown fox", "Act sad: The quick brown fox"),
         ("happy: how are you today?", "sad: how are you today?"),
         ("Be joyful. You are", "Be gloomy. You are"),
         ("Great news!", "Terrible news!"),
         ("I love it", "I hate it")]


def import_repeng():
    """repeng (pinned 0.4.0 in constraints.txt), or a skip that says how to install it. repeng 0.4 declares
    numpy<2 and its class bodies name ``np.float_``, which NumPy 2 removed: the name is lent for the import."""
    lent = not hasattr(np, "float_")
    if lent:
        np.float_ = np.float64
    try:
        return pytest.importorskip("repeng", reason="repeng is control_vector's referee: pip install --no-deps "
                                                    "repeng==0.4.0 (make test installs it; it declares numpy<2)")
    finally:
        if lent:
            del np.float_


# -- the models ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("steering")


def text_model(root, kind):
    """(folder, transformers model, transformers tokenizer) of a tiny random 4-layer ``kind`` with a byte-level
    BPE tokenizer (pad token set), saved with both; attnkit loads the folder."""
    from text_models import write_chat_tokenizer

    folder = root / "text_models" / kind  # apart from saved_model's folders, which share names ("gpt2", "qwen3")
    if (folder / "config.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        return folder, transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), tok
    tok = write_chat_tokenizer(folder)
    vocab = tok.backend_tokenizer.get_vocab_size()
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=4, n_head=4, n_positions=128,
                                         bos_token_id=3, eos_token_id=3)
    else:
        config = getattr(transformers, {"llama": "LlamaConfig", "qwen3": "Qwen3Config"}[kind])(
            vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so the prompts' states differ clearly
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return folder, model, tok


def hf_steered_logits(hf, vector, scale, ids, mask=None, layers=None):
    """transformers' logits with forward hooks adding ``scale * direction`` to the chosen layers' outputs."""
    def adder(direction):
        addition = torch.from_numpy(np.float32(scale) * direction)

        def hook(module, inputs, output):
            if isinstance(output, tuple):
                return (output[0] + addition, *output[1:])
            return output + addition
        return hook

    chosen = vector.layers if layers is None else layers
    handles = [hf_layers(hf)[layer].register_forward_hook(adder(vector.directions[layer])) for layer in chosen]
    try:
        return hf_logits(hf, ids, mask)
    finally:
        for handle in handles:
            handle.remove()


def random_vector(config, rng, layers=None):
    layers = range(1, config.num_layers) if layers is None else layers
    return ControlVector({layer: rng.standard_normal(config.hidden_size) for layer in layers}, config.family)


# -- computing vectors: repeng as the referee ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("method", ["pca_diff", "pca_center"])
def test_control_vector_equals_repengs(kind, method, root):
    repeng = import_repeng()
    folder, hf, tok = text_model(root, kind)
    dataset = [repeng.DatasetEntry(positive, negative) for positive, negative in PAIRS]
    reference = repeng.ControlVector.train(hf, tok, dataset, method=method, batch_size=4)
    lm = load_causal_lm(folder)
    found = control_vector(lm, load_tokenizer(folder), PAIRS, method=method, batch_size=3)
    assert found.layers == sorted(reference.directions) == [1, 2, 3]  # repeng's default: every layer but 0
    assert found.model_hint == reference.model_type == kind
    for layer in found.layers:
        assert found.directions[layer].dtype == np.float32
        np.testing.assert_allclose(found.directions[layer], reference.directions[layer], rtol=0, atol=DIRECTION_TOL)
        assert abs(np.linalg.norm(found.directions[layer]) - 1) < 1e-6


def test_control_vector_equals_repengs_for_layers_given_and_the_last_reads_the_final_norm(root):
    """Layers given negative and out of order, as repeng's ``hidden_layers``; the last layer's direction comes
    from the final norm's output (transformers' last hidden state), which a direction of the block's own output
    would not match."""
    repeng = import_repeng()
    folder, hf, tok = text_model(root, "llama")
    dataset = [repeng.DatasetEntry(positive, negative) for positive, negative in PAIRS]
    reference = repeng.ControlVector.train(hf, tok, dataset, hidden_layers=[-1, 1], batch_size=32)
    lm = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    found = control_vector(lm, tokenizer, PAIRS, layers=[-1, 1])
    assert found.layers == sorted(reference.directions) == [1, 3]
    for layer in (1, 3):
        np.testing.assert_allclose(found.directions[layer], reference.directions[layer], rtol=0, atol=DIRECTION_TOL)
    block_output = []

    def keep_last(value, name):
        block_output.append(value[0, -1].copy())

    with hooks(lm, {"blocks.3.hook_resid_post": keep_last}):
        for text in (t for pair in PAIRS for t in pair):
            lm(np.array([tokenizer.encode(text)]))
    states = np.array(block_output, dtype=np.float64)
    from attnkit.explain.steering import direction_of

    unnormed = direction_of(states, "pca_diff")
    assert np.abs(unnormed - reference.directions[3]).max() > 0.1  # the final norm matters


def test_the_sign_follows_the_majority_of_pairs():
    """Swapping every pair's positive and negative flips every direction (the principal component is the same
    line; the vote picks the other end)."""
    cfg = DecoderConfig(family="llama", vocab_size=30, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=3)

    class Letters:
        def encode(self, text):
            return [ord(c) - 96 for c in text if c.isalpha()]

    pairs = [("good day", "bad day"), ("nice one", "nasty one"), ("joy", "sad"), ("warm", "cold")]
    forward = control_vector(lm, Letters(), pairs, method="pca_center")
    backward = control_vector(lm, Letters(), [(n, p) for p, n in pairs], method="pca_center")
    for layer in (1, 2):
        np.testing.assert_allclose(backward.directions[layer], -forward.directions[layer], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pairs=[("a b", "c d")]), "'pca_diff' needs at least two pairs"),
    (dict(method="umap"), "method must be one of 'pca_diff', 'pca_center'"),
    (dict(pairs=[("a", "b"), ("c",)]), r"pairs\[1\] must be a \(positive, negative\) pair of str"),
    (dict(pairs="ab"), "pairs must be a non-empty sequence"),
    (dict(pairs=[("a", "b"), ("", "c")]), "has no tokens"),
    (dict(layers=[5]), r"layers must be ints in \[-3, 3\)"),
    (dict(layers=[1, -2]), "each layer once"),
    (dict(batch_size=0), "batch_size"),
])
def test_control_vector_refuses_bad_arguments(kwargs, match):
    cfg = DecoderConfig(family="llama", vocab_size=30, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))

    class Letters:
        def encode(self, text):
            return [ord(c) - 96 for c in text if c.isalpha()]

    arguments = {"pairs": [("a b", "c d"), ("e", "f")], **kwargs}
    with pytest.raises(ValueError, match=match):
        control_vector(CausalLM(cfg, rng=0), Letters(), **arguments)


# -- applying vectors: transformers with torch hooks, and repeng's ControlModel as referees ------------------
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_steered_logits_equal_transformers_with_forward_hooks(name, root, rng):
    folder, hf = saved_model(name, root)
    lm = load_causal_lm(folder)
    vector = random_vector(lm.config, rng)
    ids, mask = left_padded_batch(rng, (7, 4))
    with steering(lm, vector, 2.5):
        got = lm(ids, mask)
    reference = hf_steered_logits(hf, vector, 2.5, ids, mask)
    assert np.abs(got - reference)[mask].max() < LOGIT_TOL
    assert np.abs(reference - hf_logits(hf, ids, mask))[mask].max() > 0.1  # the vector moves the logits
    np.testing.assert_array_equal(lm(ids, mask), load_causal_lm(folder)(ids, mask))  # unsteered after the block


@pytest.mark.parametrize("name, layer_range, steered", [("llama_gqa", (1, 1), [1]), ("gemma2", (0, 0), [0]),
                                                        ("qwen3_next", (1, 5), [1, 2, 3])])
def test_a_layer_range_steers_only_its_layers(name, layer_range, steered, root, rng):
    folder, hf = saved_model(name, root)
    lm = load_causal_lm(folder)
    vector = random_vector(lm.config, rng, range(lm.config.num_layers))
    ids = rng.integers(2, 90, size=(1, 6))
    with steering(lm, vector, -1.5, layer_range=layer_range):
        got = lm(ids)
    assert np.abs(got - hf_steered_logits(hf, vector, -1.5, ids, layers=steered)).max() < LOGIT_TOL


def test_steered_generation_equals_transformers_generate_with_hooks(root, rng):
    """Every decoding step is steered (the prompt and each new token, from the KV cache)."""
    folder, hf = saved_model("llama_gqa", root)
    lm = load_causal_lm(folder)
    vector = random_vector(lm.config, rng)
    ids, mask = left_padded_batch(rng, (5, 3))

    def adder(direction):
        addition = torch.from_numpy(np.float32(3.0) * direction)
        return lambda module, inputs, output: (output[0] + addition, *output[1:]) if isinstance(output, tuple) \
            else output + addition

    handles = [hf_layers(hf)[layer].register_forward_hook(adder(d)) for layer, d in vector.directions.items()]
    try:
        from hf_models import hf_greedy

        reference = hf_greedy(hf, ids, mask, max_new_tokens=8)
    finally:
        for handle in handles:
            handle.remove()
    with steering(lm, vector, 3.0):
        got = lm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    np.testing.assert_array_equal(got, reference)
    assert not np.array_equal(lm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), reference)


def test_steered_logits_equal_repengs_control_model(root):
    repeng = import_repeng()
    folder, hf, tok = text_model(root, "llama")
    lm = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    vector = control_vector(lm, tokenizer, PAIRS)
    controlled = repeng.ControlModel(copy.deepcopy(hf), [1, 2, 3])
    controlled.set_control(repeng.ControlVector("llama", dict(vector.directions)), 4.0)
    ids = np.array([tokenizer.encode("I feel great today")])
    with torch.no_grad():
        reference = controlled(torch.from_numpy(ids)).logits.double().numpy()
    with steering(lm, vector, 4.0):
        got = lm(ids)
    assert np.abs(got - reference).max() < LOGIT_TOL
    assert np.abs(reference - hf_logits(hf, ids)).max() > 0.1


@pytest.mark.parametrize("vector_of, kwargs, error, match", [
    (lambda cfg: ControlVector({1: np.ones(cfg.hidden_size + 1)}), {}, ValueError, "has 33 features but the model"),
    (lambda cfg: ControlVector({2: np.ones(cfg.hidden_size)}), {}, ValueError, "layer 2, but the model has 2 layers"),
    (lambda cfg: ControlVector({1: np.ones(cfg.hidden_size)}), dict(scale=float("nan")), ValueError, "scale"),
    (lambda cfg: ControlVector({1: np.ones(cfg.hidden_size)}), dict(layer_range=(1, 0)), ValueError, "start <= end"),
    (lambda cfg: ControlVector({1: np.ones(cfg.hidden_size)}), dict(layer_range=3), TypeError, "layer_range"),
    (lambda cfg: {1: np.ones(cfg.hidden_size)}, {}, TypeError, "vector must be a ControlVector"),
])
def test_steering_refuses_what_does_not_fit_the_model(vector_of, kwargs, error, match, root):
    lm = load_causal_lm(saved_model("llama_gqa", root)[0])
    with pytest.raises(error, match=match):
        with steering(lm, vector_of(lm.config), **kwargs):
            pass


# -- the vector itself -----------------------------------------------------------------------------------------
def test_vectors_combine_layer_by_layer_with_missing_layers_zero():
    a = ControlVector({1: [1.0, 2.0], 3: [0.0, 1.0]}, "llama")
    b = ControlVector({1: [0.5, 0.5], 2: [4.0, 0.0]}, "llama")
    total = 2 * a - b / 2
    assert total.layers == [1, 2, 3] and total.model_hint == "llama"
    assert [total.directions[i].tolist() for i in (1, 2, 3)] == [[1.75, 3.75], [-2.0, 0.0], [0.0, 2.0]]
    assert (-a).directions[3].tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="cannot combine control vectors of 2 and 3 features"):
        a + ControlVector({1: [1.0, 2.0, 3.0]})


def test_a_vector_copies_its_directions_and_refuses_bad_ones():
    mine = np.array([1.0, 2.0])
    vector = ControlVector({1: mine})
    mine[0] = 9.0
    assert vector.directions[1].tolist() == [1.0, 2.0] and not vector.directions[1].flags.writeable
    for directions, match in [({}, "non-empty mapping"), ({-1: [1.0]}, "non-negative int"),
                              ({1: [[1.0]]}, "1-D"), ({1: [1.0], 2: [1.0, 2.0]}, "has 2 features but"),
                              ({1: [np.nan]}, "non-finite")]:
        with pytest.raises(ValueError, match=match):
            ControlVector(directions)


# -- llama.cpp's files -------------------------------------------------------------------------------------
def test_a_saved_vector_loads_as_it_was_and_as_gguf_reads_it(tmp_path, rng):
    vector = ControlVector({layer: rng.standard_normal(24) for layer in (3, 1, 7)}, "qwen3")
    path = save_control_vector(vector, tmp_path / "v.gguf")
    assert os.listdir(tmp_path) == ["v.gguf"]
    back = load_control_vector(path)
    assert back.layers == [1, 3, 7] and back.model_hint == "qwen3"
    for layer in back.layers:
        np.testing.assert_array_equal(back.directions[layer], vector.directions[layer])
    reader = gguf.GGUFReader(path)  # the format's own reader sees what llama.cpp's loader reads
    arch = reader.get_field("general.architecture")
    assert bytes(arch.parts[-1]).decode() == "controlvector"
    assert [t.name for t in reader.tensors] == ["direction.1", "direction.3", "direction.7"]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [24] for t in reader.tensors)
    assert int(reader.get_field("controlvector.layer_count").parts[-1][0]) == 3


def test_repengs_files_load_and_ours_load_in_repeng(tmp_path, rng):
    repeng = import_repeng()
    theirs = repeng.ControlVector("llama", {layer: rng.standard_normal(16).astype(np.float32) for layer in (1, 2, 5)})
    theirs.export_gguf(str(tmp_path / "theirs.gguf"))
    loaded = load_control_vector(tmp_path / "theirs.gguf")
    assert loaded.layers == [1, 2, 5] and loaded.model_hint == "llama"
    for layer in loaded.layers:
        np.testing.assert_array_equal(loaded.directions[layer], theirs.directions[layer])
    save_control_vector(3.0 * loaded, tmp_path / "ours.gguf")
    again = repeng.ControlVector.import_gguf(str(tmp_path / "ours.gguf"))
    assert again.model_type == "llama" and sorted(again.directions) == [1, 2, 5]
    for layer in (1, 2, 5):
        np.testing.assert_array_equal(again.directions[layer], np.float32(3.0) * theirs.directions[layer])


def write_gguf(path, tensors, arch="controlvector"):
    writer = gguf.GGUFWriter(str(path), arch)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ONES = np.ones(8, dtype=np.float32)


@pytest.mark.parametrize("tensors, arch, match", [
    ({"direction.0": ONES}, "controlvector", "'direction.0' is for layer 0, which llama.cpp never steers"),
    ({"direction.1": ONES, "bias.2": ONES}, "controlvector", "'bias.2' is not a direction"),
    ({"direction.x": ONES}, "controlvector", "'direction.x' is not a direction"),
    ({"direction.1": ONES.astype(np.float16)}, "controlvector", "is F16, but a direction is F32"),
    ({"direction.1": np.ones((2, 8), np.float32)}, "controlvector", r"has shape \(8, 2\), but a direction is 1-D"),
    ({"direction.1": ONES, "direction.2": np.ones(9, np.float32)}, "controlvector", "has 9 values, the others 8"),
    ({"direction.1": ONES * np.nan}, "controlvector", "holds NaN or infinite values"),
    ({"blk.0.attn_q.weight": ONES}, "llama", "is not a control vector: its general.architecture is 'llama'"),
    ({}, "controlvector", "holds no direction tensors"),
])
def test_a_file_llama_cpp_would_refuse_is_refused_naming_it(tensors, arch, match, tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", tensors, arch)
    with pytest.raises(ValueError, match=match) as caught:
        load_control_vector(path)
    assert str(path) in str(caught.value)


def test_a_damaged_file_fails_at_its_header_before_any_direction_is_read(tmp_path):
    good = save_control_vector(ControlVector({1: ONES, 2: ONES}), tmp_path / "good.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-20])  # the last tensor runs past the end
    with pytest.raises(ValueError, match="is truncated: tensor 'direction.2' needs bytes up to"):
        load_control_vector(cut)
    huge = bytearray(data)
    count_at = data.index(b"direction.1") + len(b"direction.1") + 4  # the first tensor's first dimension
    huge[count_at:count_at + 8] = (2**40).to_bytes(8, "little")  # would be 4 TB of floats
    (tmp_path / "huge.gguf").write_bytes(bytes(huge))
    with pytest.raises(ValueError, match="huge.gguf"):
        load_control_vector(tmp_path / "huge.gguf")
    (tmp_path / "text.gguf").write_text("not gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_control_vector(tmp_path / "text.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_control_vector(tmp_path / "absent.gguf")


def test_saving_is_atomic_and_refuses_layer_zero(tmp_path, monkeypatch):
    path = save_control_vector(ControlVector({1: ONES}), tmp_path / "v.gguf")
    before = path.read_bytes()
    import shutil

    def fails(source, target):
        target.write(source.read(10))
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copyfileobj", fails)
    with pytest.raises(OSError, match="disk full"):
        save_control_vector(ControlVector({1: 2 * ONES}), path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["v.gguf"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="layer 0, which llama.cpp refuses"):
        save_control_vector(ControlVector({0: ONES, 1: ONES}), path)
    assert path.read_bytes() == before


def test_a_tokenizers_tokenizer_gives_the_same_vector_as_the_folders(root):
    """``tokenizers.Tokenizer.encode`` returns an Encoding (its ``ids``), attnkit's and transformers' a list."""
    from tokenizers import Tokenizer

    folder, _, tok = text_model(root, "llama")
    lm = load_causal_lm(folder)
    plain = control_vector(lm, load_tokenizer(folder), PAIRS)
    for other in (Tokenizer.from_file(str(folder / "tokenizer.json")), tok):
        again = control_vector(lm, other, PAIRS)
        for layer in plain.layers:
            np.testing.assert_array_equal(again.directions[layer], plain.directions[layer])


@pytest.mark.parametrize("rows, width", [(3, 8), (12, 5), (2, 2), (40, 40)])
def test_the_first_component_is_scikit_learns_with_its_sign(rows, width):
    """PCA(n_components=1) as repeng calls it (centred rows, the largest entry positive), in float64."""
    decomposition = pytest.importorskip("sklearn.decomposition", reason="scikit-learn is PCA's referee (test extra)")
    from attnkit.explain.steering import first_component

    train = np.random.default_rng(rows * width).standard_normal((rows, width)) * np.linspace(3, 1, width)
    reference = decomposition.PCA(n_components=1, svd_solver="full").fit(train).components_[0]
    np.testing.assert_allclose(first_component(train), reference, rtol=0, atol=1e-12)
    assert first_component(train)[np.argmax(np.abs(reference))] > 0


def test_a_tied_vote_keeps_the_components_sign():
    """Two pairs, one on each side of the line: the vote ties and the sign is PCA's (largest entry positive), as
    repeng keeps it; one more pair like the first flips it."""
    from attnkit.explain.steering import direction_of

    axis = np.array([0.0, -3.0, 1.0]) / np.sqrt(10)
    states = np.array([axis, -axis, -2 * axis, 2 * axis])  # pair 0: positive above; pair 1: positive below
    tied = direction_of(states, "pca_center")
    np.testing.assert_allclose(tied, -axis, rtol=0, atol=1e-7)  # -axis has its largest entry (+3) positive
    flipped = direction_of(np.concatenate([states, [3 * axis, -3 * axis]]), "pca_center")
    np.testing.assert_allclose(flipped, axis, rtol=0, atol=1e-7)  # positives below -axis in two pairs of three
