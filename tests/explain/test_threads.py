"""Hooks and ``input_gradients_only`` are the model's, not the thread's: while one thread has them in effect, another
thread that runs the same model (forward, ``generate``, backward, its own hooks) gets a RuntimeError naming the
holder, never hooked values; once the block ends the model is everyone's again. Real threads throughout."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from attnkit.explain import hooks, run_with_cache
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

pytestmark = pytest.mark.concurrency

IDS = np.array([[3, 14, 15, 9, 26, 5]])


def _lm():
    cfg = DecoderConfig(family="llama", vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=4, mlp=MLPConfig(32))
    return CausalLM(cfg, rng=0).astype(np.float64)


def _steer(x, name):
    return x + 3.0  # moves every logit: a generation that saw it would differ


def _generate(lm):
    return lm.generate(IDS, max_new_tokens=4, do_sample=False)


def _in_thread(name, inside, release, errors):
    """A thread that enters ``inside()`` (a context manager), signals, waits for ``release``, then leaves."""
    entered = threading.Event()

    def body():
        try:
            with inside():
                entered.set()
                release.wait(30)
        except BaseException as exc:  # reported to the test, not lost in the thread
            errors.append(exc)
            entered.set()

    thread = threading.Thread(target=body, name=name)
    thread.start()
    assert entered.wait(30)
    return thread


def test_another_threads_generate_is_refused_while_hooks_are_installed():
    lm = _lm()
    plain = _generate(lm)
    with hooks(lm, {"blocks.0.hook_resid_pre": _steer}):
        steered = _generate(lm)
    assert not np.array_equal(steered, plain)
    release, errors = threading.Event(), []
    thread = _in_thread("explainer", lambda: hooks(lm, {"blocks.0.hook_resid_pre": _steer}), release, errors)
    try:
        refused = "CausalLM is held by thread 'explainer' for attnkit.explain.hooks"
        with pytest.raises(RuntimeError, match=refused):
            _generate(lm)
        with pytest.raises(RuntimeError, match=refused):
            lm(IDS)
        with pytest.raises(RuntimeError, match="held by thread 'explainer'"):  # a second thread's own hooks
            with hooks(lm, {"blocks.1.hook_resid_pre": _steer}):
                pass
    finally:
        release.set()
        thread.join(30)
    assert not errors
    np.testing.assert_array_equal(_generate(lm), plain)  # the model is everyone's again, and unhooked


def test_another_threads_backward_is_refused_inside_input_gradients_only():
    lm = _lm()
    grad_logits = np.zeros((1, IDS.shape[1], 50))
    grad_logits[0, -1, 7] = 1.0
    lm(IDS)
    want = lm.backward(grad_logits)
    lm.zero_grad()
    lm(IDS)  # this thread's forward, whose backward the other thread's block must not skip parts of
    release, errors = threading.Event(), []
    thread = _in_thread("attributor", lm.input_gradients_only, release, errors)
    try:
        refused = "held by thread 'attributor' for Module.input_gradients_only"
        with pytest.raises(RuntimeError, match=refused):
            lm.backward(grad_logits)
        with pytest.raises(RuntimeError, match=refused):
            _generate(lm)
        with pytest.raises(RuntimeError, match=refused):
            with lm.input_gradients_only():
                pass
    finally:
        release.set()
        thread.join(30)
    assert not errors
    lm(IDS)
    np.testing.assert_allclose(lm.backward(grad_logits), want, rtol=0, atol=0)
    assert np.abs(lm.embed.grads["weight"]).max() > 0  # the weights' gradients were formed: no switch left on


def test_a_generate_racing_hook_blocks_never_sees_the_hooks():
    """One thread generates over and over while another enters and leaves hook blocks: every generation is the
    unhooked one or a RuntimeError, and every hooked run of the other thread is the hooked one."""
    lm = _lm()
    plain = _generate(lm)
    with hooks(lm, {"blocks.0.hook_resid_pre": _steer}):
        hooked, _ = run_with_cache(lm, IDS, names=["blocks.1.attn.hook_z"])
    outcomes, seen, errors = [], [], []
    stop = threading.Event()

    def generating():
        try:
            while not stop.is_set():
                try:
                    outcomes.append(np.array_equal(_generate(lm), plain))
                except RuntimeError as exc:
                    assert "held by thread 'explainer'" in str(exc)
                    outcomes.append("refused")
        except BaseException as exc:
            errors.append(exc)

    def explaining():
        try:
            for _ in range(40):
                with hooks(lm, {"blocks.0.hook_resid_pre": _steer}):
                    logits, _ = run_with_cache(lm, IDS, names=["blocks.1.attn.hook_z"])
                    seen.append(np.array_equal(logits, hooked))
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the blocks begin and end inside generations
    try:
        generator = threading.Thread(target=generating, name="generator")
        explainer = threading.Thread(target=explaining, name="explainer")
        generator.start()
        explainer.start()
        explainer.join(120)
        stop.set()
        generator.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(seen) == 40 and all(seen)
    assert outcomes and all(outcome in (True, "refused") for outcome in outcomes), outcomes
