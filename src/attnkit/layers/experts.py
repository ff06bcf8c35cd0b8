"""``MixtureOfExperts``: a router, stacked gated experts and an optional shared expert, shaped by one
``ExpertsConfig`` (gpt-oss, Mixtral, Qwen3-MoE, Qwen3-Next and DeepSeek-V3 are settings of it).

Dimension letters: ``...`` any leading dims, N tokens (their product), D ``hidden_size``, E ``num_experts``,
k ``num_experts_per_tok``, F ``moe_intermediate_size``, Fs ``shared_expert_intermediate_size``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import experts as _experts
from ..kernels.linear import linear, linear_backward
from ..kernels.routing import ROUTERS
from .gated_mlp import GatedMLP, check_mlp_kind
from .identity import Zero
from .router import Router

__all__ = ["ExpertsConfig", "GatedSharedExpert", "MixtureOfExperts"]

_MAX_SIZE = 2**31 - 1  # no real model comes near it; beyond it a size could only allocate without end


def _positive_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ExpertsConfig:
    """A mixture of experts in the MLP's place on some layers (a part of :class:`~attnkit.models.DecoderConfig`),
    with ``transformers``' names where it has them.

    Parameters
    ----------
    num_experts : int
        E, the routed experts of each mixture (``num_experts``, ``num_local_experts``, ``n_routed_experts``).
    num_experts_per_tok : int
        k <= E, the experts each token goes to.
    moe_intermediate_size : int
        F, each routed expert's hidden width (gpt-oss and Mixtral: their ``intermediate_size``).
    layers : tuple of int
        The layers whose MLP is the mixture (the others keep the dense ``mlp`` of ``mlp.intermediate_size``); each
        family's reader resolves its own rule into it (``first_k_dense_replace``, ``decoder_sparse_step`` and
        ``mlp_only_layers``, every layer).
    router : {"softmax_topk", "topk_softmax", "topk_sigmoid", "sigmoid_group_topk"}, default "softmax_topk"
        How the k experts are chosen and weighed (:mod:`attnkit.kernels.routing`): the top k of a softmax
        (Mixtral, Qwen), a softmax over the top k logits (gpt-oss), the top k logits each weighed by its sigmoid
        (Llama 4), or group-limited sigmoid scores with a correction bias (DeepSeek-V3).
    norm_topk_prob : bool, default True
        Divide the k chosen weights by their sum (``"topk_softmax"``'s always are).
    routed_scaling_factor : float, default 1.0
        Multiplies the routed weights.
    n_group, topk_group : int, default 1
        ``"sigmoid_group_topk"``'s G expert groups (dividing E, at least two experts each) and the groups a token
        may draw from.
    router_bias : bool, default False
        A bias on the router's logits (gpt-oss).
    expert_bias : bool, default False
        Biases on the experts' three projections (gpt-oss).
    swiglu_limit : float, optional
        gpt-oss's clamped SwiGLU: the expert's gate is clamped above at ``swiglu_limit``, its up projection to
        ``[-limit, limit]``, and ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` replaces ``act(gate) * up``.
    swiglu_alpha : float, default 1.702
        With ``swiglu_limit`` only.
    shared_expert_intermediate_size : int, default 0
        Fs > 0: a gated MLP of this width that every token passes through beside the routed experts (DeepSeek-V3:
        ``n_shared_experts * moe_intermediate_size``); 0: none.
    shared_expert_gate : bool, default False
        The shared expert's output is scaled by ``sigmoid(x W_shared_gate)`` (Qwen3-Next's ``shared_expert_gate``).
    weigh_inputs : bool, default False
        A chosen expert's weight scales its input, ``expert(w x)``, rather than its output (Llama 4).

    Examples
    --------
    >>> part = ExpertsConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, layers=(1, 2, 3))
    >>> part.router, part.norm_topk_prob, part.shared_expert_intermediate_size
    ('softmax_topk', True, 0)
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    layers: tuple[int, ...]
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    weigh_inputs: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            check_positive_int(getattr(self, name), f"experts.{name}", maximum=_MAX_SIZE)
        check_positive_int(self.shared_expert_intermediate_size, "experts.shared_expert_intermediate_size",
                           allow_zero=True, maximum=_MAX_SIZE)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"experts.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"experts.num_experts ({self.num_experts})")
        if self.router not in ROUTERS:
            raise ValueError(f"experts.router must be one of {', '.join(map(repr, ROUTERS))}, got {self.router!r}")
        for name in ("norm_topk_prob", "router_bias", "expert_bias", "shared_expert_gate", "weigh_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"experts.{name} must be True or False, got {getattr(self, name)!r}")
        _positive_number(self.routed_scaling_factor, "experts.routed_scaling_factor")
        _positive_number(self.swiglu_alpha, "experts.swiglu_alpha")
        if self.swiglu_limit is not None:
            _positive_number(self.swiglu_limit, "experts.swiglu_limit")
        self._check_routing()
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("experts.shared_expert_gate gates a shared expert: it needs "
                             "experts.shared_expert_intermediate_size > 0")
        layers = tuple(self.layers)
        if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) \
                or len(set(layers)) != len(layers):
            raise ValueError(f"experts.layers must list distinct non-negative layer indices (at least one), got "
                             f"{self.layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))

    def _check_routing(self) -> None:
        """Refuse routing that cannot work: groups that do not divide the experts into groups of at least two (a
        group scores by its two best), more kept groups than groups, more experts per token than the kept groups
        hold; groups or an unnormalised softmax over the top k with the routers that have none."""
        e, k, groups, kept = self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group
        if self.router != "sigmoid_group_topk":
            if (groups, kept) != (1, 1):
                raise ValueError(f"experts.n_group and experts.topk_group are the 'sigmoid_group_topk' router's; "
                                 f"the {self.router!r} router takes 1 and 1, got {groups} and {kept}")
            if self.router == "topk_softmax" and not self.norm_topk_prob:
                raise ValueError("experts.norm_topk_prob=False: the 'topk_softmax' router's weights are a softmax "
                                 "over the chosen k, which always sums to one")
            if self.router == "topk_sigmoid" and self.norm_topk_prob:
                raise ValueError("experts.norm_topk_prob=True: the 'topk_sigmoid' router weighs each chosen expert "
                                 "by its own sigmoid, never normalised; give norm_topk_prob=False")
            return
        if e % groups or e // groups < 2:
            raise ValueError(f"experts.n_group ({groups}) must divide experts.num_experts ({e}) into groups of at "
                             f"least two experts (a group scores by its two best)")
        if kept > groups:
            raise ValueError(f"experts.topk_group ({kept}) must be at most experts.n_group ({groups})")
        if k > kept * (e // groups):
            raise ValueError(f"experts.num_experts_per_tok ({k}) must fit in the kept groups: at most topk_group * "
                             f"num_experts / n_group = {kept * (e // groups)}")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # never overflows, unlike 1 / (1 + exp(-x))


class GatedSharedExpert(GatedMLP):
    """A :class:`GatedMLP` whose output is scaled by a sigmoid gate of its input: ``sigmoid(x W_shared_gate) *
    mlp(x)`` (Qwen3-Next's shared expert with its ``shared_expert_gate``).

    Parameters
    ----------
    hidden_size, intermediate_size, activation
        As :class:`GatedMLP`'s (``intermediate_size`` the shared expert's width; no biases).
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    W_shared_gate : (D, 1)
        Beside GatedMLP's parameters.

    Shapes
    ------
    x : (..., D) -> (..., D).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", *,
                 rng: np.random.Generator | int | None = None) -> None:
        gen = as_generator(rng)
        gate = normal(gen, (hidden_size, 1), std=0.02)  # drawn first, as the mixture drew it before
        super().__init__(hidden_size, intermediate_size, activation, rng=gen)
        self.register_parameter("W_shared_gate", gate)

    def forward(self, x: Any) -> np.ndarray:
        """``sigmoid(x W_shared_gate) * mlp(x)`` for every position of ``x`` (..., D)."""
        shared = super().forward(x)  # (..., D); saves (x, its parts)
        x = self.saved_tensors[0]
        gate = _sigmoid(linear(x, self._parameters["W_shared_gate"]))  # (..., 1)
        self.save_for_backward(*self.saved_tensors, shared, gate)
        return gate * shared

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): the gate times :meth:`GatedMLP.step`'s output, nothing saved."""
        gate = _sigmoid(linear(x, self._parameters["W_shared_gate"]))  # (B, 1)
        return gate * super().step(x)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("GatedSharedExpert.backward called before forward")
        *mlp_saved, shared, gate = self.saved_tensors
        x = mlp_saved[0]
        g = check_grad_output(grad_output, x.shape, x.dtype, "GatedSharedExpert")
        self.save_for_backward(*mlp_saved)
        grad_x = super().backward(g * gate)  # (..., D)
        d = x.shape[-1]
        grad_pre = np.einsum("nd,nd->n", g.reshape(-1, d), shared.reshape(-1, d)).reshape(gate.shape) \
            * gate * (1 - gate)  # (..., 1)
        grad_xg, grad_w, _ = linear_backward(grad_pre, x, self._parameters["W_shared_gate"])  # (..., D)
        self.grads["W_shared_gate"] += grad_w
        return grad_x + grad_xg


def _shared_expert(hidden_size: int, part: ExpertsConfig, activation: str, rng: np.random.Generator) -> Module:
    """The shared expert the experts part describes: none (a :class:`~attnkit.layers.identity.Zero`), a
    :class:`GatedMLP` or a :class:`GatedSharedExpert`, without biases."""
    if not part.shared_expert_intermediate_size:
        return Zero()
    kind = GatedSharedExpert if part.shared_expert_gate else GatedMLP
    return kind(hidden_size, part.shared_expert_intermediate_size, activation, rng=rng)


class MixtureOfExperts(Module):
    """``y = sum_j w_j expert_{c_j}(x) + shared_expert(x)`` (``weigh_inputs``: ``expert_{c_j}(w_j x)``): a
    :class:`~attnkit.layers.router.Router` picks k of E gated experts per token (``c``) and weighs them (``w``);
    the shared expert, if any, sees every token.

    Expert e is ``(act(x W_gate[e] + b_gate[e]) * (x W_up[e] + b_up[e])) W_down[e] + b_down[e]`` (biases with
    ``expert_bias``), or gpt-oss's clamped SwiGLU with ``swiglu_limit``; see :mod:`attnkit.kernels.experts`.
    The choice of experts is piecewise constant: the router learns through the k weights. Every setting is
    the ``experts`` part's (:class:`ExpertsConfig`); the module is built with its parts and its forward reads
    none.

    Parameters
    ----------
    hidden_size : int
        D.
    experts : ExpertsConfig
        The experts, their router and the shared expert.
    activation : {"silu", "gelu", "gelu_tanh", "relu", "relu2"}, default "silu"
        The experts' gate activation.
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (biases start at zero).

    Attributes
    ----------
    router : Router
        ``W_router`` (D, E) and its biases.
    W_gate, W_up : (E, D, F); W_down : (E, F, D)
        The routed experts, stacked, stored for ``x @ W``; with ``expert_bias`` also b_gate, b_up (E, F) and
        b_down (E, D). ``grads`` with the same names.
    shared_expert : GatedMLP, GatedSharedExpert or Zero
        Of width Fs, with its sigmoid gate when ``shared_expert_gate``; a Zero without a shared expert.

    Hook points (:func:`attnkit.explain.hooks`)
    -------------------------------------------
    ``hook_expert_indices`` (..., k) int64, the chosen experts (forward hooks only: a replacement routes the
    tokens to other experts with the router's weights); ``hook_router_weights`` (..., k), the weight of each
    chosen expert's output (a replacement is a constant: the router then gets no gradient).

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> from attnkit.models import ExpertsConfig
    >>> part = ExpertsConfig(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=5, layers=(0,),
    ...                      shared_expert_intermediate_size=7, shared_expert_gate=True)
    >>> moe = MixtureOfExperts(4, part, "silu", rng=0)
    >>> y = moe(np.ones((2, 3, 4)))
    >>> y.shape, moe.backward(np.ones_like(y)).shape, moe.W_gate.shape, moe.shared_expert.W_gate.shape
    ((2, 3, 4), (2, 3, 4), (3, 4, 5), (4, 7))
    """

    # the earlier layouts of gpt-oss's, Qwen3-Next's and DeepSeek-V3's mixtures
    STATE_DICT_RENAMES = {"W_router": "router.W_router", "b_router": "router.b_router",
                          "W_shared_gate": "shared_expert.W_shared_gate", "shared_experts": "shared_expert"}
    FORWARD_ONLY_HOOKS = ("hook_expert_indices",)

    def __init__(self, hidden_size: int, experts: ExpertsConfig, activation: str = "silu", *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if not isinstance(experts, ExpertsConfig):
            raise TypeError(f"experts must be an ExpertsConfig, got {type(experts).__name__}")
        part = experts
        gen = as_generator(rng)
        d = check_positive_int(hidden_size, "hidden_size", maximum=_MAX_SIZE)
        f, e = part.moe_intermediate_size, part.num_experts
        activation, _ = check_mlp_kind(activation, False)
        self.hidden_size, self.num_experts, self.top_k = d, e, part.num_experts_per_tok
        self.activation, self.limit, self.alpha = activation, part.swiglu_limit, float(part.swiglu_alpha)
        self.weigh_inputs = part.weigh_inputs
        self.router = Router(d, part, rng=gen)
        for name, shape in (("W_gate", (e, d, f)), ("W_up", (e, d, f)), ("W_down", (e, f, d))):
            self.register_parameter(name, normal(gen, shape, std=0.02))
        if part.expert_bias:
            for name, shape in (("b_gate", (e, f)), ("b_up", (e, f)), ("b_down", (e, d))):
                self.register_parameter(name, np.zeros(shape))
        self.shared_expert = _shared_expert(d, part, activation, gen)

    def extra_repr(self) -> str:
        e, d, f = self.W_gate.shape
        return (f"hidden_size={d}, num_experts={e}, top_k={self.top_k}, moe_intermediate_size={f}, "
                f"activation={self.activation!r}, swiglu_limit={self.limit}")

    def hook_points(self) -> tuple[str, ...]:
        """``hook_expert_indices`` and ``hook_router_weights``, both (..., k)."""
        return ("hook_expert_indices", "hook_router_weights")

    def _check_expert_indices(self, chosen: np.ndarray) -> None:
        """A hook's replacement of the chosen experts must name k distinct experts per token."""
        if not self.hook_replaced("hook_expert_indices"):
            return
        ordered = np.sort(chosen, axis=-1)  # (..., k)
        if ordered.size and (ordered[..., 0].min() < 0 or ordered[..., -1].max() >= self.num_experts
                             or (np.diff(ordered, axis=-1) == 0).any()):
            raise ValueError(f"the hook at hook_expert_indices must choose {self.top_k} distinct experts in "
                             f"[0, {self.num_experts}) per token")

    def forward(self, x: Any) -> np.ndarray:
        """The weighted outputs of every position's chosen experts plus the shared expert's, for ``x`` (..., D);
        saves what backward needs."""
        x = check_features(x, "x", self.hidden_size, "MixtureOfExperts", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        chosen, weights = self.router(x)  # (..., k) each
        chosen = self.hook_point("hook_expert_indices", chosen)
        self._check_expert_indices(chosen)
        weights = self.hook_point("hook_router_weights", weights)
        chosen, weights = chosen.reshape(-1, self.top_k), weights.reshape(-1, self.top_k)  # (N, k) each
        y, saved = _experts.experts_forward(flat, chosen, weights, self._parameters, self.activation, self.limit,
                                            self.alpha, weigh_inputs=self.weigh_inputs)  # (N, D)
        y += self.shared_expert(flat)  # (N, D)
        self.save_for_backward(x.shape, flat, weights, saved)
        return y.reshape(x.shape)

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): :meth:`forward`'s numbers on a step's rows, nothing saved.

        The router's logits and choice, then only the chosen experts' products
        (:func:`attnkit.kernels.experts.experts_step`, increasing expert as the forward sums them), then the
        shared expert's own ``step``; no flattening of leading dims and nothing kept for a backward.
        """
        chosen, weights = self.router.step(x)  # (B, k) each
        y = _experts.experts_step(x, chosen, weights, self._parameters, self.activation, self.limit, self.alpha,
                                  weigh_inputs=self.weigh_inputs)  # (B, D)
        y += self.shared_expert.step(x)  # (B, D)
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add every parameter's gradient into the grads (the router's and the shared expert's into theirs);
        return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("MixtureOfExperts.backward called before forward")
        shape, flat, weights, saved = self.saved_tensors
        g = check_grad_output(grad_output, shape, flat.dtype, "MixtureOfExperts").reshape(flat.shape)  # (N, D)
        grad_x, grad_weights, grads = _experts.experts_backward(g, flat, weights, self._parameters, saved,
                                                                self.activation, self.limit, self.alpha,
                                                                need_weights=self.grads.wanted,
                                                                weigh_inputs=self.weigh_inputs)  # (N, D)
        for name, value in grads.items():
            self.grads[name] += value
        grad_weights = self.hook_backward("hook_router_weights", grad_weights.reshape(*shape[:-1], self.top_k))
        grad_x += self.router.backward(grad_weights).reshape(flat.shape)  # (N, D)
        grad_x += self.shared_expert.backward(g)  # (N, D)
        return grad_x.reshape(shape)
