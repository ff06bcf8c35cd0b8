"""Multi-token prediction: DeepSeek-V3's and GLM-4.5's prediction layers read from a checkpoint equal transformers'
``MtpModel``
(its ``generate(..., use_mtp=True)`` draft), the model itself loads with them present, greedy decoding that drafts
with them is token for token plain greedy decoding, and a checkpoint without them is refused by name."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attnkit.decoding.sampling import generate  # noqa: E402
from attnkit.decoding.speculative import MultiTokenDraft  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig, MultiTokenPredictor  # noqa: E402
from attnkit.models.multi_token import MTPLayer, mtp_config  # noqa: E402
from attnkit.pretrained import load_causal_lm, load_multi_token_predictor  # noqa: E402
from hf_models import saved_model  # noqa: E402

IDS = np.array([[3, 17, 5, 40, 9, 22, 31, 8]])


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_multi_token")


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32", "glm4_moe"])
def with_mtp(request, hf_root, tmp_path_factory):
    """(folder, hf model in float64, transformers' MtpModel in float64): a tiny model of the test models with one
    prediction layer written after its last layer, as DeepSeek and GLM publish it (the layer's block from a model
    one layer deeper, saved by transformers; enorm, hnorm, eh_proj, shared_head.norm and the copies of the
    embedding and head beside it)."""
    from safetensors.numpy import load_file, save_file
    from transformers.modeling_layers import MtpModel

    folder, shared = saved_model(request.param, hf_root)
    hf = copy.deepcopy(shared).double()  # the shared model stays as the other tests built it
    n = hf.config.num_hidden_layers
    torch.manual_seed(3)
    per_layer = ("layer_types", "mlp_layer_types")  # derived again for the deeper model
    deeper = type(hf)(type(hf.config).from_dict({**{k: v for k, v in hf.config.to_dict().items() if k not in per_layer},
                                                 "num_hidden_layers": n + 1}))
    with torch.no_grad():
        for name, p in deeper.named_parameters():
            if "norm" in name:
                p.mul_(0.5 + torch.rand_like(p))
        for name, b in deeper.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    d = hf.config.hidden_size
    gen = np.random.default_rng(3)
    bound = (2 * d) ** -0.5  # nn.Linear's initial range
    extra = {"enorm": 0.5 + gen.random(d), "hnorm": 0.5 + gen.random(d), "shared_head.norm": 0.5 + gen.random(d),
             "eh_proj": gen.uniform(-bound, bound, (d, 2 * d))}
    extra = {name: w.astype(np.float32) for name, w in extra.items()}
    mtp = None
    if getattr(hf.config, "num_mtp_layers", None) is not None:  # transformers' MtpModel, where it has one
        mtp = MtpModel(hf, 1).double().eval()
        layer = mtp.layers[0]
        layer.mtp_block.load_state_dict(deeper.model.layers[n].double().state_dict())
        with torch.no_grad():
            for name, part in (("enorm", layer.enorm), ("hnorm", layer.hnorm), ("eh_proj", layer.eh_proj),
                               ("shared_head.norm", layer.post_norm)):
                part.weight.copy_(torch.from_numpy(extra[name].astype(np.float64)))
            for p in mtp.parameters():
                p.copy_(p.float().double())  # as the float32 file stores them
    root = tmp_path_factory.mktemp(f"mtp_{request.param}")
    deeper.save_pretrained(root / "deeper")
    target = root / f"{request.param}_mtp"
    shutil.copytree(folder, target)
    tensors = load_file(str(target / "model.safetensors"))
    prefix = f"model.layers.{n}."
    tensors.update({k: v for k, v in load_file(str(root / "deeper" / "model.safetensors")).items()
                    if k.startswith(prefix)})
    tensors.update({f"{prefix}{name}.weight": w for name, w in extra.items()})
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[prefix + "shared_head.head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    save_file(tensors, str(target / "model.safetensors"))
    return target, hf, mtp


def test_the_model_loads_past_its_prediction_layers_and_is_unchanged(with_mtp, hf_root):
    target, hf, _ = with_mtp
    plain = load_causal_lm(saved_model(hf.config.model_type, hf_root)[0])
    lm = load_causal_lm(target)
    assert lm.config.mtp_layers == 1
    np.testing.assert_array_equal(lm(IDS), plain(IDS))


def test_prediction_layers_equal_transformers_mtp_model(with_mtp):
    from transformers.cache_utils import MtpCache

    target, hf, mtp = with_mtp
    if mtp is None:
        pytest.skip(f"transformers has no multi-token prediction for {hf.config.model_type} (no num_mtp_layers)")
    lm = load_causal_lm(target, dtype=np.float64)
    predictor = load_multi_token_predictor(target, lm)
    with torch.no_grad():
        theirs_hidden = hf(torch.tensor(IDS), output_hidden_states=True).hidden_states[-1]
        _, theirs, _ = mtp(input_ids=torch.tensor(IDS[:, 1:]), last_hidden_states=theirs_hidden[:, :-1],
                           attention_mask=None, position_ids=torch.arange(1, IDS.shape[1])[None],
                           mtp_cache=MtpCache(config=hf.config.get_mtp_config()))
    _, hidden = lm(IDS, return_hidden=True)
    # transformers keeps its rotary tables in float32: the float64 runs agree to its rounding
    np.testing.assert_allclose(hidden, theirs_hidden.numpy(), atol=2e-6, rtol=0)
    logits, tokens = predictor.draft(IDS[:, 1:], hidden[:, :-1])
    np.testing.assert_allclose(logits, theirs.numpy(), atol=2e-6, rtol=0)
    assert tokens[0, 0] == int(theirs[0, 0].argmax())
    # the same slots fed through the cache in two pieces give the same prediction
    cache = predictor.new_cache(1)
    predictor.draft(IDS[:, 1:4], hidden[:, :3], cache=cache)
    stepped, _ = predictor.draft(IDS[:, 4:], hidden[:, 3:-1], np.ones((1, IDS.shape[1] - 1), bool),
                                 position_ids=np.arange(4, IDS.shape[1])[None], cache=cache)
    np.testing.assert_allclose(stepped, logits, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rows", ["one", "left_padded"])
def test_greedy_drafting_with_prediction_layers_is_plain_greedy(with_mtp, rows):
    target = with_mtp[0]
    lm = load_causal_lm(target)
    predictor = load_multi_token_predictor(target, lm)
    ids, mask = IDS, None
    if rows == "left_padded":
        ids = np.array([[0, 0, 3, 17, 5, 40, 9, 22], [4, 8, 15, 16, 23, 42, 7, 1]])
        mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=bool)
    plain = lm.generate(ids, mask, max_new_tokens=24, do_sample=False)
    drafted = lm.generate(ids, mask, max_new_tokens=24, do_sample=False, assistant_model=predictor)
    np.testing.assert_array_equal(drafted, plain)


class _Checked(MultiTokenDraft):
    """Every draft checked against the predictor run afresh, without a cache, on the whole sequence so far; its
    drafts cost nothing and verifying costs a step, so it drafts every round it expects to gain in (and checks
    its drafts against the tokens that came in the others)."""

    def __init__(self, predictor, model):
        super().__init__(predictor, draft_cost=0.0, verify_costs=[1.0])
        self.model, self.checked = model, 0

    def _draft(self, sequences, mask, size):
        drafts = super()._draft(sequences, mask, size)
        if drafts is not None:
            _, hidden = self.model(sequences[:, :-1], mask[:, :-1], return_hidden=True)
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
            _, fresh = self.predictor.draft(sequences[:, 1:], hidden, mask[:, :-1], position_ids=positions[:, 1:])
            np.testing.assert_array_equal(drafts, fresh[:, :size])
            self.checked += 1
        return drafts


def _always_token_zero(lm: CausalLM, predictor: MultiTokenPredictor) -> None:
    """Zero final-norm gains: every logit is 0, so the model and each prediction layer choose token 0 always
    (every draft is kept)."""
    lm.norm.gamma[...] = 0.0
    for layer in predictor.layers:
        layer.post_norm.gamma[...] = 0.0


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("kept", ["some", "all"])
def test_prediction_cache_gives_the_drafts_of_a_fresh_run(layers, kept):
    """The prediction layers' own cache keeps exactly the slots computed from kept tokens: each round's drafts
    equal the layers run afresh on the whole sequence, whether drafts were rejected or all kept (1-3 layers; layer
    k's last k slots read drafts and are run again)."""
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=4, mlp=MLPConfig(24), mtp_layers=layers)
    lm = CausalLM(cfg, rng=0).astype(np.float64)
    predictor = MultiTokenPredictor(lm, rng=1)
    if kept == "all":
        _always_token_zero(lm, predictor)
    ids = np.array([[0, 0, 3, 7, 1], [2, 5, 9, 4, 6]])
    mask = np.array([[0, 0, 1, 1, 1], [1] * 5], dtype=bool)
    proposer = _Checked(predictor, lm)
    out = generate(lm, ids, mask, max_new_tokens=20, do_sample=False, assistant_model=proposer)
    np.testing.assert_array_equal(out, generate(lm, ids, mask, max_new_tokens=20, do_sample=False))
    assert proposer.checked >= 3
    if kept == "all":
        assert proposer.kept == proposer.proposed > 0


def test_prediction_layer_backward_matches_finite_differences():
    cfg = mtp_config(DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
                                   num_kv_heads=1, head_dim=4, mlp=MLPConfig(12), mtp_layers=1))
    layer = MTPLayer(cfg, 0, rng=0).astype(np.float64)
    rng = np.random.default_rng(1)
    e, h = rng.standard_normal((2, 1, 3, 8))
    w = rng.standard_normal((1, 3, 8))

    def loss(e_, h_):
        return float((layer(e_, h_) * w).sum())

    loss(e, h)
    layer.zero_grad()
    ge, gh = layer.backward(w)
    eps = 1e-6
    for x, g, which in ((e, ge, 0), (h, gh, 1)):
        numeric = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[i] += eps
            down[i] -= eps
            args_up, args_down = ((up, h), (down, h)) if which == 0 else ((e, up), (e, down))
            numeric[i] = (loss(*args_up) - loss(*args_down)) / (2 * eps)
        np.testing.assert_allclose(g, numeric, atol=1e-8, rtol=1e-6)
    loss(e, h)
    layer.zero_grad()
    layer.backward(w)
    W = layer.eh_proj.W
    analytic = layer.eh_proj.grads["W"].copy()
    numeric = np.zeros_like(W)
    for i in [(0, 0), (5, 3), (15, 7)]:
        old = W[i]
        W[i] = old + eps
        up = loss(e, h)
        W[i] = old - eps
        down = loss(e, h)
        W[i] = old
        numeric[i] = (up - down) / (2 * eps)
        assert abs(analytic[i] - numeric[i]) < 1e-7 * max(1.0, abs(numeric[i]))


