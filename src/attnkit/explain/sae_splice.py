"""SAEs and transcoders spliced into a model at hook points: their features cached, ablated or steered by hooks,
and attributed with the exact gradient (SAELens's ``HookedSAETransformer`` methods, by its names).

With the error term the model's value is kept whole: what the spliced point passes on is
``recons(acts) + (x - recons(clean acts))``, the error computed from the features before any feature hook ran, so
without hooks the model's outputs are unchanged (to rounding) and with them only the hooks' edits reach the
model. As in SAELens, the error is a constant for the backward (it is computed under ``no_grad`` there): the
gradient reaches the point's input through the encoder only.

Hook names are SAELens's, which are TransformerLens's and so attnkit's (``blocks.{i}.hook_resid_post``,
``blocks.{i}.hook_mlp_out``, ``blocks.{i}.attn.hook_z`` flattened to (B, L, H*Dh), ``ln_final.hook_normalized``,
...); points attnkit does not have (``blocks.{i}.ln2.hook_normalized``, ``blocks.{i}.hook_mlp_in``,
``blocks.{i}.mlp.hook_post``) are refused by name. A spliced SAE's own points are named after the point it writes,
as in SAELens's cache: ``{hook}.hook_sae_input``, ``.hook_sae_acts_pre``, ``.hook_sae_acts_post`` (the features),
``.hook_sae_recons``, ``.hook_sae_error`` (with the error term) and ``.hook_sae_output``.

Shapes: B batch, L tokens, D the hooked activation's width (``d_in``; ``d_out`` for a transcoder's output),
S features (``d_sae``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._inputs import as_id_batch, check_position
from .cache import ActivationCache
from .hooks import _check_hooks, absent_point_error, hook_names, hooks
from .sae import SAE

__all__ = ["FeatureAttribution", "feature_attribution", "run_with_cache_with_saes", "saes"]

SAE_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
              "hook_sae_output")
_HOOKABLE = {"forward": ("hook_sae_acts_pre", "hook_sae_acts_post"), "backward": ("hook_sae_acts_post",)}
# TransformerLens points that attnkit's models do not have, and what to hook instead.
_NOT_IN_ATTNKIT = {
    "ln2.hook_normalized": "the MLP's normed input (hook blocks.{i}.hook_resid_mid, the stream it normalises)",
    "ln1.hook_normalized": "the attention's normed input (hook blocks.{i}.hook_resid_pre)",
    "hook_mlp_in": "the MLP's input (blocks.{i}.hook_resid_mid is the same stream in a sequential block)",
    "hook_attn_in": "the attention's input (blocks.{i}.hook_resid_pre is the same stream)",
    "mlp.hook_pre": "the MLP's hidden pre-activation", "mlp.hook_post": "the MLP's hidden activation",
}


def _check_point(model: Any, name: str, table: list[str], what: str) -> None:
    if name in table:
        return
    local = name.split(".", 2)[2] if name.startswith("blocks.") and name.count(".") >= 2 else name
    if local in _NOT_IN_ATTNKIT:
        raise ValueError(f"{what}: attnkit's models have no hook point {name!r}, {_NOT_IN_ATTNKIT[local]}")
    raise absent_point_error(model, name, what)


class _Splice:
    """One SAE in a model: the forward hook at the point it writes (and, for a transcoder, the one that keeps its
    input), the backward hooks that carry the gradient through it, and what the last forward kept."""

    def __init__(self, model: Any, sae: SAE, use_error_term: bool, user_forward: dict, user_backward: dict,
                 keep: dict | None) -> None:
        table = hook_names(model)
        _check_point(model, sae.hook_name, table, f"the SAE's hook_name ({sae!r})")
        _check_point(model, sae.output_hook_name, table, f"the transcoder's hook_name_out ({sae!r})")
        if table.index(sae.output_hook_name) < table.index(sae.hook_name):
            raise ValueError(f"{sae!r} writes {sae.output_hook_name}, which the forward reaches before "
                             f"{sae.hook_name}, the point it reads")
        self.sae, self.use_error_term, self.keep = sae, use_error_term, keep
        self.prefix = sae.output_hook_name
        self.user_forward = {p: user_forward.pop(f"{self.prefix}.{p}") for p in _HOOKABLE["forward"]
                             if f"{self.prefix}.{p}" in user_forward}
        self.user_backward = {p: user_backward.pop(f"{self.prefix}.{p}") for p in _HOOKABLE["backward"]
                              if f"{self.prefix}.{p}" in user_backward}
        self.captured: np.ndarray | None = None
        self.saved: tuple | None = None  # what the backward needs: (open, pre replaced, acts replaced, input shape)
        self.acts: np.ndarray | None = None  # the last forward's features (B, L, S), after the feature hooks
        self.error: np.ndarray | None = None  # and its error term (B, L, D_out), or None without one
        self.input_grad: np.ndarray | None = None
        self.feature_grad: np.ndarray | None = None
        self.output_grad: np.ndarray | None = None
        self.recons_grad: np.ndarray | None = None
        self.forward_hook = _passing(self.splice) if not sae.is_transcoder else self.splice

    def _user(self, point: str, value: np.ndarray, direction: str) -> tuple[np.ndarray, bool]:
        fn = (self.user_forward if direction == "forward" else self.user_backward).get(point)
        if fn is None:
            return value, False
        seen = value.view()
        seen.flags.writeable = False
        out = fn(seen, f"{self.prefix}.{point}")
        if out is None or out is seen:
            return value, False
        out = np.asarray(out)
        if out.shape != value.shape or out.dtype.kind not in "fiu":
            raise ValueError(f"the hook at {self.prefix}.{point} returned {out.dtype} {out.shape}, expected numbers "
                             f"of shape {value.shape}")
        return out.astype(value.dtype, copy=False), True

    def capture(self, value: np.ndarray, name: str) -> None:
        """The transcoder's input, kept until the forward reaches the point it writes."""
        self.captured = np.array(value)

    def splice(self, value: np.ndarray, name: str) -> np.ndarray:
        """The SAE's output in place of ``value`` (B, L, ...)."""
        sae = self.sae
        source = value if not sae.is_transcoder else self.captured
        if source is None:
            raise RuntimeError(f"{sae!r}: the forward reached {name} without passing {sae.hook_name}")
        self.captured = None
        x = source.reshape(source.shape[:2] + (-1,))  # (B, L, D): attn.hook_z flattened to H*Dh
        if x.shape[-1] != sae.d_in:
            raise ValueError(f"{sae!r} reads {sae.d_in} features, but {sae.hook_name} has {x.shape[-1]} "
                             f"(shape {source.shape})")
        if value.reshape(value.shape[:2] + (-1,)).shape[-1] != sae.d_out:
            raise ValueError(f"{sae!r} writes {sae.d_out} features, but {name} has shape {value.shape}")
        x = x.astype(value.dtype, copy=False)
        xn, scale, shift = sae.normalize(x)  # (B, L, D); (B, L, 1) each or None

        def restored(recons: np.ndarray) -> np.ndarray:
            return recons if scale is None else recons * scale + shift  # (B, L, D_out)

        clean_pre = sae._pre(xn)  # (B, L, S)
        pre, pre_cut = self._user("hook_sae_acts_pre", clean_pre, "forward")
        opened = sae._open(pre)  # (B, L, S)
        acts, acts_cut = self._user("hook_sae_acts_post", pre * opened, "forward")
        recons = sae.decode(acts)  # (B, L, D_out)
        out = restored(recons)
        error = None
        if self.use_error_term:
            clean = out if not (pre_cut or acts_cut) else restored(sae.decode(sae.activate(clean_pre)))
            error = value.reshape(recons.shape) - clean  # (B, L, D_out)
            out = out + error
        self.saved = (opened, pre_cut, acts_cut, source.shape, x, scale, shift, recons)
        self.acts, self.error = acts, error
        if self.keep is not None:
            found = {"hook_sae_input": x, "hook_sae_acts_pre": pre, "hook_sae_acts_post": acts,
                     "hook_sae_recons": recons, "hook_sae_error": error, "hook_sae_output": out}
            for point, array in found.items():
                if array is not None:
                    self.keep[f"{self.prefix}.{point}"] = np.array(array)
        return out.reshape(value.shape)

    def backward_out(self, grad: np.ndarray, name: str) -> np.ndarray | None:
        """The gradient at the point written (B, L, ...): through the decoder to the features and through the
        encoder to the input; an SAE returns the input's gradient, a transcoder keeps it for its input point."""
        if self.saved is None:
            raise RuntimeError(f"{self.sae!r}: backward without a forward through the SAE")
        sae = self.sae
        opened, pre_cut, acts_cut, source_shape, x, scale, shift, recons = self.saved
        self.output_grad = np.array(grad)
        w_enc, _, w_dec, _, norms = sae._weights(grad.dtype)
        g = grad.reshape(grad.shape[:2] + (-1,))  # (B, L, D_out)
        self.recons_grad = g if scale is None else g * scale  # (B, L, D_out): the normalised reconstruction's
        g_acts = self.recons_grad @ w_dec.T  # (B, L, S)
        if sae.rescale_acts_by_decoder_norm:
            g_acts = g_acts / norms
        g_acts, _ = self._user("hook_sae_acts_post", g_acts, "backward")
        self.feature_grad = g_acts
        if acts_cut or pre_cut:
            g_in = np.zeros(g.shape[:2] + (sae.d_in,), dtype=grad.dtype)  # (B, L, D)
        else:
            g_pre = g_acts * opened  # (B, L, S)
            if sae.rescale_acts_by_decoder_norm:
                g_pre = g_pre * norms
            g_in = g_pre @ w_enc.T  # (B, L, D)
        if scale is not None:  # through the normalisation, and the output's scale and shift (the error is constant)
            g_in = sae.normalize_backward(x, g_in, (g * recons).sum(-1, keepdims=True), g.sum(-1, keepdims=True))
        g_in = g_in.reshape(source_shape)
        if not sae.is_transcoder:
            return g_in
        self.input_grad = g_in
        return None

    def backward_in(self, grad: np.ndarray, name: str) -> np.ndarray:
        """A transcoder's input point: its own gradient plus what reached it through the transcoder."""
        if self.input_grad is None:
            return grad
        out, self.input_grad = grad + self.input_grad, None
        return out


