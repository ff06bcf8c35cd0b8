"""Optimizer hyperparameters and state are checked where they enter: constructors, load_state_dict, load.

Every refused state leaves the optimizer exactly as it was (all or nothing); a saved file restores a state
that continues the trajectory bit for bit; a file's entries are checked from its headers before any array
is read.
"""
from __future__ import annotations

import copy
import math
import tracemalloc

import numpy as np
import pytest

from attnkit.io import save_arrays
from attnkit.layers import Projection
from attnkit.optim import SGD, Adam, AdamW, clip_grad_norm

from helpers import make_rng, randn

NAN, INF = float("nan"), float("inf")


def stepped(make, steps=3, seed=0):
    """A projection and its optimizer after a few steps on random gradients (non-trivial state)."""
    proj = Projection(4, 3, rng=seed)
    opt = make(proj)
    rng = make_rng(seed, 7)
    for _ in range(steps):
        proj.zero_grad()
        for g in proj.grads.values():
            g += randn(rng, *g.shape)
        opt.step()
    return proj, opt


def snapshot(opt) -> dict:
    return copy.deepcopy({"repr": repr(opt), "slots": opt.slot_names, **opt.state_dict()})


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        if isinstance(a[key], dict):
            if not same(a[key], b[key]):
                return False
        elif isinstance(a[key], np.ndarray):
            if not (a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key])):
                return False
        elif a[key] != b[key]:
            return False
    return True


# -- constructors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, error, name", [
    (lambda m: SGD(m, lr=NAN), ValueError, "lr"),
    (lambda m: SGD(m, lr=INF), ValueError, "lr"),
    (lambda m: SGD(m, lr=-0.1), ValueError, "lr"),
    (lambda m: SGD(m, lr=0.1, momentum=1.0), ValueError, "momentum"),
    (lambda m: SGD(m, lr=0.1, momentum=-0.5), ValueError, "momentum"),
    (lambda m: SGD(m, lr=0.1, momentum=NAN), ValueError, "momentum"),
    (lambda m: SGD(m, lr=0.1, weight_decay=-1.0), ValueError, "weight_decay"),
    (lambda m: SGD(m, lr=0.1, momentum=0.5, nesterov="yes"), TypeError, "nesterov"),
    (lambda m: SGD(m, lr=True), TypeError, "lr"),
    (lambda m: Adam(m, lr=NAN), ValueError, "lr"),
    (lambda m: Adam(m, lr=-INF), ValueError, "lr"),
    (lambda m: Adam(m, eps=0.0), ValueError, "eps"),
    (lambda m: Adam(m, eps=-1e-8), ValueError, "eps"),
    (lambda m: Adam(m, eps=NAN), ValueError, "eps"),
    (lambda m: Adam(m, betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
    (lambda m: Adam(m, betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (lambda m: Adam(m, betas=(0.9, NAN)), ValueError, r"betas\[1\]"),
    (lambda m: Adam(m, betas=(0.9, 0.99, 0.9)), ValueError, "betas"),
    (lambda m: Adam(m, weight_decay=INF), ValueError, "weight_decay"),
    (lambda m: AdamW(m, eps=0.0), ValueError, "eps"),
    (lambda m: AdamW(m, lr=NAN), ValueError, "lr"),
    (lambda m: AdamW(m, weight_decay=-0.01), ValueError, "weight_decay"),
])
def test_constructors_refuse_degenerate_hyperparameters_naming_them(make, error, name):
    with pytest.raises(error, match=rf"^{name}"):
        make(Projection(2, 2, rng=0))


def test_boundary_values_are_accepted():
    proj = Projection(2, 2, rng=0)
    SGD(proj, lr=0.0, momentum=0.0)
    SGD(proj, lr=0.1, momentum=0.999999, nesterov=True)
    Adam(proj, lr=0.0, betas=(0.0, 0.0), eps=1e-300, weight_decay=0.0)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, NAN, INF])
def test_clip_grad_norm_refuses_a_degenerate_max_norm(max_norm):
    with pytest.raises(ValueError, match="^max_norm"):
        clip_grad_norm(Projection(2, 2, rng=0), max_norm)


# -- load_state_dict ----------------------------------------------------------------------------------------
def set_hyper(name, value):
    def edit(state):
        state["hyperparameters"][name] = value
    return edit


def set_buffer(param, slot, value):
    def edit(state):
        state["state"][param][slot] = value
    return edit


def set_key(key, value):
    def edit(state):
        state[key] = value
    return edit