def test_a_checkpoint_without_prediction_layers_is_refused_by_name(hf_root, tmp_path):
    folder = saved_model("deepseek_v3", hf_root)[0]
    lm = load_causal_lm(folder)
    with pytest.raises(ValueError, match="holds none of their tensors"):
        load_multi_token_predictor(folder, lm)
    llama = saved_model("llama_gqa", hf_root)[0]
    with pytest.raises(ValueError, match="llama checkpoints have no multi-token-prediction layers"):
        load_multi_token_predictor(llama, load_causal_lm(llama))
    config = json.loads((folder / "config.json").read_text())
    none = tmp_path / "none"
    shutil.copytree(folder, none)
    (none / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 0, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="declares no multi-token-prediction layers"):
        load_multi_token_predictor(none, load_causal_lm(none))


def test_a_checkpoint_missing_part_of_a_prediction_layer_is_refused_by_name(with_mtp, tmp_path):
    from safetensors.numpy import load_file, save_file

    target = tmp_path / "partial"
    shutil.copytree(with_mtp[0], target)
    tensors = load_file(str(target / "model.safetensors"))
    name = next(k for k in tensors if k.endswith(".hnorm.weight"))
    del tensors[name]
    save_file(tensors, str(target / "model.safetensors"))
    lm = load_causal_lm(target)
    with pytest.raises(ValueError, match=f"no tensor {name!r}"):
        load_multi_token_predictor(target, lm)