def _passing(fn: Callable) -> Callable:
    """``fn`` marked as a differentiable replacement (:mod:`attnkit.core.hooks`): its point's gradient goes on,
    mapped by the backward hook installed with it."""

    def hook(value: np.ndarray, name: str) -> np.ndarray:
        return fn(value, name)

    hook.passes_gradient = True
    return hook


def _check_saes(sae_list: Any) -> list[SAE]:
    if isinstance(sae_list, SAE):
        sae_list = [sae_list]
    if isinstance(sae_list, (str, bytes)) or not isinstance(sae_list, Sequence) or not sae_list:
        raise TypeError(f"saes must be a non-empty list of SAE (attnkit.explain.load_sae), got "
                        f"{type(sae_list).__name__}")
    seen: dict[str, SAE] = {}
    for sae in sae_list:
        if not isinstance(sae, SAE):
            raise TypeError(f"saes must hold SAE objects (attnkit.explain.load_sae), got {type(sae).__name__}")
        for point in {sae.hook_name, sae.output_hook_name}:
            if point in seen:
                raise ValueError(f"two SAEs use {point}: {seen[point]!r} and {sae!r}; each point may be read or "
                                 f"written by one SAE")
            seen[point] = sae
    return list(sae_list)


@contextmanager
def saes(model: Any, sae_list: Any, *, use_error_term: bool = False,
         forward: Mapping[str, Callable] | None = None,
         backward: Mapping[str, Callable] | None = None) -> Iterator[None]:
    """Run ``model`` with SAEs spliced in (SAELens's ``HookedSAETransformer.saes``), under forward, ``generate``
    and the exact backward.

    The block holds the model for the calling thread (as :func:`~attnkit.explain.hooks`); leaving it discards the
    spliced forward's saved state, so a backward after it raises instead of differentiating the wrong model.

    Parameters
    ----------
    model : CausalLM
    sae_list : SAE or list of SAE
        At most one SAE writing each point.
    use_error_term : bool, default False
        Add each SAE's error, so the model's values are unchanged unless a feature hook edits the features.
    forward, backward : mapping of str to callable, optional
        Hooks ``fn(value, name)`` as :func:`~attnkit.explain.hooks` takes them, by name: the model's points, and
        each SAE's ``{hook}.hook_sae_acts_pre`` / ``.hook_sae_acts_post`` (forward; ``hook_sae_acts_post``
        backward too, the features' gradient). A feature hook that returns a replacement ablates or steers the
        features; as at the model's points, a replaced value is a constant (the gradient below it stops).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> rng = np.random.default_rng(0)
    >>> sae = SAE(rng.normal(size=(8, 16)), rng.normal(size=16), rng.normal(size=(16, 8)), np.zeros(8),
    ...           hook_name="blocks.0.hook_resid_post")
    >>> with saes(lm, [sae], use_error_term=True):
    ...     spliced = lm(np.array([[1, 2, 3]]))
    >>> bool(np.allclose(spliced, lm(np.array([[1, 2, 3]])), atol=1e-5))
    True
    """
    with _spliced(model, sae_list, use_error_term, forward, backward, None):
        yield


