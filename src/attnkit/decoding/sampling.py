"""Text generation for causal language models: logits warpers, greedy and sampled decoding, streaming.

Decoding follows Hugging Face's ``generate`` (``do_sample`` with ``num_beams=1``): the prompt runs through the
model once (prefill) into a :class:`~attnkit.decoding.cache.KVCache`, then each step feeds the one new token per row.
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

from .._validation import as_array, check_positive_int
from .beam_search import lm_beam_search, next_token_logits
from .config import GenerationConfig, check_repetition_penalty, check_temperature, check_top_k, check_unit

__all__ = ["check_generation_config", "resolve_generation_options",
           "temperature_warp", "top_k_filter", "top_p_filter", "min_p_filter", "warp_logits", "sample_tokens",
           "apply_repetition_penalty", "banned_ngram_tokens", "generate", "generate_stream"]

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
    checked as ``generate`` checks its arguments (and its eos and pad ids against ``vocab_size``), so that a
    folder whose defaults would be refused is refused when it loads.

    Raises
    ------
    ValueError, TypeError
        Naming the key and what it held (e.g. ``temperature must be a finite positive number, got -1``).
    """
    options = GenerationConfig.from_dict(config)
    _token_set(options.eos_token_id, "eos_token_id", vocab_size)
    _token_set(options.pad_token_id, "pad_token_id", vocab_size, single=True)
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
    eos = _token_set(_config_value(model, "eos_token_id") if o["eos_token_id"] is None else o["eos_token_id"],
                     "eos_token_id", vocab)
    pad = o["pad_token_id"]
    if pad is None:
        pad = _config_value(model, "pad_token_id")
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