ADAM_BAD_STATES = {
    "lr_nan": (set_hyper("lr", NAN), ValueError, "^lr"),
    "lr_negative": (set_hyper("lr", -1e-3), ValueError, "^lr"),
    "lr_string": (set_hyper("lr", "0.1"), TypeError, "^lr"),
    "eps_zero": (set_hyper("eps", 0.0), ValueError, "^eps"),
    "eps_inf": (set_hyper("eps", INF), ValueError, "^eps"),
    "beta1_one": (set_hyper("betas", (1.0, 0.999)), ValueError, r"^betas\[0\]"),
    "beta2_negative": (set_hyper("betas", (0.9, -0.5)), ValueError, r"^betas\[1\]"),
    "betas_scalar": (set_hyper("betas", 0.9), ValueError, "^betas"),
    "weight_decay_negative": (set_hyper("weight_decay", -1.0), ValueError, "^weight_decay"),
    "unknown_hyperparameter": (set_hyper("momentum", 0.9), KeyError, "hyperparameters of Adam"),
    "step_negative": (set_key("step_count", -1), ValueError, "^step_count"),
    "step_float": (set_key("step_count", 2.5), TypeError, "^step_count"),
    "step_bool": (set_key("step_count", True), TypeError, "^step_count"),
    "step_string": (set_key("step_count", "3"), TypeError, "^step_count"),
    # the last parameter's buffer is bad: everything before it passed, and still nothing may change
    "buffer_shape": (set_buffer("b", "exp_avg_sq", np.zeros(4)), ValueError, "'exp_avg_sq' of 'b' has shape"),
    "buffer_integer": (set_buffer("b", "exp_avg_sq", np.zeros(3, dtype=np.int64)), TypeError, "'exp_avg_sq' of 'b'"),
    "buffer_strings": (set_buffer("b", "exp_avg", np.array(["a", "b", "c"])), TypeError, "'exp_avg' of 'b'"),
    # a mean of squares that is negative or not finite turns the parameters into NaN at the next step
    "second_moment_negative": (set_buffer("b", "exp_avg_sq", np.array([0.1, -1e-12, 0.2])), ValueError,
                               "'exp_avg_sq' of 'b' must be finite and non-negative.*such as -1e-12"),
    "second_moment_nan": (set_buffer("b", "exp_avg_sq", np.array([0.1, NAN, 0.2])), ValueError,
                          "'exp_avg_sq' of 'b' must be finite and non-negative"),
    "second_moment_inf": (set_buffer("b", "exp_avg_sq", np.array([INF, 0.0, 0.2])), ValueError,
                          "'exp_avg_sq' of 'b' must be finite and non-negative"),
}


@pytest.mark.parametrize("case", list(ADAM_BAD_STATES))
def test_load_state_dict_refuses_bad_states_and_changes_nothing(case):
    edit, error, match = ADAM_BAD_STATES[case]
    _, source = stepped(lambda m: Adam(m, lr=0.02, betas=(0.8, 0.9), eps=1e-6), steps=4, seed=1)
    _, target = stepped(lambda m: Adam(m, lr=0.01), steps=2, seed=2)
    state = source.state_dict()
    edit(state)
    before = snapshot(target)
    with pytest.raises(error, match=match):
        target.load_state_dict(state)
    assert same(snapshot(target), before)


