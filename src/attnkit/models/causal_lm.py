"""``CausalLM``: a decoder-only Transformer language model (every family of :mod:`attnkit.pretrained.families`).

Dimension letters: B batch, L new tokens, P past slots in the cache, V ``vocab_size``, D ``hidden_size``.

Positions come from the attention mask, not from the column index: a row's position counts its real
tokens (``cumsum(mask) - 1``), so a left-padded row is computed exactly like the same tokens alone. The
cache stores keys by column (slot); rotary positions are applied before the keys enter it.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._validation import as_array, as_bool_mask, check_grad_output, check_positive_int
from ..attention.shared_kv import connect_shared_kv
from ..core.hooks import block_hook_points
from ..core.module import Module, ModuleList
from ..decoding.cache import ModelCache
from ..decoding.config import GenerationConfig
from ..init import as_generator
from ..kernels._threads import blas_on_free_cores, decode_blas
from ..kernels.linear import linear, product
from ..layers.embedding import Embedding
from ..layers.identity import Identity, Scale
from ..layers.lm_block import LAYER_INPUTS, make_block, make_norm
from ..layers.rotary import RotaryEmbedding
from .config import DecoderConfig

__all__ = ["CausalLM", "EarlyExit", "positions_from_mask"]

# A call of one token (B * L: a batch-1 decoding step) is a chain of matrix-vector products whose cost is reading
# the weights; whether a second BLAS thread helps there depends on the machine, which kernels._threads.one_row_blas
# measures once. From two rows on, OpenBLAS runs a small-M GEMM that is bound by arithmetic, not memory, and two
# threads paid on AMD EPYC: a (576, 1536) weight at 8 rows took 276 us on one thread and 164 us on two (SkylakeX
# kernel), and batch-8 decoding of a SmolLM-135M shape went from 58-68 to 74-75 tokens/s. Up to how many tokens
# one thread is kept is a tuned choice (kernels._threads.decode_blas, attnkit tune). The output head always
# threads (see forward).


def positions_from_mask(attention_mask: np.ndarray, length: int) -> np.ndarray:
    """Positions of the last ``length`` columns: ``cumsum(mask) - 1`` clipped at 0 (pads before a row's first
    real token get position 0).

    Shapes
    ------
    attention_mask (B, P + L) bool -> (B, L) int64

    Examples
    --------
    >>> positions_from_mask(np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=bool), 3).tolist()
    [[0, 1, 2], [2, 3, 4]]
    """
    counts = np.cumsum(attention_mask, axis=1, dtype=np.int64) - 1  # (B, P + L)
    return np.maximum(counts[:, attention_mask.shape[1] - length:], 0)  # (B, L)


class CausalLM(Module):
    """Token embedding, ``num_layers`` :class:`~attnkit.layers.lm_block.LMBlock`, final norm, output head.

    Parameters
    ----------
    config : DecoderConfig
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (norm gains start at one, biases at zero).

    Attributes
    ----------
    embed.weight (V, D); pos_embed.weight (P, D) for learned positions; ``layers.{i}`` blocks; ``norm``;
    head.weight (V, D) unless ``tie_word_embeddings`` (then the embedding is the head). Logits are
    ``head_scale(final_hidden @ weight.T)``: ``head_scale`` a :class:`~attnkit.layers.identity.Scale` by
    ``config.scales.logit`` (Granite), an identity where it is 1.

    Shapes
    ------
    input_ids : (B, L) int in [0, V)
    attention_mask : (B, P + L) bool or 0/1, ``True`` = real token, over the cached columns and the new
    ones (None: every column real)
    position_ids : (B, L) int, optional (default: from the mask)
    -> logits (B, L, V) in the parameters' dtype.

    Examples
    --------
    >>> from attnkit.models import MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> ids = np.array([[1, 2, 3]])
    >>> logits = lm(ids)
    >>> logits.shape
    (1, 3, 11)
    >>> cache = lm.new_cache(1)
    >>> steps = [lm(ids[:, :2], cache=cache), lm(ids[:, 2:], cache=cache)]
    >>> bool(np.allclose(np.concatenate(steps, axis=1), logits))
    True
    """

    def __init__(self, config: DecoderConfig, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        gen = as_generator(rng)
        self.embed = Embedding(config.vocab_size, config.hidden_size, rng=gen, std=0.02)
        # the learned position tables added to the token embeddings: GPT-2's one, or none
        self.position_tables = ("pos_embed",) if config.rotary is None else ()
        for name in self.position_tables:
            setattr(self, name, Embedding(config.max_position_embeddings, config.hidden_size, rng=gen, std=0.01))
        # One table of each rotary, and head width, the layers use (Gemma 3's sliding layers rotate with a base of
        # their own, Gemma 4's global layers over wider heads; a NoPE layer with none): self.rotary,
        # self.sliding_rotary, and which of them each layer reads.
        uses = [(spec.rotary, spec.head_dim) for spec in config.layers]
        self.rotary = self.sliding_rotary = None
        tables = {}
        for name, rotary in (("rotary", config.rotary),
                             ("sliding_rotary", None if config.rotary is None else config.rotary.sliding())):
            use = next((u for u in uses if u[0] is not None and u[0] == rotary and u not in tables.values()), None)
            if use is not None:
                setattr(self, name, RotaryEmbedding(*use, config.max_position_embeddings))
                tables[name] = use
        self.layer_rotary = tuple(next((name for name, u in tables.items() if u == use), None) for use in uses)
        self.layers = ModuleList([make_block(config, i, rng=gen) for i in range(config.num_layers)])
        connect_shared_kv([layer.attention for layer in self.layers])  # a reader of keys and values, its owner's
        # The inputs the blocks read their slice of (their INPUTS), by the blocks' keyword -> the attribute of the
        # module making them for every layer at once
        wanted = sorted({key for layer in self.layers for key in type(layer).INPUTS})
        self.layer_inputs = {key: LAYER_INPUTS[key][0] for key in wanted}
        for key in wanted:
            name, maker = LAYER_INPUTS[key]
            setattr(self, name, maker(config, rng=gen))
        self.norm = make_norm(config)
        if not config.tie_word_embeddings:
            self.head = Embedding(config.vocab_size, config.hidden_size, rng=gen, std=0.02)
        # A decoding step's head product is one row against the (V, D) head: stored column-major, its
        # transpose (D, V) is the contiguous array, which a matrix-vector product streams fastest.
        self.head_owner = "embed" if config.tie_word_embeddings else "head"
        # the logits times config.scales.logit (Granite's 1 / logits_scaling), before a soft-cap
        self.head_scale = Identity() if config.scales.logit == 1.0 else Scale(config.scales.logit)
        getattr(self, self.head_owner).store_column_major("weight")
        # generation_config.json's defaults for generate (set by the pretrained loader; explicit arguments win)
        self.generation_config = GenerationConfig()

    def extra_repr(self) -> str:
        c = self.config
        return (f"family={c.family!r}, vocab_size={c.vocab_size}, hidden_size={c.hidden_size}, "
                f"num_layers={c.num_layers}, num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}")

    def hook_points(self) -> tuple[str, ...]:
        """``hook_embed`` (B, L, D): the token embeddings times ``scales.embedding``; ``hook_pos_embed`` (B, L, D)
        the learned position embeddings (models with them); ``ln_final.hook_normalized`` (B, L, D) the final
        norm's output. The blocks' and attentions' points are in :meth:`named_hook_points`."""
        learned = tuple(f"hook_{name}" for name in self.position_tables)
        return ("hook_embed", *learned, "ln_final.hook_normalized")

    def named_hook_points(self) -> list[tuple[str, Module, str]]:
        """Every hook point as ``(full name, module, local name)``, in the order the forward reaches them.

        Full names are TransformerLens's: this model's points, ``blocks.{i}.`` and block i's
        (:meth:`LMBlock.hook_points`), ``blocks.{i}.attn.`` and its attention's
        (:meth:`GroupedQueryAttention.hook_points`), ``blocks.{i}.mlp.`` and its MLP's (a mixture of experts':
        :meth:`MixtureOfExperts.hook_points`). See :func:`attnkit.explain.hooks`.
        """
        embed, final = self.hook_points()[:-1], self.hook_points()[-1]
        points = [(name, self, name) for name in embed]
        for i, layer in enumerate(self.layers):
            points += block_hook_points(i, layer, layer.attention, layer.mlp)
        return points + [(final, self, final)]

    def layer_kind(self, index: int) -> str:
        """What layer ``index`` is, in words: its type (``config.layer_types``) and how its token mixer differs
        (``"a linear_attention (Gated DeltaNet) layer"``, ``"a sliding_attention layer that reuses layer 1's keys
        and values"``); the errors for a hook point a layer does not have say it."""
        c = self.config
        index = self._layer_index(index)
        kind = c.layer_types[index]
        if kind == "linear_attention":
            return f"a {kind} (Gated DeltaNet) layer"
        if kind == "kimi_delta_attention":
            return f"a {kind} (Kimi Delta Attention) layer"
        if kind == "short_conv":
            return f"a {kind} (gated short convolution) layer"
        if kind == "mamba2":
            return f"a {kind} (Mamba-2 state space) layer"
        if kind == "mlp":
            return f"a {kind} layer (its MLP alone, no token mixer)"
        if kind == "attention_mamba2":
            return f"an {kind} layer (attention beside a Mamba-2 mixer)"
        spec = c.layers[index]
        if spec.mixer == "latent_attention":
            return f"a {kind} layer with multi-head latent attention"
        if spec.kv_owner is not None:
            return f"a {kind} layer that reuses layer {spec.kv_owner}'s keys and values"
        return f"a {kind} layer"

    def layer_hook_points(self, index: int) -> list[str]:
        """The full hook names of layer ``index`` (``blocks.{index}.hook_resid_pre``, ``blocks.{index}.attn.hook_q``,
        ...), in forward order: layers of different kinds have different points (:meth:`layer_kind`).

        Examples
        --------
        >>> from attnkit.models import MLPConfig
        >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
        ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
        >>> CausalLM(cfg, rng=0).layer_hook_points(1)[:3]
        ['blocks.1.hook_resid_pre', 'blocks.1.attn.hook_q', 'blocks.1.attn.hook_k']
        """
        index = self._layer_index(index)
        layer = self.layers[index]
        return [name for name, _, _ in block_hook_points(index, layer, layer.attention)]

    def _layer_index(self, index: Any) -> int:
        n = self.config.num_layers
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n:
            raise ValueError(f"index must be a layer index in [0, {n}), got {index!r}")
        return int(index)

    @property
    def head_weight(self) -> np.ndarray:
        """The (V, D) matrix the logits are taken against (the embedding when tied)."""
        return getattr(self, self.head_owner).weight

    @property
    def dtype(self) -> np.dtype:
        """The parameters' dtype (and so the logits' and the cache's)."""
        return self.embed.weight.dtype

    @property
    def reprefill_length(self) -> int | None:
        """The sequence length past which the cached keys are stale, else None: the decoding loops run the whole
        sequence again once, when it first grows past it (as ``transformers`` does). The rotary part answers
        (Phi-3's ``longrope`` changes every frequency there: :attr:`RotaryEmbedding.reprefill_length`)."""
        return None if self.rotary is None else self.rotary.reprefill_length

    @property
    def max_sequence_length(self) -> int | None:
        """The longest sequence this model can run (the rows of its learned position tables), else None."""
        return min((getattr(self, name).weight.shape[0] for name in self.position_tables), default=None)

    def new_cache(self, batch_size: int, max_length: int | None = None, *, rollback: int = 0,
                  num_layers: int | None = None) -> ModelCache:
        """An empty cache for this model: the list of its layers' entries, each made by the layer's token mixer
        (``new_cache(batch_size, max_length, dtype=, rollback=)``): keys and values (a ring buffer of a sliding
        layer's window plus ``rollback`` slots), latents, a fixed-size state, keys and values beside a state, or
        nothing (a layer that reads another's keys and values, or is its MLP alone). ``num_layers``: for the first
        layers only (an :meth:`early_exit`'s). See :class:`~attnkit.decoding.cache.ModelCache`."""
        c = self.config
        n = c.num_layers if num_layers is None else check_positive_int(num_layers, "num_layers",
                                                                       maximum=c.num_layers)
        entries = [None if spec.mixer is None else
                   self.layers[spec.index].attention.new_cache(batch_size, max_length, dtype=self.dtype,
                                                               rollback=rollback)
                   for spec in c.layers[:n]]
        return ModelCache(entries, batch_size, max_length=max_length)

    def early_exit(self, num_layers: int) -> EarlyExit:
        """This model cut after its first ``num_layers`` blocks, then its final norm and head: a draft for
        self-speculative decoding (``generate(..., assistant_early_exit=N)``) that shares every weight.

        Examples
        --------
        >>> from attnkit.models import MLPConfig
        >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=3, num_heads=2,
        ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
        >>> draft = CausalLM(cfg, rng=0).early_exit(1)
        >>> draft(np.array([[1, 2]])).shape, draft.new_cache(1).num_layers
        ((1, 2, 11), 1)
        """
        return EarlyExit(self, check_positive_int(num_layers, "num_layers", maximum=self.config.num_layers))

    # ------------------------------------------------------------------------------------------------
    def _check_cache(self, cache: Any, specs: Sequence[Any]) -> None:
        """``cache`` must be one ``new_cache`` makes for the layers of ``specs``: an entry of the right kind per
        layer (of the first ones: an early exit's cache is shorter)."""
        if not isinstance(cache, ModelCache):
            raise TypeError(f"cache must be a ModelCache (from new_cache), got {type(cache).__name__}")
        if cache.num_layers > len(specs):
            raise ValueError(f"cache has {cache.num_layers} layers, the model {len(specs)}")
        for spec, kind in zip(specs, cache.kinds):
            wanted = "none" if spec.cache == "shared" else spec.cache
            if kind != wanted:
                raise TypeError(f"cache is not this model's (make it with new_cache): its layer {spec.index} holds "
                                f"{kind}, the model's layer keeps {wanted}")

    def _check_inputs(self, input_ids, attention_mask, position_ids, cache, specs: Sequence[Any] | None = None):
        ids = as_array(input_ids, "input_ids")
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be a 2-D integer array (B, L), got shape {ids.shape} and dtype "
                             f"{ids.dtype}")
        b, length = ids.shape
        if length == 0:
            raise ValueError("input_ids must hold at least one token per row, got shape (B, 0)")
        past = 0
        if cache is not None:
            self._check_cache(cache, self.config.layers if specs is None else specs)
            if cache.batch_size != b:
                raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has {b}")
            past = cache.length
        mask = as_bool_mask(attention_mask, "attention_mask", allow_int=True)
        if mask is None:
            mask = np.ones((b, past + length), dtype=bool)
        elif mask.shape != (b, past + length):
            raise ValueError(f"attention_mask must have shape (B, past + L) = ({b}, {past + length}) "
                             f"(cache holds {past} columns, input_ids has {length}), got {mask.shape}")
        if position_ids is None:
            positions = positions_from_mask(mask, length)  # (B, L)
        else:
            positions = np.asarray(position_ids)
            if positions.shape != (b, length) or positions.dtype.kind not in "iu" or (positions < 0).any():
                raise ValueError(f"position_ids must be non-negative integers of shape ({b}, {length}), got "
                                 f"shape {positions.shape} and dtype {positions.dtype}")
        too_far = positions.size and positions.max() >= self.config.max_position_embeddings
        if self.config.rotary is None and too_far:
            raise ValueError(f"position {int(positions.max())} is past the model's max_position_embeddings = "
                             f"{self.config.max_position_embeddings}")
        return ids, mask, positions

    def forward(self, input_ids: Any, attention_mask: Any = None, *, position_ids: Any = None,
                cache: ModelCache | None = None, output_attentions: bool = False, logits_to_keep: int = 0,
                return_hidden: bool = False):
        """Logits (B, L, V) of the next token after every position; with a cache, only the new tokens are fed.

        ``logits_to_keep=n`` (``transformers``' name) computes the logits of the last n positions only,
        (B, min(n, L), V); 0 keeps all. Generation asks for 1: a 1024-token prompt then costs one row of the
        (V, D) head instead of 1024.

        The uncached forward saves what :meth:`backward` needs; a cached forward (inference) does not.
        With ``output_attentions=True`` every layer's scores come from the reference kernel and the result
        is ``(logits, weights)``: weights a list of ``num_layers`` arrays (B, Hq, L, S) (S = L without a cache;
        with one, the slots the layer keeps), query head ``h`` in row ``h``, arrays the caller owns; backward
        is unchanged.

        With ``return_hidden=True`` the final hidden state of every position fed, after the final norm (what the
        head reads, transformers' ``hidden_states[-1]``), comes last: ``(logits, hidden)`` or
        ``(logits, weights, hidden)``, hidden (B, L, D) whatever ``logits_to_keep`` is (multi-token prediction
        reads it: :class:`~attnkit.models.multi_token.MultiTokenPredictor`).
        """
        if not isinstance(return_hidden, (bool, np.bool_)):
            raise TypeError(f"return_hidden must be True or False, got {type(return_hidden).__name__}")
        out = self._forward(input_ids, attention_mask, position_ids, cache, output_attentions, logits_to_keep,
                            len(self.layers), bool(return_hidden))
        return out if return_hidden else out[:-1] if output_attentions else out[0]

    def _forward(self, input_ids, attention_mask, position_ids, cache, output_attentions: bool, logits_to_keep,
                 depth: int, return_hidden: bool = False) -> tuple:
        """:meth:`forward` through the first ``depth`` blocks (all of them, or an :meth:`early_exit`'s):
        ``(logits, hidden)``, or ``(logits, weights, hidden)`` with ``output_attentions``; hidden None unless
        ``return_hidden``."""
        ids, mask, positions = self._check_inputs(input_ids, attention_mask, position_ids, cache)
        keep = check_positive_int(logits_to_keep, "logits_to_keep", allow_zero=True)
        if cache is not None:
            if cache.num_layers != depth:
                raise ValueError(f"the cache holds {cache.num_layers} layers but this forward runs {depth} (a cache "
                                 f"of an early exit serves that early exit only)")
            cache.record(ids)
        if self._steps(ids, cache, output_attentions):
            self.save_for_backward()
            logits, normed = self._step_forward(ids, mask, positions, cache, depth)  # (B, 1, V), (B, D)
            return logits, (normed[:, None] if return_hidden else None)
        weights: list[np.ndarray] = []
        with decode_blas(ids.size):
            h = self._hidden(ids, mask, positions, cache, weights if output_attentions else None,
                             depth=depth)  # (B, L, D)
        length = h.shape[1]
        # the caller's own copy where backward keeps h
        hidden = (h.copy() if cache is None else h) if return_hidden else None  # (B, L, D)
        if keep:
            h = h[:, -keep:]  # (B, min(keep, L), D)
        # The (V, D) head is large enough for every BLAS thread to help, even for one token (every free one).
        weight = self.head_weight.astype(h.dtype, copy=False)
        with blas_on_free_cores():
            logits = linear(h, weight.T)  # (B, L, V)
        logits = self.head_scale(logits)  # (B, L, V)
        capped = None
        if self.config.scales.final_logit_softcap is not None:
            cap = h.dtype.type(self.config.scales.final_logit_softcap)
            capped = np.tanh(logits / cap)  # (B, L, V)
            logits = capped * cap
        if cache is None:  # the cached path is inference: it keeps nothing
            self.save_for_backward(h, capped, length)
        else:
            self.save_for_backward()
        return (logits, weights, hidden) if output_attentions else (logits, hidden)

    def _steps(self, ids, cache, output_attentions: bool) -> bool:
        """Whether this call is a decoding step the layers' own ``step`` methods run: one token per row, a
        cache, no weights asked for and no hook installed (hooks are called by the sequence path)."""
        if cache is None or ids.shape[1] != 1 or output_attentions:
            return False
        # every module, listed once per model (a copy made from this one's attributes lists its own)
        owner, modules = self.__dict__.get("_all_modules", (None, ()))
        if owner is not self:
            modules = tuple(module for _, module in self.named_modules())
            object.__setattr__(self, "_all_modules", (self, modules))
        return all(module.__dict__.get("_hook_table") is None for module in modules)

    def _step_forward(self, ids, mask, positions, cache, depth: int) -> np.ndarray:
        """:meth:`forward` of one token per row with a cache, through every layer's ``step``: the same parts in
        the same order on (B, D) rows, nothing saved. Logits (B, 1, V) and the normed hidden state (B, D)."""
        h = self.embed.weight[ids[:, 0]].astype(self.dtype, copy=True)  # (B, D)
        h *= h.dtype.type(self.config.scales.embedding)  # a scale of 1 changes no bit
        for name in self.position_tables:
            h += getattr(self, name).weight[positions[:, 0]]  # (B, D)
        tables = {name: getattr(self, name)(positions, dtype=h.dtype)  # (B, 1, R) each
                  for name in set(self.layer_rotary) - {None}}
        layer_mask = None if mask.all() else mask  # (B, S) over every slot
        extra = {key: getattr(self, name).step(ids, h) for key, name in self.layer_inputs.items()}  # (B, N, P) each
        with decode_blas(ids.shape[0]):
            for index, layer in enumerate(list(self.layers)[:depth]):
                inputs = {key: e[:, index] for key, e in extra.items()}  # (B, P) each
                h = layer.step(h, rotary=tables.get(self.layer_rotary[index]), attention_mask=layer_mask,
                               cache=cache, **inputs)  # (B, D)
        normed = self.norm.step(h)  # (B, D)
        logits = product(normed, self.head_weight.astype(h.dtype, copy=False).T)  # (B, V)
        logits = self.head_scale.step(logits)  # (B, V)
        cap = self.config.scales.final_logit_softcap
        if cap is not None:
            logits /= cap
            np.tanh(logits, out=logits)
            logits *= cap
        return logits[:, None], normed  # (B, 1, V), (B, D)

    def layer_outputs(self, input_ids: Any, attention_mask: Any = None, *,
                      position_ids: Any = None) -> list[np.ndarray]:
        """Every block's output hidden state before the final norm: a list of ``num_layers`` arrays (B, L, D).

        The last one, through ``norm`` and the head, gives :meth:`forward`'s logits. The arrays are the
        caller's (the logit lens reads them).
        """
        ids, mask, positions = self._check_inputs(input_ids, attention_mask, position_ids, None)
        states: list[np.ndarray] = []
        self._hidden(ids, mask, positions, None, states=states)
        return states

    def attention_weights(self, input_ids: Any, attention_mask: Any = None, *, layers: Sequence[int] | None = None,
                          position_ids: Any = None) -> list[np.ndarray]:
        """The attention weights of the chosen layers: a list of (B, Hq, L, L) arrays, in the order of ``layers``.

        Only the chosen layers compute weights (the others take the tiled kernel), and no layer after the last
        chosen one runs: the weights of layer 0 of a 30-layer model cost one layer's scores, not thirty.

        A linear-attention (Gated DeltaNet) layer has no softmax pattern; its entry is what it has instead, its
        effective token-to-token weights (B, Hv, L, L) (:meth:`~attnkit.layers.GatedDeltaNet.token_weights`):
        lower-triangular, signed, rows not summing to one.

        Parameters
        ----------
        input_ids, attention_mask, position_ids
            As :meth:`forward`.
        layers : sequence of int, optional
            Layer indices in ``[0, num_layers)``; default every layer.

        Returns
        -------
        list of ndarray, each (B, Hq, L, L), the caller's.
        """
        n = self.config.num_layers
        chosen = list(range(n)) if layers is None else list(layers)
        if not chosen or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < n
                                 for i in chosen):
            raise ValueError(f"layers must be a non-empty sequence of layer indices in [0, {n}), got {layers!r}")
        ids, mask, positions = self._check_inputs(input_ids, attention_mask, position_ids, None)
        found: list[np.ndarray] = []
        wanted = sorted(set(int(i) for i in chosen))
        self._hidden(ids, mask, positions, None, found, weight_layers=set(wanted), last_layer=wanted[-1])
        by_layer = dict(zip(wanted, found, strict=True))
        return [by_layer[int(i)] for i in chosen]

    def _hidden(self, ids, mask, positions, cache, weights: list | None = None,
                states: list | None = None, *, weight_layers: set | None = None,
                last_layer: int | None = None, depth: int | None = None) -> np.ndarray:
        """The final-norm hidden states (B, L, D); the weights of each layer (of ``weight_layers`` only, if
        given) are appended to ``weights`` if given, each layer's output (a copy) to ``states`` if given. With
        ``last_layer`` the blocks after it do not run (and the result is that block's output, not normed)."""
        h = self.embed(ids)  # (B, L, D)
        h = h * h.dtype.type(self.config.scales.embedding)  # (B, L, D); a scale of 1 changes no bit
        h = self.hook_point("hook_embed", h)
        for name in self.position_tables:
            h = h + self.hook_point(f"hook_{name}", getattr(self, name)(positions))  # (B, L, D)
        tables = {name: getattr(self, name)(positions, dtype=h.dtype)  # (B, L, R) each
                  for name in set(self.layer_rotary) - {None}}
        layer_mask = None if mask.all() else mask  # no padding: the kernels skip the mask entirely
        extra = {key: getattr(self, name)(ids, h) for key, name in self.layer_inputs.items()}  # (B, L, N, P) each
        for index, layer in enumerate(list(self.layers)[:depth]):
            layer_rotary = tables.get(self.layer_rotary[index])
            inputs = {key: e[:, :, index] for key, e in extra.items()}  # (B, L, P) each
            if weights is None or (weight_layers is not None and index not in weight_layers):
                h = layer(h, rotary=layer_rotary, attention_mask=layer_mask, cache=cache, **inputs)  # (B, L, D)
            else:
                h, layer_weights = layer(h, rotary=layer_rotary, attention_mask=layer_mask, cache=cache,
                                         output_attentions=True, **inputs)  # (B, L, D), (B, Hq, L, S)
                weights.append(layer_weights)
            if states is not None:
                states.append(h.copy())
            if index == last_layer:
                return h
        return self.hook_point("ln_final.hook_normalized", self.norm(h))  # (B, L, D)

    def backward(self, grad_logits: Any) -> np.ndarray:
        """Add every parameter's gradient of ``sum(grad_logits * logits)`` into the grads.

        Returns the gradient with respect to the input embeddings (B, L, D): the token embeddings, plus the
        learned position embeddings where the model has them (both get the same gradient). Input
        attributions (:mod:`attnkit.explain`) are built on it.
        """
        if self.saved_tensors is None:
            raise RuntimeError("CausalLM.backward needs a forward without a cache just before it")
        h, capped, length = self.saved_tensors  # h: the positions whose logits were kept
        g = check_grad_output(grad_logits, h.shape[:-1] + (self.config.vocab_size,), h.dtype, "CausalLM")
        if capped is not None:
            g = g * (1 - capped * capped)  # (B, L, V): d(C tanh(z / C)) / dz
        g = self.head_scale.backward(g)  # (B, L, V)
        flat_g = g.reshape(-1, g.shape[-1])  # (B*L, V)
        weight = self.head_weight.astype(h.dtype, copy=False)
        owner = getattr(self, self.head_owner)
        if owner.grads.wanted:
            owner.grads["weight"] += flat_g.T @ h.reshape(-1, h.shape[-1])  # (V, D)
        grad_h = product(flat_g, weight).reshape(h.shape)  # (B, kept, D)
        if h.shape[1] != length:  # positions without logits get no gradient from the head
            grad_h = np.concatenate([np.zeros((h.shape[0], length - h.shape[1], h.shape[2]), grad_h.dtype), grad_h],
                                    axis=1)  # (B, L, D)
        grad_h = self.norm.backward(self.hook_backward("ln_final.hook_normalized", grad_h))
        for layer in reversed(list(self.layers)):
            grad_h = layer.backward(grad_h)  # (B, L, D)
        for key, name in self.layer_inputs.items():
            grad_inputs = np.stack([getattr(layer, f"grad_{key}") for layer in self.layers], axis=2)  # (B, L, N, P)
            grad_h = grad_h + getattr(self, name).backward(grad_inputs)  # (B, L, D)
        for name in self.position_tables:
            getattr(self, name).backward(self.hook_backward(f"hook_{name}", grad_h))
        grad_h = self.hook_backward("hook_embed", grad_h)
        grad_h = grad_h * grad_h.dtype.type(self.config.scales.embedding)  # (B, L, D)
        self.embed.backward(grad_h)
        return grad_h

    def generate(self, input_ids: Any, attention_mask: Any = None, *, generation_config: GenerationConfig | None = None,
                 progress: bool | None = None, **options: Any) -> np.ndarray:
        """Decode new tokens with the KV cache, with Hugging Face's argument names and meanings.

        :func:`attnkit.decoding.sampling.generate` on this model, which documents every argument: the generation
        options (the fields of :class:`~attnkit.decoding.config.GenerationConfig`: ``max_new_tokens``,
        ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``num_beams``, ``prompt_lookup_num_tokens``, ...;
        each left out takes :attr:`generation_config`'s value, the folder's ``generation_config.json``),
        ``tokenizer`` (for ``stop_strings``), ``seed``, ``past_key_values`` (a cache to reuse) and
        ``assistant_model`` (a draft model).

        Parameters
        ----------
        input_ids : int array (B, L)
            Left-padded prompts.
        attention_mask : bool or 0/1 array (B, L), optional
            1 = real token.
        generation_config : GenerationConfig, optional
            Defaults that replace :attr:`generation_config`'s.
        progress : bool or None, default None
            A line on stderr counting the steps: None on a terminal only, True always, False never.
        **options
            As above.

        Returns
        -------
        int64 array (B * num_return_sequences, L + T)
            Prompts followed by the T <= ``max_new_tokens`` new tokens; pad after a row's end.
        """
        from ..decoding.sampling import generate

        return generate(self, input_ids, attention_mask, generation_config=generation_config, progress=progress,
                        **options)

    def stream(self, prompt: Any, tokenizer: Any, *, skip_special_tokens: bool = True,
               **options: Any) -> Iterator[str]:
        """Generate a continuation of one prompt and yield its text piece by piece as it is decoded.

        A piece is yielded once it is final: never half of a multi-byte character, never text the next token
        could still change (:meth:`attnkit.pretrained.Tokenizer.stream_decode`); the pieces join to the decoded
        continuation.

        Parameters
        ----------
        prompt : str or int array (L,) or (1, L)
            Text (encoded with ``tokenizer``, its special tokens added) or token ids.
        tokenizer : Tokenizer
            :func:`attnkit.pretrained.load_tokenizer`'s, or anything with ``encode`` and ``stream_decode``; it
            also reads ``stop_strings``.
        skip_special_tokens : bool, default True
            Leave special tokens (the eos that ends the reply) out of the text.
        **options
            :meth:`generate`'s options (``max_new_tokens``, ``temperature``, ``generation_config``, ...); beam
            search settles its tokens only at the end and cannot be streamed.

        Yields
        ------
        str
            The next piece of the continuation's text.

        Raises
        ------
        ValueError
            More than one prompt, or ``num_beams`` above 1.
        """
        from ..decoding.sampling import generate_stream

        if isinstance(prompt, str):
            prompt = tokenizer.encode(prompt)
        ids = as_array(prompt, "prompt")
        ids = ids[None] if ids.ndim == 1 else ids  # (1, L)
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"stream takes one prompt (a string or ids (L,) or (1, L)), got shape {ids.shape}; "
                             f"use generate for a batch")
        if options.get("num_beams") not in (None, 1):
            raise ValueError(f"stream cannot run beam search (num_beams={options['num_beams']!r}): beams settle "
                             f"their tokens only at the end; use generate")
        steps = generate_stream(self, ids, tokenizer=tokenizer, **options)
        yield from tokenizer.stream_decode(steps, skip_special_tokens=skip_special_tokens)


class EarlyExit:
    """A :class:`CausalLM`'s first ``num_layers`` blocks, then its final norm and head (:meth:`CausalLM.early_exit`):
    a draft model that shares every weight with the model, for inference.

    Shapes
    ------
    As :meth:`CausalLM.forward`: input_ids (B, L) -> logits (B, L, V); its caches hold ``num_layers`` layers.
    """

    def __init__(self, model: CausalLM, num_layers: int) -> None:
        self.model, self.num_layers = model, num_layers
        self.config = model.config

    def forward(self, input_ids: Any, attention_mask: Any = None, *, position_ids: Any = None,
                cache: ModelCache | None = None, logits_to_keep: int = 0) -> np.ndarray:
        """Logits (B, L, V) after the first ``num_layers`` blocks (see :meth:`CausalLM.forward`)."""
        return self.model._forward(input_ids, attention_mask, position_ids, cache, False, logits_to_keep,
                                   self.num_layers)[0]

    __call__ = forward

    def new_cache(self, batch_size: int, max_length: int | None = None, *, rollback: int = 0):
        """An empty cache of the first ``num_layers`` layers (see :meth:`CausalLM.new_cache`)."""
        return self.model.new_cache(batch_size, max_length, rollback=rollback, num_layers=self.num_layers)
