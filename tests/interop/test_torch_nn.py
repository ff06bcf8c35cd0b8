"""float64 parity with torch.nn through ``from_torch``, and ``to_torch_state_dict`` round trips.

Forward outputs must agree within 1e-10 and every input and parameter gradient within 1e-9, relative to the
largest magnitude of torch's array (``helpers.max_rel_diff``). attnkit masks are ``True`` = may attend /
real token, so torch receives their negation.
"""
import numpy as np
import pytest

import torch
from attnkit import interop
from attnkit.attention import MultiHeadAttention
from attnkit.core.converters import torch_converters
from attnkit.interop import torch_nn
from attnkit.layers import (
    LayerNorm,
    Transformer,
    TransformerDecoder,
    TransformerDecoderBlock,
    TransformerEncoder,
    TransformerEncoderBlock,
)

from helpers import make_rng, max_rel_diff, randn

# torch's nn.Transformer warns that a pre-norm encoder cannot take its nested-tensor fast path, which these
# tests never use: the warning is torch's own and says nothing about the parity checked here.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")

FORWARD_TOL, GRAD_TOL = 1e-10, 1e-9
B, LS, LT, D, H, F = 3, 6, 5, 8, 2, 12


def _tensor(x):
    return torch.tensor(x, dtype=torch.float64, requires_grad=True)


def _assert_close(ours, theirs, tol, what):
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else theirs
    rel = max_rel_diff(ours, theirs)
    assert rel < tol, f"{what}: relative difference {rel:.2e} >= {tol:.0e}"


def _torch_named_grads(module):
    return {name: p.grad for name, p in module.named_parameters()}


def _our_grads_as_torch(ours, cls):
    """attnkit gradients renamed and transposed like torch's parameters, through the bridge itself."""
    holder = cls.from_torch(ours._source)
    holder.load_state_dict(dict(ours.named_gradients()))
    return holder.to_torch_state_dict()


def _assert_param_grads(ours, torch_module, cls):
    theirs = _torch_named_grads(torch_module)
    mapped = _our_grads_as_torch(ours, cls)
    assert sorted(mapped) == sorted(theirs)
    for name, g in theirs.items():
        _assert_close(mapped[name].numpy(), g, GRAD_TOL, f"grad of {name}")