@pytest.mark.parametrize("edit, match", [
    (lambda s: s["state"].pop("b"), r"missing \['b'\]"),
    (lambda s: s["state"].update({"c": {"exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)}}), r"unknown \['c'\]"),
    (lambda s: s["state"]["b"].pop("exp_avg"), r"state of 'b' must have buffers \['exp_avg', 'exp_avg_sq'\]"),
    (lambda s: s.pop("step_count"), "must have keys"),
])
def test_load_state_dict_refuses_missing_and_unknown_names(edit, match):
    _, opt = stepped(Adam)
    state = opt.state_dict()
    edit(state)
    before = snapshot(opt)
    with pytest.raises(KeyError, match=match):
        opt.load_state_dict(state)
    assert same(snapshot(opt), before)


def test_load_state_dict_refuses_what_is_not_a_state_dict():
    opt = Adam(Projection(2, 2, rng=0))
    with pytest.raises(TypeError, match="must be a mapping"):
        opt.load_state_dict([("step_count", 0)])
    with pytest.raises(TypeError, match="must be mappings"):
        opt.load_state_dict({"step_count": 0, "hyperparameters": [], "state": {}})


def test_sgd_state_with_other_momentum_restores_its_buffers():
    # the buffers kept follow the loaded hyperparameters: plain SGD can take a momentum SGD's state and back
    proj, momentum = stepped(lambda m: SGD(m, lr=0.1, momentum=0.9))
    plain = SGD(Projection(4, 3, rng=0), lr=0.1)
    plain.load_state_dict(momentum.state_dict())
    assert plain.momentum == 0.9 and plain.slot_names == ("momentum_buffer",)
    assert np.array_equal(plain.state["W"]["momentum_buffer"], momentum.state["W"]["momentum_buffer"])
    plain.load_state_dict(SGD(proj, lr=0.3).state_dict())
    assert plain.momentum == 0.0 and plain.slot_names == () and plain.state["W"] == {}
    with pytest.raises(ValueError, match="nesterov=True requires momentum > 0"):
        state = SGD(proj, lr=0.3).state_dict()
        state["hyperparameters"]["nesterov"] = True
        plain.load_state_dict(state)


# -- save / load --------------------------------------------------------------------------------------------
MAKERS = {
    "sgd_momentum": lambda m: SGD(m, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_plain": lambda m: SGD(m, lr=0.05),
    "adam": lambda m: Adam(m, lr=0.01, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1),
    "adamw": lambda m: AdamW(m, lr=0.01),
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_save_and_load_continue_the_trajectory_bit_for_bit(tmp_path, kind):
    make = MAKERS[kind]
    proj_a, opt_a = stepped(make, steps=3)
    path = tmp_path / "opt.npz"
    opt_a.save(path)
    proj_b = copy.deepcopy(proj_a)
    opt_b = make(proj_b)
    opt_b.lr = 123.0  # overwritten by load
    opt_b.load(path)
    assert same(snapshot(opt_b), snapshot(opt_a))
    rng = make_rng(5)
    for _ in range(3):
        grads = {n: randn(rng, *p.shape) for n, p in proj_a.named_parameters()}
        for proj, opt in ((proj_a, opt_a), (proj_b, opt_b)):
            proj.zero_grad()
            for n, g in grads.items():
                proj.grads[n] += g
            opt.step()
    for (n, pa), (_, pb) in zip(proj_a.named_parameters(), proj_b.named_parameters(), strict=True):
        assert np.array_equal(pa, pb), n


def saved_adam_entries(step_count=3):
    _, opt = stepped(Adam, steps=step_count)
    entries = {"step_count": np.asarray(opt.step_count)}
    entries.update({f"hyperparameters/{n}": np.asarray(getattr(opt, n), dtype=float) for n in opt.hyperparameter_names})
    entries.update({f"state/{p}/{s}": b for p, slots in opt.state.items() for s, b in slots.items()})
    return entries


@pytest.mark.parametrize("edit, error, match", [
    (lambda e: e.update({"hyperparameters/lr": np.asarray(NAN)}), ValueError, "^lr must be a finite"),
    (lambda e: e.update({"hyperparameters/eps": np.asarray(0.0)}), ValueError, "^eps"),
    (lambda e: e.update({"hyperparameters/betas": np.asarray([0.9, 1.5])}), ValueError, r"^betas\[1\]"),
    (lambda e: e.update({"step_count": np.asarray(-2)}), ValueError, "^step_count"),
    (lambda e: e.update({"step_count": np.asarray(2.0)}), TypeError, "entry 'step_count' has dtype float64"),
    (lambda e: e.update({"hyperparameters/betas": np.asarray(0.9)}), ValueError,
     r"entry 'hyperparameters/betas' has shape \(\), expected \(2,\)"),
    (lambda e: e.update({"state/W/exp_avg": np.zeros((3, 4))}), ValueError,
     r"entry 'state/W/exp_avg' has shape \(3, 4\), expected \(4, 3\)"),
    (lambda e: e.update({"state/W/exp_avg": np.zeros((4, 3), dtype=np.int32)}), TypeError, "state/W/exp_avg"),
    (lambda e: e.update({"state/W/momentum_buffer": np.zeros((4, 3))}), KeyError, "state/W/momentum_buffer"),
    (lambda e: e.update({"state/extra.W/exp_avg": np.zeros((4, 3))}), KeyError, "state/extra.W/exp_avg"),
    (lambda e: e.pop("state/b/exp_avg_sq"), KeyError, "state of 'b' must have buffers"),
    (lambda e: e.pop("hyperparameters/eps"), KeyError, "hyperparameters of Adam"),
    (lambda e: e.update({"state/W/exp_avg_sq": -np.ones((4, 3))}), ValueError, "'exp_avg_sq' of 'W' must be finite"),
])
def test_load_refuses_bad_files_and_changes_nothing(tmp_path, edit, error, match):
    entries = saved_adam_entries()
    edit(entries)
    path = tmp_path / "bad.npz"
    save_arrays(path, entries)
    _, opt = stepped(Adam, steps=1, seed=4)
    before = snapshot(opt)
    with pytest.raises(error, match=match):
        opt.load(path)
    assert same(snapshot(opt), before)


def test_load_checks_a_huge_buffer_from_its_header_before_reading_it(tmp_path):
    entries = saved_adam_entries()
    entries["state/W/exp_avg"] = np.zeros((2000, 2000))  # 32 MB of zeros
    path = tmp_path / "huge.npz"
    np.savez_compressed(path, **entries)  # a few tens of kB on disk
    opt = Adam(Projection(4, 3, rng=0))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"'state/W/exp_avg' has shape \(2000, 2000\)"):
            opt.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak


def test_the_saved_file_holds_named_plain_arrays(tmp_path):
    _, opt = stepped(lambda m: SGD(m, lr=0.1, momentum=0.5, nesterov=True))
    path = tmp_path / "sgd.npz"
    opt.save(path)
    with np.load(path, allow_pickle=False) as archive:
        assert sorted(archive.files) == ["hyperparameters/lr", "hyperparameters/momentum", "hyperparameters/nesterov",
                                         "hyperparameters/weight_decay", "state/W/momentum_buffer",
                                         "state/b/momentum_buffer", "step_count"]
        assert archive["step_count"].dtype == np.int64 and int(archive["step_count"]) == 3
        assert archive["hyperparameters/nesterov"].dtype == bool and bool(archive["hyperparameters/nesterov"])
        assert math.isclose(float(archive["hyperparameters/momentum"]), 0.5)