@contextmanager
def _spliced(model: Any, sae_list: Any, use_error_term: bool, forward: Any, backward: Any,
             keep: dict | None) -> Iterator[list[_Splice]]:
    sae_list = _check_saes(sae_list)
    if not isinstance(use_error_term, bool):
        raise TypeError(f"use_error_term must be a bool, got {type(use_error_term).__name__}")
    user_forward, user_backward = _check_hooks(forward, "forward"), _check_hooks(backward, "backward")
    splices = [_Splice(model, sae, use_error_term, user_forward, user_backward, keep) for sae in sae_list]
    for direction, left in (("forward", user_forward), ("backward", user_backward)):
        stray = [n for n in left if any(n.endswith(f".{p}") for p in SAE_POINTS)]
        if stray:
            raise ValueError(f"{direction} hook {stray[0]!r}: no spliced SAE has it (SAE points take "
                             f"{direction} hooks at {', '.join(_HOOKABLE[direction])})")
    fwd: dict[str, Callable] = {}
    bwd: dict[str, Callable] = {}
    for splice in splices:
        sae = splice.sae
        if sae.is_transcoder:
            fwd[sae.hook_name] = splice.capture
            bwd[sae.hook_name] = splice.backward_in
        fwd[sae.output_hook_name] = splice.forward_hook
        bwd[sae.output_hook_name] = splice.backward_out
    with hooks(model, fwd, backward=bwd), hooks(model, user_forward, backward=user_backward):
        yield splices