def generate_stream(model: Any, input_ids: Any, attention_mask: Any = None, *,
                    generation_config: GenerationConfig | None = None, max_new_tokens: int | None = None,
                    do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, min_p: float | None = None,
                    repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                    min_new_tokens: int | None = None, stop_strings: str | Sequence[str] | None = None,
                    tokenizer: Any = None, num_return_sequences: int | None = None, seed: Any = None,
                    eos_token_id: Any = None, pad_token_id: int | None = None) -> Iterator[np.ndarray]:
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
    >>> from attnkit.models import CausalLM, DecoderConfig
    >>> lm = CausalLM(DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
    ...                             num_kv_heads=1, head_dim=4, intermediate_size=12), rng=0)
    >>> steps = list(generate_stream(lm, [[1, 2, 3]], max_new_tokens=4))
    >>> len(steps), steps[0].shape, steps[0].dtype
    (4, (1,), dtype('int64'))
    """
    o, ids, mask, eos, pad, max_new, rng = _setup(
        model, input_ids, attention_mask, dict(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
            min_new_tokens=min_new_tokens, stop_strings=stop_strings, num_return_sequences=num_return_sequences,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, num_beams=1, length_penalty=None,
            early_stopping=None), tokenizer, seed, generation_config)
    if o["num_return_sequences"] > 1:  # each prompt row repeated, as Hugging Face's repeat_interleave
        ids = np.repeat(ids, o["num_return_sequences"], axis=0)  # (B * n, L)
        mask = np.repeat(mask, o["num_return_sequences"], axis=0)  # (B * n, L)
    sampling = dict(temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"], min_p=o["min_p"]) \
        if o["do_sample"] else None
    processing = dict(repetition_penalty=o["repetition_penalty"], no_repeat_ngram_size=o["no_repeat_ngram_size"],
                      min_new_tokens=o["min_new_tokens"], stop_strings=o["stop_strings"], tokenizer=tokenizer,
                      padding=left_padding(mask))
    return _decode(model, ids, mask, max_new, sampling, processing, rng, eos, pad)


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


def _decode(model: Any, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int, sampling: dict | None,
            processing: dict, rng: np.random.Generator, eos: np.ndarray, pad_token_id: int | None
            ) -> Iterator[np.ndarray]:
    if max_new_tokens == 0:
        return
    batch, length = ids.shape
    cache = model.new_cache(batch, max_length=length + max_new_tokens)
    logits = next_token_logits(model, ids, mask, cache)  # (B, V): prefill once
    sequences = ids  # (B, L + step): what the processors and stop strings read
    stops, tokenizer = processing["stop_strings"], processing["tokenizer"]
    # Tokens enough to hold a stop string: a token adds at least one byte, so its UTF-8 length in tokens (a
    # character may be split over several), and one more whose text is only the context before it.
    stop_window = max(len(t.encode("utf-8")) for t in stops) + 1 if stops else 0
    done = np.zeros(batch, dtype=bool)  # (B,)
    switch = getattr(model, "reprefill_length", None)  # the model says when its cached keys go stale
    for step in range(max_new_tokens):
        logits = _process(logits.astype(np.float32, copy=False), sequences, step, eos, **processing)  # (B, V)
        if sampling is None:
            tokens = np.argmax(logits, axis=-1).astype(np.int64)  # (B,)
        else:
            tokens = sample_tokens(warp_logits(logits, **sampling), rng)  # (B,)
        if pad_token_id is not None:
            tokens = np.where(done, pad_token_id, tokens)  # (B,)
        sequences = np.concatenate([sequences, tokens[:, None]], axis=1)  # (B, L + step + 1)
        finished = np.isin(tokens, eos)  # (B,)
        if stops:
            for b in np.flatnonzero(~done & ~finished):  # a decoding step: one short decode per open row
                window = sequences[b, -stop_window:].tolist()
                finished[b] = _ends_with_stop(tokenizer.decode(window), tokenizer.decode(window[:-1]), stops)
        done |= finished
        yield tokens.copy()  # the caller's own array: editing it must not change what the model reads next
        if done.all() or step == max_new_tokens - 1:
            return
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=bool)], axis=1)  # (B, L + step + 1)
        if switch is not None and sequences.shape[1] > switch >= cache.length:
            # the rotation of every cached key changes here: run the whole sequence again, once
            cache = model.new_cache(batch, max_length=length + max_new_tokens)
            logits = next_token_logits(model, sequences, mask, cache)  # (B, V)
        else:
            logits = next_token_logits(model, tokens[:, None], mask, cache)  # (B, V)


def generate(model: Any, input_ids: Any, attention_mask: Any = None, *,
             generation_config: GenerationConfig | None = None, max_new_tokens: int | None = None,
             do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
             no_repeat_ngram_size: int | None = None, min_new_tokens: int | None = None,
             stop_strings: str | Sequence[str] | None = None, tokenizer: Any = None,
             num_return_sequences: int | None = None, seed: Any = None, eos_token_id: Any = None,
             pad_token_id: int | None = None, num_beams: int | None = None, length_penalty: float | None = None,
             early_stopping: bool | str | None = None) -> np.ndarray:
    """Continue each prompt row by up to ``max_new_tokens`` tokens, greedily, by sampling or by beam search.

    Arguments have Hugging Face's names and meanings. Each one left as None takes the value of
    ``generation_config`` (by default the model's: the folder's ``generation_config.json``, read by the
    pretrained loader), else :class:`~attnkit.decoding.config.GenerationConfig`'s default shown.

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
        The defaults the arguments below replace (default: ``model.generation_config``, the folder's
        ``generation_config.json`` as the pretrained loader read it, else :class:`GenerationConfig`'s defaults).
    max_new_tokens : int, default 20
    do_sample : bool, default False
        False: argmax of the processed logits (the warpers are checked but not applied); True: sample from
        the warped logits.
    temperature : float, default 1.0
    top_k : int, optional
        Keep the k most likely tokens (0 or None: no filter).
    top_p : float in [0, 1], optional
        Nucleus filter (1 or None: no filter).
    min_p : float in [0, 1], optional
        Keep tokens at least ``min_p`` times as likely as the most likely one.
    repetition_penalty : float > 0, optional
        Divide positive (multiply negative) logits of every token already in the row, prompt included
        (1 or None: off).
    no_repeat_ngram_size : int, optional
        Never produce an n-gram of this size that the row already holds (0 or None: off).
    min_new_tokens : int, optional
        The eos tokens are banned until this many tokens are generated.
    stop_strings : str or list of str, optional
        A row is done once its text ends in one of them (the stop string ends inside the last token, as in
        Hugging Face). Needs ``tokenizer``.
    tokenizer : Tokenizer, optional
        Anything with ``decode(ids)``, e.g. :func:`attnkit.pretrained.load_tokenizer`'s; for ``stop_strings``.
    num_return_sequences : int, default 1
        Sampled continuations per prompt row (needs ``do_sample``), or with beam search the ``n <= num_beams``
        best finished hypotheses, best first; the rows of the output are ``n`` consecutive continuations of
        prompt 0, then of prompt 1, ...
    seed : int or numpy.random.Generator, optional
        The same seed gives the same samples.
    eos_token_id : int or sequence of int, optional
        Tokens that end a row; default ``model.config.eos_token_id``; an empty sequence never stops early.
    pad_token_id : int, optional
        What a finished row produces; default ``model.config.pad_token_id``, else the first eos.
    num_beams : int, default 1
        Above 1: beam search as ``transformers`` runs it (:func:`attnkit.decoding.beam_search.lm_beam_search`),
        with the logits processors applied to the log-probabilities; not with ``do_sample`` or
        ``stop_strings``.
    length_penalty : float, default 1.0
        A finished hypothesis scores ``sum of log-probabilities / new_tokens ** length_penalty``.
    early_stopping : {False, True, "never"}, default False
        ``True``: stop once every row has ``num_beams`` finished hypotheses; ``False``: once no open beam can
        beat the worst finished one at its current length; ``"never"``: only when that holds at the longest
        length (with ``length_penalty > 0``), which makes the search exact up to pruning.

    Returns
    -------
    int64 array (B * num_return_sequences, L + T)
        The prompt followed by the T <= ``max_new_tokens`` generated tokens (T is smaller when every row
        finished early).

    Raises
    ------
    ValueError, TypeError
        Any argument out of range or of the wrong type, naming it.

    Shapes
    ------
    input_ids (B, L), attention_mask (B, L) -> (B * num_return_sequences, L + T).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig
    >>> lm = CausalLM(DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
    ...                             num_kv_heads=1, head_dim=4, intermediate_size=12), rng=0)
    >>> out = generate(lm, [[1, 2, 3]], max_new_tokens=5, do_sample=True, top_k=4, seed=0)
    >>> out.shape, bool((out == generate(lm, [[1, 2, 3]], max_new_tokens=5, do_sample=True, top_k=4,
    ...                                   seed=0)).all())
    ((1, 8), True)
    >>> generate(lm, [[1, 2, 3]], max_new_tokens=6, no_repeat_ngram_size=1)[0, 3:].tolist()  # no id repeats
    [15, 11, 7, 4, 9, 13]
    """
    given = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                 top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                 no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens, stop_strings=stop_strings,
                 num_return_sequences=num_return_sequences, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                 num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
    copies = _resolve(model, given, generation_config)
    if copies["num_beams"] > 1:
        return _beam_generate(model, input_ids, attention_mask, given, tokenizer, seed, generation_config)
    stream = generate_stream(model, input_ids, attention_mask, generation_config=generation_config,
                             max_new_tokens=max_new_tokens,
                             do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p, repetition_penalty=repetition_penalty,
                             no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens,
                             stop_strings=stop_strings, tokenizer=tokenizer,
                             num_return_sequences=num_return_sequences, seed=seed, eos_token_id=eos_token_id,
                             pad_token_id=pad_token_id)
    prompt = np.repeat(np.asarray(input_ids).astype(np.int64), copies["num_return_sequences"], axis=0)  # (B*n, L)
    steps = list(stream)
    if not steps:
        return prompt.copy()
    return np.concatenate([prompt, np.stack(steps, axis=1)], axis=1)  # (B * n, L + T)


def _beam_generate(model: Any, input_ids: Any, attention_mask: Any, given: dict[str, Any], tokenizer: Any,
                   seed: Any, generation_config: GenerationConfig | None) -> np.ndarray:
    o, ids, mask, eos, pad, max_new, _ = _setup(model, input_ids, attention_mask, given, tokenizer, seed,
                                                generation_config)
    if max_new == 0:
        return ids.copy()
    processing = dict(repetition_penalty=o["repetition_penalty"], no_repeat_ngram_size=o["no_repeat_ngram_size"],
                      min_new_tokens=o["min_new_tokens"], padding=left_padding(mask))

    def process(log_probs: np.ndarray, sequences: np.ndarray, step: int) -> np.ndarray:
        return _process(log_probs, sequences, step, eos, **processing)

    return lm_beam_search(model, ids, mask, num_beams=o["num_beams"], max_new_tokens=max_new, eos=eos,
                          pad_token_id=pad, length_penalty=o["length_penalty"], early_stopping=o["early_stopping"],
                          num_return_sequences=o["num_return_sequences"], process=process)
