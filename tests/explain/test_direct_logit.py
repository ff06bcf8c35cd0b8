"""direct_logit_attribution: the parts sum to the logit at float64 rounding on every kind of block, and a
head's share equals the same product computed in torch from transformers' own tensors."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import direct_logit_attribution  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import TOL, float64_pair, hf_layers, hf_output_projection, saved_model  # noqa: E402

IDS = np.array([5, 17, 3, 60, 42, 9, 77, 21])


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_dla")


def total(parts):
    return parts["embed"] + parts["pos_embed"] + parts["heads"].sum(axis=(-2, -1)) + parts["mlp"].sum(-1) + \
        parts["per_layer"].sum(-1) + parts["bias"]


# LayerNorm with biases and learned positions; GQA with biases; post-norms, soft-caps and an embedding scale;
# post-norms only; parallel residual; sinks, output biases and experts; per-head q/k norms; wider global heads,
# reused keys and values, per-layer inputs and layer scalars; experts beside a dense layer
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "gemma2", "olmo2", "gpt_neox", "gpt_oss", "qwen3",
                                  "gemma4_text", "qwen3_moe"])
def test_parts_sum_to_the_logit(name, hf_root):
    folder, _ = saved_model(name, hf_root)
    lm = load_causal_lm(folder, dtype=np.float64)
    parts = direct_logit_attribution(lm, IDS, target=7, target_position=5)
    assert parts["heads"].shape == (lm.config.num_layers, lm.config.num_heads)
    assert parts["mlp"].shape == (lm.config.num_layers,)
    assert parts["logit"] == lm(IDS[None])[0, 5, 7]
    assert abs(total(parts) - parts["logit"]) < 1e-10
    assert np.abs(parts["heads"]).min() > 0  # every head contributes something
    assert (np.abs(parts["per_layer"]).min() > 0) == bool(lm.layer_inputs)
    # a batch is its rows
    batch = np.stack([IDS, IDS[::-1]])
    both = direct_logit_attribution(lm, batch, target=[7, 8], target_position=5)
    assert both["heads"].shape == (2, lm.config.num_layers, lm.config.num_heads)
    np.testing.assert_allclose(both["heads"][0], parts["heads"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(total(both), both["logit"], rtol=0, atol=1e-10)
    np.testing.assert_allclose(both["logit"][1], direct_logit_attribution(lm, IDS[::-1], 8, 5)["logit"])


def test_head_share_equals_torch(hf_root):
    """Head h of layer 1: (z_h @ W_O[h]) . (W_U[t] * weight / rms(final residual)), from transformers' tensors."""
    lm, hf = float64_pair("llama_gqa", hf_root)
    target, position, dh = 7, -1, lm.config.head_dim
    parts = direct_logit_attribution(lm, IDS, target)
    seen = {}
    projection = hf_output_projection(hf_layers(hf)[1])
    handles = [projection.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0])),
               hf.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("resid", a[0]))]
    with torch.no_grad():
        hf(torch.from_numpy(IDS[None]), position_ids=torch.arange(len(IDS))[None])
        for handle in handles:
            handle.remove()
        resid = seen["resid"][0, position]
        norm = hf.model.norm
        direction = hf.lm_head.weight[target] * norm.weight / torch.sqrt(resid.pow(2).mean() + norm.variance_epsilon)
        for head in range(lm.config.num_heads):
            cols = slice(head * dh, (head + 1) * dh)
            written = seen["z"][0, position, cols] @ projection.weight[:, cols].T  # (D,)
            np.testing.assert_allclose(parts["heads"][1, head], float(written @ direction), atol=TOL)


def test_errors():
    cfg = DecoderConfig(family="llama", vocab_size=13, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))
    lm = CausalLM(cfg, rng=0)
    with pytest.raises(ValueError, match=r"target must be a token id in \[0, 13\) or one per row \(1,\), got 13"):
        direct_logit_attribution(lm, [1, 2], 13)
    with pytest.raises(ValueError, match=r"target must be a token id in \[0, 13\) or one per row \(2,\)"):
        direct_logit_attribution(lm, [[1, 2], [3, 4]], [1, 2, 3])
    with pytest.raises(ValueError, match=r"target_position must be in \[-2, 2\)"):
        direct_logit_attribution(lm, [1, 2], 3, target_position=2)