def run_with_cache_with_saes(model: Any, input_ids: Any, saes: Any, *, use_error_term: bool = False,
                             attention_mask: Any = None, names: Any = None,
                             forward: Mapping[str, Callable] | None = None) -> tuple[np.ndarray, ActivationCache]:
    """The logits and activations of one forward with SAEs spliced in (SAELens's ``run_with_cache_with_saes``).

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int, (L,) or (B, L)
    saes : SAE or list of SAE
    use_error_term : bool, default False
        As :func:`saes`: with it the logits are the model's own (to rounding).
    attention_mask : array_like (B, L), optional
    names : list of str or callable, optional
        Which of the model's points to keep as well (default all; a spliced point holds what the SAE passed on).
    forward : mapping of str to callable, optional
        Forward hooks during the run, as :func:`saes` takes them (feature hooks: ablation, steering); the cache
        holds the values after them.

    Returns
    -------
    logits : ndarray (B, L, V)
    cache : ActivationCache
        The model's points and each SAE's ``{hook}.hook_sae_input`` (B, L, D), ``.hook_sae_acts_pre`` and
        ``.hook_sae_acts_post`` (B, L, S), ``.hook_sae_recons`` and ``.hook_sae_output`` (B, L, D_out),
        ``.hook_sae_error`` with the error term; ``{hook}`` is the point the SAE writes.
    """
    everything = hook_names(model)
    if names is None:
        chosen = everything
    elif callable(names):
        chosen = [name for name in everything if names(name)]
    elif isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(f"names must be a list of hook names or a predicate, got {type(names).__name__}")
    else:
        chosen = list(names)
        for name in chosen:
            _check_point(model, name, everything, "names")
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]  # (1, L)
    found: dict[str, np.ndarray] = {}

    def keep(value: np.ndarray, name: str) -> None:
        found[name] = np.array(value)

    with _spliced(model, saes, use_error_term, forward, None, found), hooks(model, {n: keep for n in chosen}):
        logits = model(ids, attention_mask)
    order = {name: i for i, name in enumerate(everything)}

    def position(name: str) -> tuple[int, int]:
        base, _, point = name.rpartition(".")
        if point in SAE_POINTS:
            return order[base], SAE_POINTS.index(point)
        return order[name], len(SAE_POINTS)

    return logits, ActivationCache({name: found[name] for name in sorted(found, key=position)}, model)


