"""``GenerationConfig``: the options of :func:`~attnkit.decoding.sampling.generate`, with Hugging Face's names and
defaults, validated once when made.

A model folder's ``generation_config.json`` becomes one when the folder loads (``model.generation_config``), so a
folder whose defaults generate would refuse is refused then; a call's own arguments replace its values
(:meth:`GenerationConfig.updated`), and the result is what the decoding loop reads.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import check_positive_int, check_real
from .beam_search import MAX_NUM_BEAMS, check_num_beams

__all__ = ["GenerationConfig", "MAX_NEW_TOKENS", "MAX_DRAFT_TOKENS", "check_temperature", "check_top_k", "check_unit",
           "check_repetition_penalty"]

MAX_NEW_TOKENS = 2**31 - 1
# Draft tokens per speculative round at most: a ring-buffer layer keeps this many slots beyond its window so a
# rejected draft can be taken back without a copy of the window.
MAX_DRAFT_TOKENS = 64


# The warpers' checks, shared with the warpers themselves (attnkit.decoding.sampling). Every number goes through
# the one checked conversion (attnkit._validation.check_real): 10**400 is a ValueError naming it.
def check_unit(value: Any, name: str) -> float:
    return check_real(value, name, low=0.0, high=1.0, expected="a number in [0, 1]")


def check_temperature(temperature: Any) -> float:
    try:
        return check_real(temperature, "temperature", low=0, low_open=True)
    except ValueError as exc:
        hint = " (for greedy decoding use do_sample=False)" if temperature == 0 else ""
        raise ValueError(f"{exc}{hint}") from None


def check_repetition_penalty(penalty: Any) -> float:
    return check_real(penalty, "repetition_penalty", low=0, low_open=True)


def check_top_k(top_k: Any) -> int:
    return check_positive_int(top_k, "top_k", allow_zero=True)



@dataclass(frozen=True)
class GenerationConfig:
    """How :func:`~attnkit.decoding.sampling.generate` decodes: Hugging Face's option names and defaults.

    Parameters
    ----------
    max_new_tokens : int, default 20
        Tokens to add at most, in [0, 2**31 - 1].
    do_sample : bool, default False
        Sample (with the warpers below) instead of taking the likeliest token.
    temperature, top_k, top_p, min_p
        The warpers, applied in this order when sampling (checked even when greedy).
    repetition_penalty, no_repeat_ngram_size, min_new_tokens
        Logits processors (None: off).
    stop_strings : str or sequence of str, optional
        Text that ends a row (needs the tokenizer at the call); kept as a tuple.
    num_return_sequences : int, default 1
        Sequences per prompt, at most 1024 (``MAX_NUM_BEAMS``: each is a row decoded); more than one needs
        sampling or beams.
    eos_token_id : int or sequence of int, optional
        End-of-sequence ids (None: the model's; checked against the model's vocabulary at the call).
    pad_token_id : int, optional
        The id finished rows are padded with (None: the model's, else the first eos).
    num_beams, length_penalty, early_stopping
        Beam search (``num_beams > 1``), as transformers' ``generate``.
    prompt_lookup_num_tokens : int, optional
        Speculative decoding with drafts looked up in the text so far, this many tokens at most per round
        (:class:`~attnkit.decoding.speculative.PromptLookup`); None: off.
    max_matching_ngram_size : int, optional
        The longest n-gram prompt lookup matches (None: 2, as transformers).
    num_assistant_tokens : int, default 20
        Draft tokens of a draft model's round at most (``assistant_model`` or ``assistant_early_exit``); each
        round drafts the number expected to give the most tokens per step, none when drafting does not pay
        (:class:`~attnkit.decoding.speculative.Proposer`).
    assistant_early_exit : int, optional
        Speculative decoding with the model's own first N layers (and its final norm and head) as the draft.

    Raises
    ------
    ValueError, TypeError
        An option out of range or of the wrong type, or a combination generate cannot run (beam sampling,
        more sequences than beams, stop strings with beams, several greedy sequences), naming the option.

    Examples
    --------
    >>> config = GenerationConfig.from_dict({"temperature": 0.7, "do_sample": True, "transformers_version": "5"})
    >>> config.temperature, config.updated(max_new_tokens=5, temperature=None).max_new_tokens
    (0.7, 5)
    >>> GenerationConfig(temperature=-1.0)
    Traceback (most recent call last):
    ValueError: temperature must be a finite positive number, got -1.0
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    stop_strings: str | Sequence[str] | None = None
    num_return_sequences: int = 1
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    num_assistant_tokens: int = 20
    assistant_early_exit: int | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_speculation()
        self._check_processors()
        self._check_beams()
        # the warpers' own checks, so that a typo is refused even when greedy
        check_temperature(self.temperature)
        if self.top_k is not None:
            check_top_k(self.top_k)
        for name in ("top_p", "min_p"):
            if getattr(self, name) is not None:
                check_unit(getattr(self, name), name)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_counts(self) -> None:
        for name in ("max_new_tokens", "no_repeat_ngram_size", "min_new_tokens"):
            if getattr(self, name) is not None:
                self._set(name, check_positive_int(getattr(self, name), name, allow_zero=True))
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens must be an integer, got None")
        check_positive_int(self.max_new_tokens, "max_new_tokens", allow_zero=True, maximum=MAX_NEW_TOKENS)
        # every sequence is a row generate decodes, as every beam is: the same bound
        self._set("num_return_sequences", check_positive_int(self.num_return_sequences, "num_return_sequences",
                                                             maximum=MAX_NUM_BEAMS))
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise TypeError(f"do_sample must be True or False, got {self.do_sample!r}")

    def _check_speculation(self) -> None:
        for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit"):
            if getattr(self, name) is not None:
                self._set(name, check_positive_int(getattr(self, name), name, maximum=MAX_DRAFT_TOKENS))
        self._set("num_assistant_tokens", check_positive_int(self.num_assistant_tokens, "num_assistant_tokens",
                                                             maximum=MAX_DRAFT_TOKENS))
        if self.prompt_lookup_num_tokens is not None and self.assistant_early_exit is not None:
            raise ValueError("prompt_lookup_num_tokens and assistant_early_exit are two ways of drafting: give one")

    def _check_processors(self) -> None:
        if self.repetition_penalty is not None:
            check_repetition_penalty(self.repetition_penalty)
        stops = self.stop_strings
        if stops is not None:
            stops = (stops,) if isinstance(stops, str) else stops
            if not isinstance(stops, Sequence) or not stops or not all(isinstance(t, str) and t for t in stops):
                raise ValueError(f"stop_strings must be a non-empty string or a list of them, got "
                                 f"{self.stop_strings!r}")
            self._set("stop_strings", tuple(stops))

    def _check_beams(self) -> None:
        beams = check_num_beams(self.num_beams)
        self._set("num_beams", beams)
        self._set("length_penalty", check_real(self.length_penalty, "length_penalty"))
        early = self.early_stopping
        if not (isinstance(early, (bool, np.bool_)) or isinstance(early, str) and early == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early!r}")
        count = self.num_return_sequences
        if beams > 1 and (self.prompt_lookup_num_tokens is not None or self.assistant_early_exit is not None):
            raise ValueError("speculative decoding (prompt_lookup_num_tokens, assistant_early_exit) runs greedy or "
                             "sampled decoding, not beam search (num_beams > 1)")
        if beams > 1:
            if self.do_sample:
                raise ValueError("num_beams > 1 with do_sample=True (beam sampling) is not supported; use one of "
                                 "them")
            if count > beams:
                raise ValueError(f"num_return_sequences ({count}) must be at most num_beams ({beams})")
            if self.stop_strings is not None:
                raise ValueError("stop_strings is not supported with num_beams > 1 (beam search ends on eos tokens)")
        elif count > 1 and not self.do_sample:
            raise ValueError(f"num_return_sequences={count} needs do_sample=True: greedy decoding returns the "
                             f"same sequence every time")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GenerationConfig:
        """The options a parsed ``generation_config.json`` sets; keys generate does not read are ignored, and
        null values keep the default, as in transformers."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict (a parsed generation_config.json), got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def updated(self, **options: Any) -> GenerationConfig:
        """A copy with the options that are not None replaced (a call's arguments over the model's defaults).

        Raises
        ------
        TypeError
            An option that is not a field.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown generation options {unknown}; GenerationConfig has {sorted(names)}")
        given = {k: v for k, v in options.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict (tuples as lists), as ``generation_config.json`` writes them."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
