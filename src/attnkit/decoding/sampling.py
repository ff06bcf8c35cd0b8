"""Text generation for causal language models: logits warpers, greedy and sampled decoding, streaming.

Decoding follows Hugging Face's ``generate`` (``do_sample`` with ``num_beams=1``): the prompt runs through the
model once (prefill) into its cache (:class:`~attnkit.decoding.cache.ModelCache`), then each step feeds the one
new token per row.
With ``do_sample=True`` the last logits pass through the warpers in Hugging Face's order, each only when it
changes something: temperature (``!= 1``), top-k (``> 0``), top-p (``< 1``), min-p (any value), and the next
token is drawn from the softmax of what is left. Without sampling the next token is the argmax of the raw
logits. A row that produced an end-of-sequence token is done: every later token of it is ``pad_token_id``;
generation stops when every row is done or after ``max_new_tokens`` steps.

Dimension letters: B rows, L prompt length (left padding included), V vocabulary, T new tokens.

The warpers are pure functions of a logits array (..., V); filtered entries become ``-inf`` (Hugging Face's
``filter_value``), so a softmax gives them probability zero.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _progress
from .._validation import as_array, check_positive_int
from .beam_search import lm_beam_search, next_token_logits
from .cache import crop_to_prefix
from .config import (
    MAX_DRAFT_TOKENS,
    GenerationConfig,
    check_repetition_penalty,
    check_temperature,
    check_top_k,
    check_unit,
)
from .speculative import DraftModel, MultiTokenDraft, PromptLookup, Proposer, draft_step_cost

__all__ = ["check_generation_config", "resolve_generation_options",
           "temperature_warp", "top_k_filter", "top_p_filter", "min_p_filter", "warp_logits", "sample_tokens",
           "apply_repetition_penalty", "banned_ngram_tokens", "generate", "generate_stream", "speculative_sample"]

FILTER_VALUE = -np.inf


# Longest generation accepted (the CLI's bound too): positions and slot counts stay far inside int64, and
# a request beyond it cannot finish anyway. The cache grows with what is generated, not with this bound.


def _check_logits(logits: Any) -> np.ndarray:
    array = np.asarray(logits)
    if array.dtype.kind != "f" or array.ndim < 1 or array.shape[-1] == 0:
        raise ValueError(f"logits must be a floating array (..., V) with V >= 1, got dtype {array.dtype} and shape "
                         f"{array.shape}")
    return array


def _check_min_keep(min_tokens_to_keep: Any) -> int:
    return check_positive_int(min_tokens_to_keep, "min_tokens_to_keep")


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis that also takes the limit of a vanishing temperature: a row whose largest
    logit overflowed to +inf gets equal probabilities on its +inf entries (not ``inf - inf = NaN``)."""
    top = logits.max(axis=-1, keepdims=True)  # (..., 1)
    overflowed = np.isposinf(top)  # (..., 1)
    if overflowed.any():
        logits = np.where(overflowed, np.where(np.isposinf(logits), 0.0, -np.inf), logits)  # (..., V)
        top = np.where(overflowed, 0.0, top)  # (..., 1)
    shifted = logits - top  # (..., V); -inf entries stay -inf
    e = np.exp(shifted)  # (..., V)
    return e / e.sum(axis=-1, keepdims=True)


