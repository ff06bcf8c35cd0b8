"""Hook points of the BERT encoder (BertEncoder, MiniLM's) against transformers' BertModel on the same tiny
random weights, in float64: the cache, a head ablation and the hooked backward."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from attnkit.explain import hook_names, hooks, run_with_cache  # noqa: E402
from attnkit.pretrained import BertConfig, BertEncoder, bert_state_dict  # noqa: E402

IDS = np.array([[2, 7, 11, 5, 3, 9], [2, 4, 8, 3, 0, 0]])
MASK = IDS > 0
HEAD_DIM = 4


@pytest.fixture(scope="module")
def pair():
    """(attnkit BertEncoder, transformers BertModel), float64, the same random weights."""
    config = transformers.BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=24, max_position_embeddings=12, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.BertModel(config, add_pooling_layer=False).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = BertEncoder(BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=24, max_position_embeddings=12), rng=0).astype(np.float64)
    tensors = {name: t.detach().numpy() for name, t in hf.state_dict().items()}
    ours.load_state_dict(bert_state_dict(tensors, num_layers=2), strict=False)
    return ours, hf


def hf_run(hf, pre_hooks=(), **kwargs):
    handles = [module.register_forward_pre_hook(fn) for module, fn in pre_hooks]
    try:
        return hf(torch.from_numpy(IDS), attention_mask=torch.from_numpy(MASK.astype(np.int64)), **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def test_cache_equals_hf_hidden_states_and_attentions(pair):
    ours, hf = pair
    out, cache = run_with_cache(ours, IDS, attention_mask=MASK)
    assert hook_names(ours)[:3] == ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_q"]
    z_in = {}
    handles = [layer.attention.output.dense.register_forward_pre_hook(
        lambda m, a, i=i: z_in.__setitem__(i, a[0].detach().numpy())) for i, layer in enumerate(hf.encoder.layer)]
    with torch.no_grad():
        want = hf_run(hf, output_hidden_states=True, output_attentions=True)
    for handle in handles:
        handle.remove()
    real = MASK[..., None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want.last_hidden_state.numpy(), 0), atol=1e-12)
    for i in range(2):
        np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_pre"], want.hidden_states[i].numpy(), atol=1e-12)
        np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_post"], want.hidden_states[i + 1].numpy(),
                                   atol=1e-12)
        np.testing.assert_allclose(cache[f"blocks.{i}.attn.hook_pattern"], want.attentions[i].numpy(), atol=1e-12)
        np.testing.assert_allclose(cache[f"blocks.{i}.attn.hook_z"].reshape(2, 6, 16), z_in[i], atol=1e-12)
        np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_mid"],
                                   cache[f"blocks.{i}.hook_resid_pre"] + cache[f"blocks.{i}.hook_attn_out"],
                                   atol=1e-15)
    np.testing.assert_array_equal(cache["hook_embed"], ours.word_embeddings.weight[IDS])


def test_head_ablation_and_backward_equal_torch(pair):
    ours, hf = pair
    layer, head = 1, 3

    def ablate(z, name):
        z = z.copy()
        z[:, :, head] = 0.0
        return z

    def torch_ablate(module, args):
        x = args[0].detach().clone()  # a replaced value is a constant in attnkit's backward too
        x[..., head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0.0
        return (x,) + args[1:]

    weights = np.random.default_rng(0).normal(size=(2, 6, 16)) * MASK[..., None]
    seen = {}
    with hooks(ours, {f"blocks.{layer}.attn.hook_z": ablate},
               backward={"blocks.0.hook_resid_post": lambda g, n: seen.__setitem__(n, np.array(g))}):
        out = ours(IDS, attention_mask=MASK)
        grad = ours.backward(weights)
    ours.zero_grad()
    captured = {}

    def keep(module, args):
        args[0].retain_grad()
        captured["resid"] = args[0]

    dense = hf.encoder.layer[layer].attention.output.dense
    hf.zero_grad()
    got = hf_run(hf, [(dense, torch_ablate), (hf.encoder.layer[1], keep)])
    (got.last_hidden_state * torch.from_numpy(weights)).sum().backward()
    np.testing.assert_allclose(np.where(MASK[..., None], out, 0),
                               np.where(MASK[..., None], got.last_hidden_state.detach().numpy(), 0), atol=1e-12)
    np.testing.assert_allclose(seen["blocks.0.hook_resid_post"], captured["resid"].grad.numpy(), atol=1e-12)
    word_grad = np.zeros((16, 16))  # the looked-up rows' gradients, added into the table (row 0, padding, has none)
    np.add.at(word_grad, IDS, grad)
    np.testing.assert_allclose(word_grad[1:], hf.embeddings.word_embeddings.weight.grad.numpy()[1:], atol=1e-12)
    hf.zero_grad()