# -- attribution ----------------------------------------------------------------------------------------------
@dataclass
class FeatureAttribution:
    """Each spliced SAE's features' share of a logit (or logit difference): gradient times activation.

    Attributes
    ----------
    metric : ndarray (B,)
        The logit (difference) explained, of the spliced model.
    activations, gradients, attributions : dict of str to ndarray (B, L, S)
        By the point each SAE writes: the features, the metric's exact gradient with respect to them (the error
        terms constant, as in SAELens), and their product.
    error_attributions, bias_attributions : dict of str to ndarray (B, L)
        The error term's and ``b_dec``'s share (the gradient at the written point dotted with them; the error's
        is zero without the error term; ``b_dec``'s includes a layer-norm normalisation's restored mean). Where
        the metric is linear in the written point (an SAE at ``ln_final.hook_normalized``) the three sum to the
        metric exactly.
    target : ndarray (B,) int64
        The explained token of each row.
    """

    metric: np.ndarray
    activations: dict[str, np.ndarray]
    gradients: dict[str, np.ndarray]
    attributions: dict[str, np.ndarray]
    error_attributions: dict[str, np.ndarray]
    bias_attributions: dict[str, np.ndarray]
    target: np.ndarray


def feature_attribution(model: Any, input_ids: Any, saes: Any, *, target_position: int = -1,
                        target_token: Any = None, incorrect_token: Any = None,
                        use_error_term: bool = True) -> FeatureAttribution:
    """Gradient times activation of every feature of the spliced SAEs for one logit (or a logit difference), from
    attnkit's exact backward of the spliced model.

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int, (L,) or (B, L)
    saes : SAE or list of SAE
    target_position : int, default -1
        The position whose logit is explained.
    target_token : int or array_like (B,), optional
        The token whose logit is explained; default the spliced model's top token there.
    incorrect_token : int or array_like (B,), optional
        Explain ``logit[target] - logit[incorrect]`` instead.
    use_error_term : bool, default True
        As :func:`saes`; the error is a constant of the backward.

    Returns
    -------
    FeatureAttribution
    """
    batch, _ = as_id_batch(input_ids, model.config.vocab_size, "input_ids")
    b, length = batch.shape
    position = check_position(target_position, length)
    sae_list = _check_saes(saes)
    with _spliced(model, sae_list, use_error_term, None, None, None) as splices:
        logits = model(batch)  # (B, L, V)
        row = logits[:, position]  # (B, V)
        target = row.argmax(axis=-1) if target_token is None else _tokens(target_token, b, model, "target_token")
        grad_logits = np.zeros(logits.shape, dtype=logits.dtype)  # (B, L, V)
        grad_logits[np.arange(b), position, target] += 1
        metric = row[np.arange(b), target].astype(np.float64)  # (B,)
        if incorrect_token is not None:
            wrong = _tokens(incorrect_token, b, model, "incorrect_token")
            grad_logits[np.arange(b), position, wrong] -= 1
            metric = metric - row[np.arange(b), wrong]
        with model.input_gradients_only():
            model.backward(grad_logits)
        result = FeatureAttribution(metric, {}, {}, {}, {}, {}, target.astype(np.int64))
        for splice in splices:
            sae, name = splice.sae, splice.prefix
            acts, error = splice.acts, splice.error
            g_out = splice.output_grad.reshape(acts.shape[:2] + (-1,))  # (B, L, D_out)
            result.activations[name] = acts
            result.gradients[name] = splice.feature_grad
            result.attributions[name] = acts * splice.feature_grad  # (B, L, S)
            result.error_attributions[name] = (error * g_out).sum(-1) if error is not None else \
                np.zeros(acts.shape[:2], acts.dtype)  # (B, L)
            shift = splice.saved[6]  # the normalisation's shift (B, L, 1), or None
            result.bias_attributions[name] = splice.recons_grad.reshape(g_out.shape) @ sae.b_dec.astype(g_out.dtype) \
                + (0 if shift is None else (g_out * shift).sum(-1))  # (B, L)
    return result


def _tokens(tokens: Any, b: int, model: Any, name: str) -> np.ndarray:
    given = np.asarray(tokens)
    vocab = model.config.vocab_size
    if given.dtype.kind not in "iu" or given.shape not in ((), (b,)) or (given < 0).any() or (given >= vocab).any():
        raise ValueError(f"{name} must be token ids in [0, {vocab}) (an int or one per row), got {tokens!r}")
    return np.broadcast_to(given, (b,)).astype(np.int64)