@pytest.mark.parametrize("kdim, vdim", [(None, None), (5, 7)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_parity(kdim, vdim, bias, batch_first):
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                    dtype=torch.float64)
    ours = MultiHeadAttention.from_torch(m)
    ours._source = m
    rng = make_rng(1, bias, batch_first, kdim or 0)
    q, k, v = randn(rng, B, LT, D), randn(rng, B, LS, kdim or D), randn(rng, B, LS, vdim or D)
    pad = np.arange(LS)[None, :] < np.array([[6], [4], [2]])  # (B, Ls), True = real token
    attn_mask = rng.random((LT, LS)) < 0.8
    attn_mask[:, 0] = True
    out, weights = ours(q, k, v, attn_mask=attn_mask, key_padding_mask=pad)
    tq, tk, tv = _tensor(q), _tensor(k), _tensor(v)
    args = (tq, tk, tv) if batch_first else tuple(t.transpose(0, 1) for t in (tq, tk, tv))
    t_out, t_weights = m(*args, key_padding_mask=torch.from_numpy(~pad), attn_mask=torch.from_numpy(~attn_mask),
                         average_attn_weights=False)
    if not batch_first:
        t_out = t_out.transpose(0, 1)
    _assert_close(out, t_out, FORWARD_TOL, "output")
    _assert_close(weights, t_weights, FORWARD_TOL, "weights")
    grad = randn(rng, *out.shape)
    grads = ours.backward(grad)
    t_out.backward(torch.from_numpy(grad))
    for name, g, t in zip(("query", "key", "value"), grads, (tq, tk, tv), strict=True):
        _assert_close(g, t.grad, GRAD_TOL, f"grad of {name}")
    _assert_param_grads(ours, m, MultiHeadAttention)


def test_multihead_attention_state_dict_round_trip():
    torch.manual_seed(1)
    for kwargs in ({}, {"kdim": 3, "vdim": 5, "bias": False}):
        m = torch.nn.MultiheadAttention(D, H, **kwargs, dtype=torch.float64)
        back = torch.nn.MultiheadAttention(D, H, **kwargs, dtype=torch.float64)
        back.load_state_dict(MultiHeadAttention.from_torch(m).to_torch_state_dict())
        for (name, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def _torch_transformer(norm_first, activation, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Transformer(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=F,
                                 dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first,
                                 dtype=torch.float64)
    with torch.no_grad():  # non-trivial norms, so a swapped gamma/beta cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_parity(norm_first, activation):
    model = _torch_transformer(norm_first, activation)
    ours = Transformer.from_torch(model)
    ours._source = model
    rng = make_rng(2, norm_first, len(activation))
    src, tgt = randn(rng, B, LS, D), randn(rng, B, LT, D)
    src_pad = np.arange(LS)[None, :] < np.array([[6], [3], [5]])  # (B, Ls), True = real token
    tgt_pad = np.arange(LT)[None, :] < np.array([[5], [5], [2]])  # (B, Lt)
    out = ours(src, tgt, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
               memory_key_padding_mask=src_pad, tgt_is_causal=True)
    t_src, t_tgt = _tensor(src), _tensor(tgt)
    causal = torch.triu(torch.ones(LT, LT, dtype=torch.bool), diagonal=1)  # torch: True = may NOT attend
    t_out = model(t_src, t_tgt, tgt_mask=causal, src_key_padding_mask=torch.from_numpy(~src_pad),
                  tgt_key_padding_mask=torch.from_numpy(~tgt_pad), memory_key_padding_mask=torch.from_numpy(~src_pad),
                  tgt_is_causal=True)
    _assert_close(out, t_out, FORWARD_TOL, "output")
    grad = randn(rng, *out.shape)
    grad_src, grad_tgt = ours.backward(grad)
    t_out.backward(torch.from_numpy(grad))
    _assert_close(grad_src, t_src.grad, GRAD_TOL, "grad of src")
    _assert_close(grad_tgt, t_tgt.grad, GRAD_TOL, "grad of tgt")
    _assert_param_grads(ours, model, Transformer)


def test_decoder_parity_batch_second():
    torch.manual_seed(3)
    layer = torch.nn.TransformerDecoderLayer(D, H, F, dropout=0.0, activation="gelu", dtype=torch.float64)
    dec = torch.nn.TransformerDecoder(layer, num_layers=2, norm=torch.nn.LayerNorm(D, dtype=torch.float64))
    ours = TransformerDecoder.from_torch(dec)
    rng = make_rng(3)
    tgt, memory = randn(rng, B, LT, D), randn(rng, B, LS, D)
    out = ours(tgt, memory, tgt_is_causal=True)
    causal = torch.triu(torch.ones(LT, LT, dtype=torch.bool), diagonal=1)
    t_out = dec(_tensor(tgt).transpose(0, 1), _tensor(memory).transpose(0, 1), tgt_mask=causal, tgt_is_causal=True)
    _assert_close(out, t_out.transpose(0, 1), FORWARD_TOL, "output")


@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_state_dict_round_trip(norm_first):
    model = _torch_transformer(norm_first, "gelu", seed=4)
    state = Transformer.from_torch(model).to_torch_state_dict()
    fresh = _torch_transformer(norm_first, "gelu", seed=5)
    fresh.load_state_dict(state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_attnkit_model_to_torch_and_back_is_exact():
    ours = Transformer(D, H, 1, 1, F, norm_first=False, attention_bias=True, eps=1e-5, rng=6)
    model = torch.nn.Transformer(d_model=D, nhead=H, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=F,
                                 dropout=0.0, batch_first=True, dtype=torch.float64)
    model.load_state_dict(ours.to_torch_state_dict())
    again = Transformer.from_torch(model)
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_block_round_trip_and_refusals():
    layer = torch.nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True, dtype=torch.float64)
    block = TransformerDecoderBlock.from_torch(layer)
    assert block.eps == 1e-5 and not block.norm_first
    state = block.to_torch_state_dict()
    assert sorted(state) == sorted(layer.state_dict())
    with pytest.raises(TypeError, match="torch.nn.TransformerDecoderLayer"):
        TransformerDecoderBlock.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(D, H, add_bias_kv=True))
    with pytest.raises(ValueError, match="bias=False"):
        TransformerDecoderBlock.from_torch(torch.nn.TransformerDecoderLayer(D, H, F, bias=False))
    with pytest.raises(ValueError, match="additive"):
        TransformerDecoderBlock(D, H, cross_attention="additive", rng=0).to_torch_state_dict()


def test_missing_torch_gives_a_clear_import_error(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(ImportError, match="pip install torch"):
        torch_nn.require_torch()


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_layer_and_stack_parity_batch_second(norm_first):
    from attnkit.layers import TransformerEncoder, TransformerEncoderBlock
    torch.manual_seed(6)
    layer = torch.nn.TransformerEncoderLayer(D, H, F, dropout=0.0, activation="gelu", norm_first=norm_first,
                                             dtype=torch.float64)
    stack = torch.nn.TransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(D, dtype=torch.float64),
                                        enable_nested_tensor=False)
    rng = make_rng(6, norm_first)
    x = randn(rng, B, LS, D)
    pad = np.arange(LS)[None, :] < np.array([[6], [4], [5]])
    for ours, theirs in ((TransformerEncoderBlock.from_torch(layer), layer),
                         (TransformerEncoder.from_torch(stack), stack)):
        out = ours(x, key_padding_mask=pad)
        tx = _tensor(x)
        t_out = theirs(tx.transpose(0, 1), src_key_padding_mask=torch.from_numpy(~pad)).transpose(0, 1)
        _assert_close(out, t_out, FORWARD_TOL, f"{type(theirs).__name__} output")
        grad = randn(rng, *out.shape)
        t_out.backward(torch.from_numpy(grad))
        _assert_close(ours.backward(grad), tx.grad, GRAD_TOL, f"{type(theirs).__name__} grad of x")
        state = ours.to_torch_state_dict()
        assert sorted(state) == sorted(theirs.state_dict())
        for name, value in theirs.state_dict().items():
            assert torch.equal(state[name], value), name


# -- one pair of entry points: from_torch / to_torch ------------------------------------------------------
def _round_trip_modules():
    return [
        MultiHeadAttention(D, H, bias=True, rng=1),
        MultiHeadAttention(D, H, kdim=5, vdim=7, rng=2),
        TransformerEncoderBlock(D, H, F, norm_first=False, activation="gelu", attention_bias=True, rng=3),
        TransformerEncoderBlock(D, H, F, activation="gelu_tanh", rng=4),  # no attention bias: torch gets zeros
        TransformerEncoder(2, D, H, F, attention_bias=True, rng=5),
        TransformerDecoderBlock(D, H, F, attention_bias=True, rng=6),
        TransformerDecoder(2, D, H, F, norm_first=False, attention_bias=True, rng=7),
        Transformer(D, H, 2, 1, F, attention_bias=True, rng=8),
    ]


def _run_both(ours, theirs, rng):
    """Forward of an attnkit module and of its torch.nn counterpart (eval mode) on the same inputs."""
    src, tgt = randn(rng, B, LS, D), randn(rng, B, LT, D)
    # Gradients stay enabled: torch's inference fast path for encoder layers runs exact GELU even when the
    # layer was built with the tanh approximation, which is not the computation the module describes.
    theirs.eval()
    if isinstance(ours, MultiHeadAttention):
        args = (tgt, randn(rng, B, LS, ours.kdim), randn(rng, B, LS, ours.vdim))
        return ours(*args)[0], theirs(*map(torch.from_numpy, args), need_weights=False)[0].detach().numpy()
    if isinstance(ours, Transformer):
        args = (src, tgt)
    elif isinstance(ours, (TransformerDecoderBlock, TransformerDecoder)):
        args = (tgt, src)
    else:
        args = (src,)
    mine = ours(*args)
    return (mine[0] if isinstance(mine, tuple) else mine), theirs(*map(torch.from_numpy, args)).detach().numpy()


@pytest.mark.parametrize("index", range(8))
def test_to_torch_builds_the_same_computation_and_from_torch_inverts_it(index):
    ours = _round_trip_modules()[index]
    theirs = interop.to_torch(ours)
    assert type(theirs).__module__.startswith("torch.nn")
    assert next(theirs.parameters()).dtype == torch.float64
    mine, other = _run_both(ours, theirs, make_rng(20, index))
    _assert_close(mine, other, FORWARD_TOL, type(ours).__name__)
    back = interop.from_torch(theirs)
    assert type(back) is type(ours)
    again, _ = _run_both(back, theirs, make_rng(20, index))
    _assert_close(again, mine, FORWARD_TOL, f"{type(ours).__name__} after the round trip")


def test_entry_points_refuse_what_has_no_counterpart():
    with pytest.raises(TypeError, match=r"module must be one of torch\.nn\.MultiheadAttention.*got torch.*Linear"):
        interop.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="LayerNorm has no torch.nn counterpart registered"):
        interop.to_torch(LayerNorm(4))
    assert set(torch_converters()) == {MultiHeadAttention, TransformerEncoderBlock, TransformerEncoder,
                                       TransformerDecoderBlock, TransformerDecoder, Transformer}