def temperature_warp(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Divide the logits by ``temperature`` (< 1 sharpens, > 1 flattens the distribution).

    Shapes
    ------
    logits : (..., V) float -> (..., V), same dtype.

    Examples
    --------
    >>> temperature_warp(np.array([2.0, 1.0]), 0.5)
    array([4., 2.])
    """
    array = _check_logits(logits)
    temperature = check_temperature(temperature)
    wide = array.astype(np.float64)  # (..., V): a temperature below the dtype's smallest number stays non-zero
    with np.errstate(over="ignore"):
        out = (wide / temperature).astype(array.dtype)  # (..., V)
        overflowed = (np.isinf(out) & np.isfinite(array)).any(axis=-1)  # (...)
        if overflowed.any():
            # A tiny temperature overflows the scaled logits. Shifting a row by its maximum first changes no
            # probability and keeps the limit: the largest logits stay 0, the others go to -inf.
            top = np.where(np.isfinite(wide), wide, -np.inf).max(axis=-1, keepdims=True)  # (..., 1)
            shifted = ((wide - top) / temperature).astype(array.dtype)  # (..., V)
            out = np.where(overflowed[..., None], shifted, out)  # (..., V)
    return out


def top_k_filter(logits: np.ndarray, top_k: int, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Keep the ``max(top_k, min_tokens_to_keep)`` largest logits of each row, set the rest to ``-inf``.

    As Hugging Face's ``TopKLogitsWarper``: an entry is removed when it is smaller than the k-th largest, so
    entries tied with the k-th largest all stay. ``top_k`` larger than V keeps everything.

    Shapes
    ------
    logits : (..., V) float -> (..., V), same dtype (a new array).

    Examples
    --------
    >>> top_k_filter(np.array([1.0, 3.0, 2.0, 3.0]), 2)
    array([-inf,   3.,  -inf,   3.])
    """
    array = _check_logits(logits)
    k = check_top_k(top_k)
    if k == 0:
        raise ValueError("top_k must be positive for top_k_filter (0 means 'no filter' only in generate)")
    k = min(max(k, _check_min_keep(min_tokens_to_keep)), array.shape[-1])
    kth = -np.partition(-array, k - 1, axis=-1)[..., k - 1:k]  # (..., 1), the k-th largest
    return np.where(array < kth, FILTER_VALUE, array).astype(array.dtype, copy=False)


def top_p_filter(logits: np.ndarray, top_p: float, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Nucleus filter: keep the smallest set of most probable tokens whose probabilities add up to ``top_p``.

    As Hugging Face's ``TopPLogitsWarper``: sort ascending, remove the tokens whose cumulative probability
    (from the least probable) is ``<= 1 - top_p``, never the ``min_tokens_to_keep`` most probable.

    Shapes
    ------
    logits : (..., V) float -> (..., V), same dtype (a new array).

    Examples
    --------
    >>> top_p_filter(np.log(np.array([0.5, 0.3, 0.15, 0.05])), 0.7)
    array([-0.69314718, -1.2039728 ,        -inf,        -inf])
    """
    array = _check_logits(logits)
    p = check_unit(top_p, "top_p")
    keep = _check_min_keep(min_tokens_to_keep)
    order = np.argsort(array, axis=-1, kind="stable")  # (..., V) ascending
    sorted_logits = np.take_along_axis(array, order, axis=-1)  # (..., V)
    cumulative = np.cumsum(_softmax(sorted_logits), axis=-1)  # (..., V)
    remove_sorted = cumulative <= (1.0 - p)  # (..., V)
    remove_sorted[..., -keep:] = False
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)  # back to vocabulary order
    return np.where(remove, FILTER_VALUE, array).astype(array.dtype, copy=False)


def min_p_filter(logits: np.ndarray, min_p: float, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Keep the tokens whose probability is at least ``min_p`` times the most probable token's.

    As Hugging Face's ``MinPLogitsWarper`` (the ``min_tokens_to_keep`` most probable always stay).

    Shapes
    ------
    logits : (..., V) float -> (..., V), same dtype (a new array).

    Examples
    --------
    >>> min_p_filter(np.log(np.array([0.5, 0.3, 0.15, 0.05])), 0.2)
    array([-0.69314718, -1.2039728 , -1.89711998,        -inf])
    """
    array = _check_logits(logits)
    threshold = check_unit(min_p, "min_p")
    keep = min(_check_min_keep(min_tokens_to_keep), array.shape[-1])
    probs = _softmax(array)  # (..., V)
    remove = probs < threshold * probs.max(axis=-1, keepdims=True)  # (..., V)
    top = np.argpartition(-probs, keep - 1, axis=-1)[..., :keep]  # (..., keep), the most probable
    np.put_along_axis(remove, top, False, axis=-1)
    return np.where(remove, FILTER_VALUE, array).astype(array.dtype, copy=False)


def warp_logits(logits: np.ndarray, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None) -> np.ndarray:
    """Apply the sampling warpers in Hugging Face's order, each only where it changes something.

    Temperature (when ``!= 1``), then top-k (when not None and ``> 0``), then top-p (when not None and ``< 1``),
    then min-p (when not None). This is what ``generate(do_sample=True, ...)`` samples from.

    Shapes
    ------
    logits : (..., V) float -> (..., V), same dtype (a new array).

    Examples
    --------
    >>> warp_logits(np.array([1.0, 2.0, 3.0]), temperature=0.5, top_k=2)
    array([-inf,   4.,   6.])
    """
    array = _check_logits(logits)
    temperature = check_temperature(temperature)
    if top_k is not None:
        check_top_k(top_k)
    if top_p is not None:
        check_unit(top_p, "top_p")
    if min_p is not None:
        check_unit(min_p, "min_p")
    out = array.copy()
    if temperature != 1.0:
        out = temperature_warp(out, temperature)
    if top_k is not None and top_k > 0:
        out = top_k_filter(out, top_k)
    if top_p is not None and top_p < 1.0:
        out = top_p_filter(out, top_p)
    if min_p is not None:
        out = min_p_filter(out, min_p)
    return out


def sample_tokens(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draw one token per row from ``softmax(logits)`` by inverse-CDF sampling with one uniform per row.

    Tokens of probability zero (``-inf`` logits) are never drawn.

    Shapes
    ------
    logits : (B, V) float -> (B,) int64.

    Examples
    --------
    >>> sample_tokens(np.array([[-np.inf, 0.0, -np.inf]]), np.random.default_rng(0))
    array([1])
    """
    array = _check_logits(logits)
    if array.ndim != 2:
        raise ValueError(f"logits must be (B, V), got shape {array.shape}")
    if np.isnan(array).any():
        rows = np.flatnonzero(np.isnan(array).any(axis=-1)).tolist()
        raise ValueError(f"logits must not be NaN (rows {rows[:5]}): the model produced non-finite scores")
    probs = _softmax(array.astype(np.float64))  # (B, V)
    cdf = np.cumsum(probs, axis=-1)  # (B, V)
    cdf /= cdf[:, -1:]
    u = rng.random(array.shape[0])[:, None]  # (B, 1), in [0, 1)
    # The first index whose cdf exceeds u; a zero-probability token repeats its left neighbour's cdf, so it is
    # skipped.
    return np.minimum((cdf <= u).sum(axis=-1), array.shape[-1] - 1).astype(np.int64)  # (B,)


# -- logits processors (applied before the warpers, greedy or sampled) -------------------------------------
def apply_repetition_penalty(logits: np.ndarray, sequences: np.ndarray, penalty: float,
                             padding: np.ndarray | None = None) -> np.ndarray:
    """Hugging Face's repetition penalty: the logit of every token already in a row is divided by ``penalty``
    where positive and multiplied by it where negative (``penalty > 1`` discourages repeats).

    Every id of ``sequences`` counts, the prompt included, except a row's first ``padding[row]`` columns: its
    left padding, which ``transformers`` (5.x) leaves out (``prompt_ignore_length``, from the attention mask).

    Shapes
    ------
    logits : (B, V) float, sequences : (B, S) int, padding : (B,) int or None -> (B, V), same dtype (a new
    array).

    Examples
    --------
    >>> apply_repetition_penalty(np.array([[2.0, -2.0, 1.0]]), np.array([[0, 1]]), 2.0)
    array([[ 1., -4.,  1.]])
    """
    penalty = check_repetition_penalty(penalty)
    vocab = logits.shape[-1]
    if padding is not None:  # a pad column names the extra id V, dropped below
        sequences = np.where(np.arange(sequences.shape[1])[None] < padding[:, None], vocab, sequences)  # (B, S)
    seen = np.zeros((logits.shape[0], vocab + 1), dtype=bool)  # (B, V + 1)
    np.put_along_axis(seen, sequences, True, axis=-1)
    seen = seen[:, :vocab]  # (B, V)
    # an extreme (but finite, positive) penalty saturates the repeated logits at +-inf, as in transformers
    with np.errstate(over="ignore", divide="ignore"):
        penalised = np.where(logits < 0, logits * penalty, logits / penalty)  # (B, V)
    return np.where(seen, penalised, logits).astype(logits.dtype, copy=False)


def banned_ngram_tokens(sequences: np.ndarray, n: int) -> np.ndarray:
    """Which next tokens would repeat an n-gram already in each row (Hugging Face's ``no_repeat_ngram_size``).

    Shapes
    ------
    sequences : (B, S) int -> (B, V') bool with V' = ``sequences.max() + 1``: True = banned.

    Examples
    --------
    >>> banned_ngram_tokens(np.array([[1, 2, 3, 1, 2]]), 3).nonzero()[1].tolist()
    [3]
    """
    batch, length = sequences.shape
    banned = np.zeros((batch, int(sequences.max()) + 1), dtype=bool)  # (B, V')
    if length + 1 < n or length < n:
        return banned
    windows = np.lib.stride_tricks.sliding_window_view(sequences, n, axis=1)  # (B, S - n + 1, n)
    tail = sequences[:, length - n + 1:]  # (B, n - 1): the n-gram the next token would complete
    match = (windows[:, :, :-1] == tail[:, None, :]).all(axis=-1)  # (B, S - n + 1)
    rows, starts = np.nonzero(match)
    banned[rows, windows[rows, starts, -1]] = True
    return banned


def _ends_with_stop(text: str, before: str, stops: Sequence[str]) -> bool:
    """A stop string occurs in ``text`` and ends inside what its last token added to ``before`` (the same
    tokens less the last). ``before`` may end in replacement characters for the first bytes of a character that
    the last token completes: those are not text it had, so the search starts before them."""
    settled = len(before.rstrip("\ufffd"))
    return any(text.find(stop, max(0, settled - len(stop) + 1)) >= 0 for stop in stops)


# -- decoding ----------------------------------------------------------------------------------------------
def _config_value(model: Any, name: str) -> Any:
    return getattr(getattr(model, "config", None), name, None)


def _config_token(model: Any, name: str) -> Any:
    """The special token ``name`` (``"eos"``, ``"pad"``) of the model's config's ``tokens`` part, or None."""
    return getattr(_config_value(model, "tokens"), name, None)


def _token_set(value: Any, name: str, vocab: int | None, *, single: bool = False) -> tuple[int, ...]:
    """Token ids given as one id or a sequence of ids (``single``: exactly one), each in [0, vocab); an empty
    sequence means none (``eos_token_id=[]`` turns stopping at eos off)."""
    if value is None:
        return ()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]  # a 0-d array is one id
    one = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    items = [value] if one else value
    expected = "a token id" if single else "a token id or a sequence of them"
    if (not isinstance(items, (Sequence, np.ndarray)) or isinstance(items, (str, bytes)) or (single and not one)
            or not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in items)):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    bound = "" if vocab is None else f", {vocab}"
    bad = [int(t) for t in items if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f"{name} must be a token id in [0{bound}), got {bad[0]}")
    return tuple(int(t) for t in items)


def _check_prompt(model: Any, input_ids: Any, attention_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    ids = as_array(input_ids, "input_ids")
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0 or (ids.dtype.kind not in "iu" and ids.size):
        raise ValueError(f"input_ids must be a non-empty integer array (B, L), got dtype {ids.dtype} and shape "
                         f"{ids.shape}")
    vocab = _config_value(model, "vocab_size")
    if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"input_ids must be token ids in [0, {vocab}), got values in [{ids.min()}, {ids.max()}]")
    if attention_mask is None:
        return ids.astype(np.int64), np.ones(ids.shape, dtype=bool)
    mask = np.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {ids.shape}, got {mask.shape}")
    if mask.dtype != bool:
        if mask.dtype.kind not in "iu" or not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must be boolean or hold only 0 and 1 (1 = real token)")
        mask = mask.astype(bool)
    if not mask[:, -1].all():
        rows = np.flatnonzero(~mask[:, -1]).tolist()
        raise ValueError(f"attention_mask must be left-padded (the last column real in every row) for "
                         f"generation; rows {rows} end with padding")
    return ids.astype(np.int64), mask


def _rng(seed: Any) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is None:
        return np.random.default_rng()
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, a numpy Generator or None, got {seed!r}")
    return np.random.default_rng(int(seed))


_OPTIONS = tuple(f.name for f in dataclasses.fields(GenerationConfig))


def _resolve(model: Any, given: dict[str, Any], generation_config: GenerationConfig | None = None) -> dict[str, Any]:
    """Each option: the argument if given, else ``generation_config``'s (default: the model's), as a dict."""
    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if base is None:
        base = GenerationConfig()
    elif isinstance(base, Mapping):
        base = GenerationConfig.from_dict(base)
    elif not isinstance(base, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(base).__name__}")
    options = dataclasses.asdict(base.updated(**{k: v for k, v in given.items() if k in _OPTIONS}))
    if options["stop_strings"] is not None:
        options["stop_strings"] = list(options["stop_strings"])
    return options


def resolve_generation_options(model: Any, **given: Any) -> dict[str, Any]:
    """The options :func:`generate` would use: each keyword given (not None), else the model's
    ``generation_config`` value, else the default; what a front end shows as its settings.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> lm = SimpleNamespace(generation_config={"do_sample": True, "temperature": 0.7})
    >>> o = resolve_generation_options(lm, top_k=20)
    >>> o["do_sample"], o["temperature"], o["top_k"], o["top_p"]
    (True, 0.7, 20, None)
    """
    unknown = sorted(set(given) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"resolve_generation_options() got an unexpected keyword argument {unknown[0]!r}")
    return _resolve(model, given)


def check_generation_config(config: Mapping[str, Any], vocab_size: int | None = None) -> GenerationConfig:
    """A model folder's ``generation_config.json`` as the :class:`GenerationConfig` it gives :func:`generate`,
    checked as ``generate`` checks its arguments (and its eos, pad and bos ids against ``vocab_size``), so that a
    folder whose defaults would be refused is refused when it loads.

    Raises
    ------
    ValueError, TypeError
        Naming the key and what it held (e.g. ``temperature must be a finite positive number, got -1``).
    """
    options = GenerationConfig.from_dict(config)
    _token_set(options.eos_token_id, "eos_token_id", vocab_size)
    _token_set(options.pad_token_id, "pad_token_id", vocab_size, single=True)
    _token_set(config.get("bos_token_id"), "bos_token_id", vocab_size, single=True)  # not generate's, but a token
    return options


def _check_tokenizer(o: dict[str, Any], tokenizer: Any) -> None:
    if o["stop_strings"] is not None and (tokenizer is None or not callable(getattr(tokenizer, "decode", None))):
        raise ValueError("stop_strings needs tokenizer= (the model's tokenizer, to read the generated text)")


def _setup(model: Any, input_ids: Any, attention_mask: Any, given: dict[str, Any], tokenizer: Any, seed: Any,
           generation_config: GenerationConfig | None = None):
    """Every option resolved (argument, else ``generation_config``, else default) and checked, and the
    prompt: ``(options, ids (B, L), mask (B, L), eos ids (E,), pad id or None, max_new_tokens, rng)``."""
    o = _resolve(model, given, generation_config)
    ids, mask = _check_prompt(model, input_ids, attention_mask)
    _check_tokenizer(o, tokenizer)
    rng = _rng(seed)
    vocab = _config_value(model, "vocab_size")
    eos = _token_set(_config_token(model, "eos") if o["eos_token_id"] is None else o["eos_token_id"],
                     "eos_token_id", vocab)
    pad = o["pad_token_id"]
    if pad is None:
        pad = _config_token(model, "pad")
    if pad is None and eos:
        pad = eos[0]  # as Hugging Face: pad finished rows with the (first) eos
    if pad is not None:
        pad = _token_set(pad, "pad_token_id", vocab, single=True)[0]
    max_new = int(o["max_new_tokens"])
    limit = getattr(model, "max_sequence_length", None)  # the model says how long a sequence it can run
    if limit is not None and ids.shape[1] + max_new > limit:
        raise ValueError(f"the prompt ({ids.shape[1]} tokens) plus max_new_tokens ({max_new}) exceeds the "
                         f"model's {limit} learned positions")
    return o, ids, mask, np.array(eos, dtype=np.int64), pad, max_new, rng


def _given(options: dict[str, Any], function: str) -> dict[str, Any]:
    """The generation options of a call (each a :class:`GenerationConfig` field), refusing any other name as
    Python refuses an unexpected keyword argument."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r} (the generation options "
                        f"are GenerationConfig's fields: {', '.join(_OPTIONS)})")
    return options


def generate_stream(model: Any, input_ids: Any, attention_mask: Any = None, *,
                    generation_config: GenerationConfig | None = None, tokenizer: Any = None, seed: Any = None,
                    past_key_values: Any = None, assistant_model: Any = None,
                    **options: Any) -> Iterator[np.ndarray]:
    """Generate token by token: an iterator over each step's new tokens, one per row.

    Takes the arguments of :func:`generate` and checks them all before returning (the iterator itself does
    no checking). It yields at most ``max_new_tokens`` arrays and stops early once every row is done. It
    decodes greedily or by sampling, never by beam search (beams settle their tokens only at the end), so a
    ``num_beams`` in ``generation_config`` is not used here.

    Shapes
    ------
    Yields (B * num_return_sequences,) int64 per step: row b's new token, or ``pad_token_id`` once row b has
    produced an eos or a stop string.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> lm = CausalLM(DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
    ...                             num_kv_heads=1, head_dim=4, mlp=MLPConfig(12)), rng=0)
    >>> steps = list(generate_stream(lm, [[1, 2, 3]], max_new_tokens=4))
    >>> len(steps), steps[0].shape, steps[0].dtype
    (4, (1,), dtype('int64'))
    """
    if options.get("num_beams") not in (None, 1):
        raise ValueError(f"generate_stream cannot run beam search (num_beams={options['num_beams']!r}): beams "
                         f"settle their tokens only at the end; use generate")
    given = dict(_given(options, "generate_stream"), num_beams=1, length_penalty=None, early_stopping=None)
    o, ids, mask, eos, pad, max_new, rng = _setup(model, input_ids, attention_mask, given, tokenizer, seed,
                                                  generation_config)
    if o["num_return_sequences"] > 1:  # each prompt row repeated, as Hugging Face's repeat_interleave
        ids = np.repeat(ids, o["num_return_sequences"], axis=0)  # (B * n, L)
        mask = np.repeat(mask, o["num_return_sequences"], axis=0)  # (B * n, L)
    sampling = dict(temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"], min_p=o["min_p"]) \
        if o["do_sample"] else None
    processing = dict(repetition_penalty=o["repetition_penalty"], no_repeat_ngram_size=o["no_repeat_ngram_size"],
                      min_new_tokens=o["min_new_tokens"], stop_strings=o["stop_strings"], tokenizer=tokenizer,
                      padding=left_padding(mask))
    proposer = _proposer(model, o, assistant_model)
    cache = None if past_key_values is None else crop_to_prefix(past_key_values, ids)
    return _decode(model, ids, mask, max_new, sampling, processing, rng, eos, pad, cache=cache, proposer=proposer)


def _proposer(model: Any, o: dict[str, Any], assistant_model: Any) -> Proposer | None:
    """The draft source the options ask for (prompt lookup, a draft model, the model's first layers), or None."""
    vocab = _config_value(model, "vocab_size")
    asked = [name for name, value in (("prompt_lookup_num_tokens", o["prompt_lookup_num_tokens"]),
                                      ("assistant_model", assistant_model),
                                      ("assistant_early_exit", o["assistant_early_exit"])) if value is not None]
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(asked)} are ways of drafting for speculative decoding: give one")
    if not asked:
        return None
    if getattr(model, "reprefill_length", None) is not None:
        raise ValueError("speculative decoding is not supported for a model whose rotary tables change with the "
                         "sequence's length (longrope): a draft could cross the change")
    if o["prompt_lookup_num_tokens"] is not None:
        return PromptLookup(o["prompt_lookup_num_tokens"], o["max_matching_ngram_size"] or 2)
    if isinstance(assistant_model, Proposer):
        return assistant_model
    if callable(getattr(assistant_model, "draft", None)) and getattr(assistant_model, "model", None) is not None:
        if assistant_model.model is not model:
            raise ValueError("assistant_model is the multi-token-prediction layers of another model: they read "
                             "the final hidden states of the model they were loaded for")
        return MultiTokenDraft(assistant_model)
    if assistant_model is None:
        early_exit = getattr(model, "early_exit", None)
        if early_exit is None:
            raise TypeError(f"assistant_early_exit needs a model with early_exit (a CausalLM), got "
                            f"{type(model).__name__}")
        assistant_model = early_exit(o["assistant_early_exit"])
    elif not callable(getattr(assistant_model, "forward", None)) or not callable(getattr(assistant_model, "new_cache",
                                                                                          None)):
        raise TypeError(f"assistant_model must be a causal LM (forward and new_cache), got "
                        f"{type(assistant_model).__name__}")
    return DraftModel(assistant_model, o["num_assistant_tokens"], vocab_size=vocab,
                      draft_cost=draft_step_cost(assistant_model, model))


def left_padding(mask: np.ndarray) -> np.ndarray:
    """Each row's columns before its first real token (B,) int64 (0 for a row without one), as ``transformers``
    counts them: ``argmax(mask != 0)``."""
    return np.argmax(mask != 0, axis=1).astype(np.int64)


def _process(logits: np.ndarray, sequences: np.ndarray, step: int, eos: np.ndarray, *,
             repetition_penalty: float | None, no_repeat_ngram_size: int | None, min_new_tokens: int | None,
             padding: np.ndarray | None = None, **_: Any) -> np.ndarray:
    """Hugging Face's logits processors in its order: repetition penalty (``padding``: each row's left padding,
    which it leaves out), no-repeat n-grams, min new tokens."""
    if repetition_penalty is not None and repetition_penalty != 1.0:
        if padding is not None and padding.shape[0] != sequences.shape[0]:  # beams: each prompt's K rows
            padding = np.repeat(padding, sequences.shape[0] // padding.shape[0])  # (B*K,)
        logits = apply_repetition_penalty(logits, sequences, repetition_penalty, padding)
    if no_repeat_ngram_size:
        banned = banned_ngram_tokens(sequences, no_repeat_ngram_size)  # (B, V')
        width = min(banned.shape[1], logits.shape[1])
        logits = logits.copy()
        logits[:, :width][banned[:, :width]] = FILTER_VALUE
    if min_new_tokens and step < min_new_tokens and eos.size:
        logits = logits.copy()
        logits[:, eos] = FILTER_VALUE
    return logits


def speculative_sample(logits: np.ndarray, drafts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row from ``softmax(logits)``, given a draft token per row: the draft ``d`` is kept with
    probability ``p(d)``, otherwise the token is drawn from ``p`` without ``d`` (renormalised). The token's
    distribution is ``p`` exactly (speculative sampling's accept rule for a proposal that is ``d`` for sure).

    Shapes
    ------
    logits : (B, V); drafts : (B,) int -> (B,) int64.
    """
    probs = _softmax(_check_logits(logits).astype(np.float64))  # (B, V)
    rows = np.arange(probs.shape[0])
    kept = rng.random(probs.shape[0]) < probs[rows, drafts]  # (B,)
    rest = probs.copy()
    rest[rows, drafts] = 0.0
    total = rest.sum(axis=-1, keepdims=True)  # (B, 1): 0 only where p(d) = 1, and then d is always kept
    cdf = np.cumsum(rest / np.where(total > 0, total, 1.0), axis=-1)  # (B, V)
    drawn = np.minimum((cdf <= rng.random(probs.shape[0])[:, None]).sum(axis=-1), probs.shape[1] - 1)  # (B,)
    return np.where(kept, drafts, drawn).astype(np.int64)


class _Rows:
    """The rows being decoded: their ids and mask so far, which are done, and how each next token is chosen."""

    def __init__(self, ids, mask, sampling, processing, rng, eos, pad):
        self.sequences, self.mask = ids, mask  # (B, T) each
        self.sampling, self.processing, self.rng, self.eos, self.pad = sampling, processing, rng, eos, pad
        self.done = np.zeros(ids.shape[0], dtype=bool)  # (B,)
        stops = processing["stop_strings"]
        # Tokens enough to hold a stop string: a token adds at least one byte, so its UTF-8 length in tokens (a
        # character may be split over several), and one more whose text is only the context before it.
        self.stop_window = max(len(t.encode("utf-8")) for t in stops) + 1 if stops else 0
        self.produced = 0

    def choose(self, logits: np.ndarray, draft: np.ndarray | None) -> np.ndarray:
        """The next token of every row (B,) from its logits (B, V), given the draft token (B,) if any."""
        logits = _process(logits.astype(np.float32, copy=False), self.sequences, self.produced, self.eos,
                          **self.processing)  # (B, V)
        if self.sampling is None:
            tokens = np.argmax(logits, axis=-1).astype(np.int64)  # (B,)
        elif draft is None:
            tokens = sample_tokens(warp_logits(logits, **self.sampling), self.rng)  # (B,)
        else:
            tokens = speculative_sample(warp_logits(logits, **self.sampling), draft, self.rng)  # (B,)
        return tokens if self.pad is None else np.where(self.done, self.pad, tokens)  # (B,)

    def append(self, tokens: np.ndarray) -> None:
        """Add a token to every row and note the rows it ends (an eos, a stop string)."""
        self.sequences = np.concatenate([self.sequences, tokens[:, None]], axis=1)  # (B, T + 1)
        self.mask = np.concatenate([self.mask, np.ones((tokens.shape[0], 1), bool)], axis=1)  # (B, T + 1)
        finished = np.isin(tokens, self.eos)  # (B,)
        stops, tokenizer = self.processing["stop_strings"], self.processing["tokenizer"]
        if stops:
            for b in np.flatnonzero(~self.done & ~finished):  # one short decode per open row
                window = self.sequences[b, -self.stop_window:].tolist()
                finished[b] = _ends_with_stop(tokenizer.decode(window), tokenizer.decode(window[:-1]), stops)
        self.done |= finished
        self.produced += 1


def _decode(model: Any, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int, sampling: dict | None,
            processing: dict, rng: np.random.Generator, eos: np.ndarray, pad_token_id: int | None, *,
            cache: Any = None, proposer: Proposer | None = None) -> Iterator[np.ndarray]:
    """Decode in rounds: each feeds what the cache lacks (the prompt, then the last token) and any draft in one
    forward, then keeps the drafts the model agrees with and its own next token (see
    :mod:`attnkit.decoding.speculative`). The cache holds exactly the ids fed and kept."""
    if max_new_tokens == 0:
        return
    batch, length = ids.shape
    reused = cache is not None
    if cache is None:
        bound = length + max_new_tokens + (MAX_DRAFT_TOKENS if proposer is not None else 0)
        cache = model.new_cache(batch, max_length=bound) if proposer is None else \
            model.new_cache(batch, max_length=bound, rollback=MAX_DRAFT_TOKENS)
    rows = _Rows(ids, mask, sampling, processing, rng, eos, pad_token_id)
    switch = getattr(model, "reprefill_length", None)  # the model says when its cached keys go stale
    marking = reused and getattr(cache, "needs_marks", False)
    if marking and ids.shape[1] - cache.length > 1:
        # the next call may share this prompt: keep the state at its end (a turn boundary) to go back to
        model.forward(ids[:, cache.length:-1], mask[:, :-1], cache=cache, logits_to_keep=1)
        cache.mark()
    try:
        yield from _rounds(model, cache, rows, proposer, switch, batch, length, max_new_tokens)
    finally:
        if marking:
            cache.mark()  # and where the reply ended, should the next prompt share all of it


def _rounds(model, cache, rows: _Rows, proposer: Proposer | None, switch: int | None, batch: int, length: int,
            max_new_tokens: int) -> Iterator[np.ndarray]:
    """The decoding rounds of :func:`_decode` (see there), yielding each new token (B,)."""
    while True:
        if switch is not None and rows.sequences.shape[1] > switch >= cache.length > 0:
            # the rotation of every cached key changes here: run the whole sequence again, once
            cache = model.new_cache(batch, max_length=length + max_new_tokens)
        start = cache.length
        pending = rows.sequences[:, start:]  # (B, P): what the cache lacks, at least the last token
        drafts = None
        left = max_new_tokens - rows.produced - 1  # tokens a draft could still usefully add
        if proposer is not None and left > 0:
            drafts = proposer.propose(rows.sequences, rows.mask)
            drafts = None if drafts is None else drafts[:, :min(left, MAX_DRAFT_TOKENS)]  # (B, K)
        if drafts is not None and getattr(cache, "needs_marks", False):
            cache.mark()  # a recurrent state cannot forget a rejected draft: keep the state before it
        feed = pending if drafts is None else np.concatenate([pending, drafts], axis=1)  # (B, P + K)
        count = feed.shape[1] - pending.shape[1]
        feed_mask = np.concatenate([rows.mask, np.ones((batch, count), bool)], axis=1)  # (B, T + K)
        if proposer is not None and proposer.reads_hidden:
            logits, hidden = model.forward(feed, feed_mask, cache=cache, logits_to_keep=count + 1,
                                           return_hidden=True)  # (B, K + 1, V), (B, P + K, D)
            proposer.observe(hidden, start)
        else:
            logits = _logits(model, feed, feed_mask, cache, count + 1)  # (B, K + 1, V): after the last pending
            # token and after each draft
        kept = 0
        for i in range(count + 1):
            draft = drafts[:, i] if i < count else None
            open_rows = ~rows.done
            tokens = rows.choose(logits[:, i], draft)  # (B,)
            rows.append(tokens)
            yield tokens.copy()  # the caller's own array: editing it must not change what the model reads next
            if rows.done.all() or rows.produced == max_new_tokens:
                return
            if draft is None or (tokens[open_rows] != draft[open_rows]).any():
                break
            kept += 1
        if drafts is not None:
            proposer.accepted(kept, count)
        valid = start + pending.shape[1] + kept  # the fed ids the rows kept
        if valid < cache.length:
            cache.crop(valid if cache.can_crop(valid) else start)


def _logits(model: Any, ids: np.ndarray, mask: np.ndarray, cache: Any, keep: int) -> np.ndarray:
    """The logits (B, keep, V) of the last ``keep`` positions of ``ids`` fed through ``cache``."""
    if keep == 1:
        return next_token_logits(model, ids, mask, cache)[:, None]  # (B, 1, V)
    return model.forward(ids, mask, cache=cache, logits_to_keep=keep)  # (B, keep, V)


def generate(model: Any, input_ids: Any, attention_mask: Any = None, *,
             generation_config: GenerationConfig | None = None, tokenizer: Any = None, seed: Any = None,
             past_key_values: Any = None, assistant_model: Any = None, progress: bool | None = None,
             **options: Any) -> np.ndarray:
    """Continue each prompt row by up to ``max_new_tokens`` tokens, greedily, by sampling or by beam search.

    Arguments have Hugging Face's names and meanings. Each generation option (a field of
    :class:`~attnkit.decoding.config.GenerationConfig`, which documents them all: ``max_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``min_new_tokens``, ``stop_strings``, ``num_return_sequences``, ``eos_token_id``,
    ``pad_token_id``, ``num_beams``, ``length_penalty``, ``early_stopping``, ``prompt_lookup_num_tokens``,
    ``max_matching_ngram_size``, ``num_assistant_tokens``, ``assistant_early_exit``) left out or None takes the
    value of ``generation_config`` (by default the model's: the folder's ``generation_config.json``, read by
    the pretrained loader), else its default.

    Parameters
    ----------
    model : CausalLM
        Anything with ``forward(input_ids, attention_mask, cache=)`` -> logits (B, L, V) and
        ``new_cache(batch_size, max_length=)``; its ``config`` supplies defaults for the special tokens.
    input_ids : int array (B, L)
        Prompts, left-padded to a common length.
    attention_mask : bool or 0/1 array (B, L), optional
        ``True``/1 = real token; padding must be on the left. Default: every token real.
    generation_config : GenerationConfig, optional
        The defaults the options replace (default: ``model.generation_config``, else :class:`GenerationConfig`'s).
    tokenizer : Tokenizer, optional
        Anything with ``decode(ids)``, e.g. :func:`attnkit.pretrained.load_tokenizer`'s; for ``stop_strings``.
    seed : int or numpy.random.Generator, optional
        The same seed gives the same samples.
    past_key_values : ModelCache, optional
        A cache of this model (``model.new_cache(B)``) that earlier calls filled: it is cropped to the longest
        prefix of ``input_ids`` it holds and can go back to (any length for attention layers; a marked one for
        recurrent states, see :meth:`~attnkit.decoding.cache.ModelCache.mark`), only the rest is prefilled, and it
        is left holding the prompt and the new tokens (all but the last). Not with beam search.
    assistant_model : CausalLM or Proposer, optional
        A draft model with the same tokenizer, for speculative decoding
        (:class:`~attnkit.decoding.speculative.DraftModel`), or a
        :class:`~attnkit.decoding.speculative.Proposer` of one's own (its ``proposed`` and ``kept`` counts tell
        the acceptance rate afterwards).
    progress : bool or None, default None
        A line on stderr counting the steps (:mod:`attnkit._progress`; not one of Hugging Face's arguments):
        None shows it when stderr is a terminal, True always, False never.
    **options
        The generation options above.

    Returns
    -------
    int64 array (B * num_return_sequences, L + T)
        The prompt followed by the T <= ``max_new_tokens`` generated tokens (T is smaller when every row
        finished early).

    Raises
    ------
    ValueError, TypeError
        Any argument out of range or of the wrong type, naming it; an unknown option name.

    Shapes
    ------
    input_ids (B, L), attention_mask (B, L) -> (B * num_return_sequences, L + T).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> lm = CausalLM(DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
    ...                             num_kv_heads=1, head_dim=4, mlp=MLPConfig(12)), rng=0)
    >>> out = generate(lm, [[1, 2, 3]], max_new_tokens=5, do_sample=True, top_k=4, seed=0)
    >>> out.shape, bool((out == generate(lm, [[1, 2, 3]], max_new_tokens=5, do_sample=True, top_k=4,
    ...                                   seed=0)).all())
    ((1, 8), True)
    >>> generate(lm, [[1, 2, 3]], max_new_tokens=6, no_repeat_ngram_size=1)[0, 3:].tolist()  # no id repeats
    [15, 11, 7, 4, 9, 13]
    >>> greedy = generate(lm, [[1, 2, 3, 1, 2]], max_new_tokens=8)
    >>> bool((generate(lm, [[1, 2, 3, 1, 2]], max_new_tokens=8, prompt_lookup_num_tokens=4) == greedy).all())
    True
    """
    given = _given(options, "generate")
    _progress.check_progress(progress)
    copies = _resolve(model, given, generation_config)
    if copies["num_beams"] > 1:
        if past_key_values is not None or assistant_model is not None:
            raise ValueError("beam search (num_beams > 1) takes neither past_key_values nor assistant_model")
        return _beam_generate(model, input_ids, attention_mask, given, tokenizer, seed, generation_config, progress)
    stream = generate_stream(model, input_ids, attention_mask, generation_config=generation_config,
                             tokenizer=tokenizer, seed=seed, past_key_values=past_key_values,
                             assistant_model=assistant_model, **given)
    prompt = np.repeat(np.asarray(input_ids).astype(np.int64), copies["num_return_sequences"], axis=0)  # (B*n, L)
    steps = []
    with _progress.progress(copies["max_new_tokens"], "generating", unit="token", enabled=progress) as line:
        for tokens in stream:
            steps.append(tokens)
            line.update()
    if not steps:
        return prompt.copy()
    return np.concatenate([prompt, np.stack(steps, axis=1)], axis=1)  # (B * n, L + T)


def _beam_generate(model: Any, input_ids: Any, attention_mask: Any, given: dict[str, Any], tokenizer: Any,
                   seed: Any, generation_config: GenerationConfig | None, progress: bool | None) -> np.ndarray:
    o, ids, mask, eos, pad, max_new, _ = _setup(model, input_ids, attention_mask, given, tokenizer, seed,
                                                generation_config)
    if max_new == 0:
        return ids.copy()
    processing = dict(repetition_penalty=o["repetition_penalty"], no_repeat_ngram_size=o["no_repeat_ngram_size"],
                      min_new_tokens=o["min_new_tokens"], padding=left_padding(mask))

    with _progress.progress(max_new, "beam search", unit="step", enabled=progress) as line:

        def process(log_probs: np.ndarray, sequences: np.ndarray, step: int) -> np.ndarray:
            line.update()  # called once per step, after the step's forward
            return _process(log_probs, sequences, step, eos, **processing)

        return lm_beam_search(model, ids, mask, num_beams=o["num_beams"], max_new_tokens=max_new, eos=eos,
                              pad_token_id=pad, length_penalty=o["length_penalty"],
                              early_stopping=o["early_stopping"], num_return_sequences=o["num_return_sequences"],
                              process=process)
