"""Optimizers and gradient clipping against torch.optim / torch.nn.utils.clip_grad_norm_.

The same gradients are fed to both sides for several steps and the parameter trajectories compared after
every step (float64, relative 1e-12). Also: in-place updates of the module's own arrays, state_dict
round trips that continue the trajectory exactly, and argument errors.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

import torch
from attnkit.layers import LayerNorm, Projection, TransformerEncoder
from attnkit.optim import SGD, Adam, AdamW, clip_grad_norm

from helpers import make_rng, randn

STEPS = 6


def twin(seed=0):
    """A small module with two parameter tensors and torch leaf tensors holding the same values."""
    proj = Projection(4, 3, rng=seed)
    proj.b = randn(make_rng(seed), 3)
    params = {name: torch.tensor(p.copy(), requires_grad=True) for name, p in proj.named_parameters()}
    return proj, params


OPTIMIZERS = {
    "sgd": (lambda m: SGD(m, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_momentum": (lambda m: SGD(m, lr=0.05, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "sgd_nesterov_wd": (lambda m: SGD(m, lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True),
                        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True)),
    "adam": (lambda m: Adam(m, lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "adam_l2": (lambda m: Adam(m, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                lambda ps: torch.optim.Adam(ps, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (lambda m: AdamW(m, lr=0.01), lambda ps: torch.optim.AdamW(ps, lr=0.01)),
    "adamw_strong": (lambda m: AdamW(m, lr=0.05, betas=(0.5, 0.9), weight_decay=0.5),
                     lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.5, 0.9), weight_decay=0.5)),
}


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_trajectory_matches_torch(kind):
    ours_make, torch_make = OPTIMIZERS[kind]
    proj, params = twin()
    opt, t_opt = ours_make(proj), torch_make(list(params.values()))
    storage = {name: p for name, p in proj.named_parameters()}
    rng = make_rng(1)
    for step in range(STEPS):
        grads = {name: randn(rng, *p.shape) for name, p in storage.items()}
        opt.zero_grad()
        for name, g in grads.items():
            proj.grads[name] += g
            params[name].grad = torch.tensor(g)
        opt.step()
        t_opt.step()
        for name, p in proj.named_parameters():
            assert p is storage[name]  # updated in place: the module still owns the same arrays
            err = rel(p, params[name].detach().numpy())
            assert err < 1e-12, f"{kind} step {step} {name}: {err:.2e}"
    assert opt.step_count == STEPS


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam_l2", "adamw"])
def test_state_dict_round_trip_continues_the_trajectory(kind):
    make = OPTIMIZERS[kind][0]
    a, _ = twin()
    opt_a = make(a)
    rng = make_rng(2)
    grads = [{n: randn(rng, *p.shape) for n, p in a.named_parameters()} for _ in range(5)]

    def step(module, opt, g):
        module.zero_grad()
        for n, value in g.items():
            module.grads[n] += value
        opt.step()

    for g in grads[:3]:
        step(a, opt_a, g)
    b = copy.deepcopy(a)
    opt_b = make(b)
    saved = opt_a.state_dict()
    opt_b.load_state_dict(saved)
    for g in grads[3:]:
        step(a, opt_a, g)
        step(b, opt_b, g)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert np.array_equal(pa, pb), n
    # state_dict returns copies: stepping did not change what was saved
    assert saved["step_count"] == 3


def test_optimizer_state_dict_errors():
    proj, _ = twin()
    opt = Adam(proj)
    state = opt.state_dict()
    with pytest.raises(KeyError, match="unknown"):
        bad = copy.deepcopy(state)
        bad["state"]["extra.W"] = bad["state"]["W"]
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="shape"):
        bad = copy.deepcopy(state)
        bad["state"]["W"]["exp_avg"] = np.zeros((2, 2))
        opt.load_state_dict(bad)
    with pytest.raises(KeyError, match="keys"):
        opt.load_state_dict({"state": {}})
    with pytest.raises(KeyError, match="hyperparameters"):
        bad = copy.deepcopy(state)
        bad["hyperparameters"]["momentum"] = 0.9
        opt.load_state_dict(bad)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
def test_clip_grad_norm_matches_torch(max_norm):
    enc = TransformerEncoder(1, 4, 2, rng=0)
    rng = make_rng(3)
    tensors = []
    for _, g in enc.named_gradients():
        g += randn(rng, *g.shape, scale=0.3)
        t = torch.zeros(g.shape, dtype=torch.float64, requires_grad=True)
        t.grad = torch.tensor(g.copy())
        tensors.append(t)
    total = clip_grad_norm(enc, max_norm)
    t_total = torch.nn.utils.clip_grad_norm_(tensors, max_norm)
    assert isinstance(total, float)
    assert abs(total - float(t_total)) < 1e-12 * float(t_total)
    for (name, g), t in zip(enc.named_gradients(), tensors, strict=True):
        assert rel(g, t.grad.numpy()) < 1e-12, name
    clipped = np.sqrt(sum(np.sum(g * g) for _, g in enc.named_gradients()))
    assert clipped <= max_norm * (1 + 1e-9)


def test_optimizers_work_after_astype_float32():
    ln = LayerNorm(3)
    opt = Adam(ln, lr=0.1)
    ln.astype(np.float32)
    ln.grads["gamma"][:] = 1.0
    opt.step()
    assert ln.gamma.dtype == np.float32 and np.all(ln.gamma < 1.0)


@pytest.mark.parametrize("make,match", [
    (lambda m: SGD(m, lr=-1.0), "lr"),
    (lambda m: SGD(m, lr=0.1, nesterov=True), "nesterov"),
    (lambda m: Adam(m, betas=(0.9, 1.0)), r"betas\[1\]"),
    (lambda m: Adam(m, betas=0.9), "betas"),
    (lambda m: AdamW(m, weight_decay=float("nan")), "weight_decay"),
    (lambda m: Adam(m, eps=-1e-8), "eps"),
])
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(Projection(2, 2, rng=0))


def test_optimizer_needs_a_module():
    with pytest.raises(TypeError, match="Module"):
        SGD([np.zeros(3)], lr=0.1)
    with pytest.raises(TypeError, match="Module"):
        clip_grad_norm({"W": np.zeros(3)}, 1.0)
    with pytest.raises(TypeError, match="lr"):
        SGD(Projection(2, 2, rng=0), lr="0.1")
