"""compare on each kind of side: recorded activations (a mapping and an .npz), a user's PyTorch Llama with a
name map and the points and records it declares (correct, and with a bug in one layer), attnkit in float32 and
float64; the rule's floor; the scores made from probabilities; and the errors of bad sides."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.testing import (  # noqa: E402
    AttnkitSide,
    RecordedSide,
    Reference,
    TorchSide,
    compare,
    scores_from_probs,
    torch_side_from_folder,
    transformers_side,
)
from hf_models import saved_model  # noqa: E402
from torch_llama import build, build_broken, build_shifted, name_map  # noqa: E402

IDS = np.array([5, 17, 3, 44, 9, 60, 2, 31])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(folder, transformers model, config dict, reference) of a tiny Llama without biases."""
    folder, hf = saved_model("llama_sharded", tmp_path_factory.mktemp("compare_sides"))
    return folder, hf, json.loads((folder / "config.json").read_text()), Reference(folder)


def test_a_recorded_trace_is_compared_as_it_was_recorded(llama, tmp_path):
    folder, hf, _, reference = llama
    recorded = transformers_side(hf).trace(IDS)
    path = tmp_path / "run.npz"
    np.savez(path, input_ids=IDS, **{k: v for k, v in recorded.items() if not k.endswith(".scores")})
    result = compare(path, AttnkitSide(folder), IDS, reference=reference)
    assert result.verdict() == "no divergence"
    assert result.a == f"recorded ({path})"
    # one layer's MLP output recorded wrong by 1e-3: found there, and nowhere before it
    broken = dict(recorded)
    broken["layers.1.mlp"] = recorded["layers.1.mlp"] + 1e-3
    result = compare(broken, AttnkitSide(folder), IDS, reference=reference)
    assert (result.first.layer, result.first.op) == (1, "mlp")
    assert result.first.max_abs == pytest.approx(1e-3, rel=1e-3)
    # a second variant: the probabilities of one head with one key masked (a window one key too narrow)
    masked = dict(recorded)
    probs = recorded["layers.0.probs"].copy()
    probs[0, 2, 5, 0] = 0.0
    probs[0, 2, 5] /= probs[0, 2, 5].sum()
    masked["layers.0.probs"] = probs
    masked.pop("layers.0.scores")
    result = compare(masked, AttnkitSide(folder), IDS, reference=reference)
    assert (result.first.layer, result.first.op, result.first.error_a) == (0, "scores", np.inf)
    # recordings of other ids are refused
    with pytest.raises(ValueError, match="recorded for input_ids"):
        compare(path, AttnkitSide(folder), IDS[:-1], reference=reference)


def test_recordings_without_a_batch_axis_or_with_merged_heads_are_aligned(llama):
    folder, hf, _, reference = llama
    trace = transformers_side(hf).trace(IDS)
    bare = {k: v[0] for k, v in trace.items()}
    bare["layers.0.q"] = trace["layers.0.q"].reshape(1, len(IDS), -1)  # (B, L, H*Dh)
    assert compare(bare, AttnkitSide(folder), IDS, reference=reference).verdict() == "no divergence"
    bare["layers.0.q"] = trace["layers.0.q"].reshape(1, len(IDS), 2, -1)
    with pytest.raises(ValueError, match=r"layers.0.q of shape \(1, 8, 2, 16\), but attnkit's is \(1, 8, 4, 8\)"):
        compare(bare, AttnkitSide(folder), IDS, reference=reference)


@pytest.mark.parametrize("factory, layer, op", [(build, None, None),
                                                (build_broken, 1, "scores"),
                                                (build_shifted, 0, "rotary_q")])
def test_a_users_pytorch_llama_is_checked_through_its_points_and_records(llama, factory, layer, op):
    folder, _, config, reference = llama
    side = torch_side_from_folder(factory, folder, name_map(config))
    result = compare(side, AttnkitSide(folder), IDS, reference=reference)
    compared = {r.op for r in result.rows if r.layer == 0}
    assert {"norm", "q", "k", "v", "rotary_q", "rotary_k", "scores", "probs", "mlp", "resid"} == compared
    if layer is None:
        assert result.verdict() == "no divergence", result.table()
    else:
        assert result.verdict() == f"first divergence: layer {layer}, {op}", result.table()
    assert side.module.attnkit_record is None  # the recorder is taken away after the run


def test_attnkit_float64_against_float32_is_held_to_each_dtypes_rounding(llama):
    folder, _, _, reference = llama
    result = compare(AttnkitSide(folder, dtype=np.float64), AttnkitSide(folder), IDS, reference=reference)
    assert result.verdict() == "no divergence"
    assert max(r.error_a for r in result.rows) == 0.0  # the float64 side is the reference itself
    # the float64 side's limit is the floor alone: 16 float64 ulps of the tensor's scale
    row = next(r for r in result.rows if r.name == "layers.1.resid")
    scale = np.abs(reference.trace(np.float64, IDS)["layers.1.resid"]).max()
    assert row.limit_a == pytest.approx(16 * np.finfo(np.float64).eps * scale)
    # a float64 side off by 1e-12 (far below float32's rounding) diverges: it is judged in float64
    trace = dict(reference.trace(np.float64, IDS))
    trace["layers.1.v"] = trace["layers.1.v"] + 1e-12
    result = compare(RecordedSide(trace), AttnkitSide(folder), IDS, reference=reference)
    assert result.verdict() == "first divergence: layer 1, v"


def test_scores_are_the_logits_less_their_row_mean():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 4, 5))
    logits[..., 3:] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    scores = scores_from_probs(p.astype(np.float32))
    expected = logits[..., :3] - logits[..., :3].mean(-1, keepdims=True)
    np.testing.assert_allclose(scores[..., :3], expected, atol=2e-6)
    assert np.all(scores[..., 3:] == -np.inf)


def test_bad_sides_are_refused_naming_what_was_wrong(llama, tmp_path):
    folder, hf, _, reference = llama
    with pytest.raises(ValueError, match="'layers.0.attention' is not a trace name"):
        RecordedSide({"layers.0.attention": np.zeros(3)})
    with pytest.raises(ValueError, match="has dtype int64, expected floats"):
        RecordedSide({"layers.0.q": np.zeros(3, dtype=np.int64)})
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="cannot read"):
        RecordedSide(bad)
    with pytest.raises(ValueError, match="neither side is an attnkit model"):
        compare({"embed": np.zeros((1, 8, 32))}, {"embed": np.zeros((1, 8, 32))}, IDS)
    with pytest.raises(ValueError, match="no activation in common"):
        compare({"layers.9.q": np.zeros(3)}, AttnkitSide(folder), IDS, reference=reference)
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        TorchSide(object())
    with pytest.raises(ValueError, match="has no submodule 'blocks.7'"):
        TorchSide(torch.nn.Linear(2, 2), points={"layers.0.norm": "blocks.7"})
    with pytest.raises(ValueError, match="must run eager attention"):
        transformers_side(type(hf).from_pretrained(folder, attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="input_ids must be"):
        compare(AttnkitSide(folder), AttnkitSide(folder), [[0.5, 1.5]])


def test_a_gguf_file_is_a_side_and_its_own_reference(llama, tmp_path):
    pytest.importorskip("gguf")
    from gguf_models import write_gguf

    _, hf, _, _ = llama
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path)
    result = compare(transformers_side(hf), AttnkitSide(path), IDS)  # the reference: the GGUF file in float64
    assert result.verdict() == "no divergence", result.table()
    assert result.b == f"attnkit float32 ({path})"
    assert {"layers.1.rotary_q", "layers.1.scores", "logits"} <= {r.name for r in result.rows}