def test_the_two_names_of_the_count_are_read_and_must_agree(hf_root, tmp_path):
    folder = saved_model("deepseek_v3", hf_root)[0]
    config = json.loads((folder / "config.json").read_text())
    config.pop("num_mtp_layers", None)
    config.pop("num_nextn_predict_layers", None)
    for values, expected in (({"num_nextn_predict_layers": 2}, 2), ({}, 1),
                             ({"num_nextn_predict_layers": 1, "num_mtp_layers": 1}, 1)):
        edited = tmp_path / f"c{expected}{len(values)}"
        shutil.copytree(folder, edited)
        (edited / "config.json").write_text(json.dumps({**config, **values}))
        assert load_causal_lm(edited).config.mtp_layers == expected
    (edited / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1, "num_mtp_layers": 2}))
    with pytest.raises(ValueError, match="must agree"):
        load_causal_lm(edited)


def test_mtp_drafts_must_be_the_models_own():
    cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12), mtp_layers=1)
    lm, other = CausalLM(cfg, rng=0), CausalLM(cfg, rng=1)
    with pytest.raises(ValueError, match="another model"):
        lm.generate(IDS[:, :3] % 11, max_new_tokens=3, assistant_model=MultiTokenPredictor(other, rng=2))


def test_generate_command_drafts_with_prediction_layers_and_keeps_greedy_text(with_mtp, capsys):
    from attnkit.cli import main

    target = with_mtp[0]
    lm = load_causal_lm(target)
    plain = lm.generate(IDS, max_new_tokens=12, do_sample=False)[0].tolist()
    eos = lm.config.tokens.eos
    cut = next((i + 1 for i, t in enumerate(plain[IDS.shape[1]:], IDS.shape[1]) if t == eos), len(plain))
    ids = ",".join(map(str, IDS[0]))
    assert main(["generate", str(target), "--ids", ids, "--max-new-tokens", "12", "--draft-mtp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == plain[:cut]


def test_generate_command_without_prediction_layers_says_so_in_one_line(hf_root):
    from cli_helpers import run_attnkit

    folder = saved_model("deepseek_v3", hf_root)[0]
    proc = run_attnkit(["generate", folder, "--ids", "1,2", "--draft-mtp"], cwd=folder)
    assert proc.returncode == 2 and "--draft-mtp:" in proc.stderr and "holds none of their tensors" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
