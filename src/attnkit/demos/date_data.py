"""Date normalisation: dates written the ways people write them, to ISO 8601 ``YYYY-MM-DD``.

``"3rd of March 1998"``, ``"Mar 3, '98"``, ``"1998/3/3"``, ``"tuesday 3 march 1998"``, ``"03.03.1998"`` ...
all become ``"1998-03-03"``. The data are synthetic, drawn in-process from a seed: dates between 1950 and
2049 (so a two-digit year is unambiguous: 50-99 are 19xx, 00-49 are 20xx), written in one of the
:data:`FORMATS` with random capitalisation. Numeric formats are day-first with dots and year-first with
slashes, never the ambiguous ``3/4/1998``. Weekdays, when written, are the true ones.

The held-out dates are disjoint from the training dates: every date belongs to the test split or the
training split by a fixed hash of its day number (:func:`is_heldout`), so a test example is never a
training date written another way.

Both sides are tokenised by character (:class:`CharVocab`): source ids (B, Ls) right-padded with
``PAD`` and a key-padding mask, target ids ``BOS y1 .. y10 EOS`` (B, 12).
"""
from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence

import numpy as np

from .._validation import check_positive_int

__all__ = ["FORMATS", "CharVocab", "SOURCE_VOCAB", "TARGET_VOCAB", "PAD", "BOS", "EOS", "FIRST_DATE",
           "LAST_DATE", "is_heldout", "render", "sample_dates", "make_examples", "encode_batch"]

PAD, BOS, EOS = 0, 1, 2
FIRST_DATE, LAST_DATE = _dt.date(1950, 1, 1), _dt.date(2049, 12, 31)
HELDOUT_EVERY = 10  # one date in ten (by a fixed hash) is held out

_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _ordinal(n: int) -> str:
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# Each format: a name and a function of (date, parts) -> text; parts holds the derived words.
FORMATS: dict[str, str] = {
    "ordinal_of": "{dth} of {Month} {yyyy}",  # 3rd of March 1998
    "the_ordinal_of": "the {dth} of {month}, {yyyy}",  # the 3rd of march, 1998
    "mon_d_yy": "{Mon} {d}, '{yy}",  # Mar 3, '98
    "month_d_yyyy": "{Month} {d}, {yyyy}",  # March 3, 1998
    "month_dth_yyyy": "{Month} {dth}, {yyyy}",  # March 3rd, 1998
    "d_month_yyyy": "{d} {Month} {yyyy}",  # 3 March 1998
    "d_mon_yyyy": "{d} {Mon} {yyyy}",  # 3 Mar 1998
    "d_mon_yyyy_dashes": "{d}-{Mon}-{yyyy}",  # 3-Mar-1998
    "weekday_d_month_yyyy": "{weekday} {d} {month} {yyyy}",  # tuesday 3 march 1998
    "wkd_d_mon_yyyy": "{Wkd} {d} {Mon} {yyyy}",  # Tue 3 Mar 1998
    "weekday_month_dth_yyyy": "{Weekday}, {Month} {dth}, {yyyy}",  # Tuesday, March 3rd, 1998
    "ymd_slashes": "{yyyy}/{m}/{d}",  # 1998/3/3
    "dmy_dots": "{dd}.{mm}.{yyyy}",  # 03.03.1998
    "dmy_dots_short": "{d}.{m}.{yy}",  # 3.3.98
    "iso": "{yyyy}-{mm}-{dd}",  # 1998-03-03
    "compact": "{yyyy}{mm}{dd}",  # 19980303
    "mon_dth_yy": "{mon} {dth} '{yy}",  # mar 3rd '98
}


def render(date: _dt.date, fmt: str, case: str = "as_is") -> str:
    """``date`` written in format ``fmt`` (a key of :data:`FORMATS`), then upper- or lower-cased if asked.

    Examples
    --------
    >>> d = _dt.date(1998, 3, 3)
    >>> render(d, "ordinal_of"), render(d, "mon_d_yy"), render(d, "ymd_slashes"), render(d, "dmy_dots")
    ('3rd of March 1998', "Mar 3, '98", '1998/3/3', '03.03.1998')
    >>> render(d, "weekday_d_month_yyyy"), render(d, "wkd_d_mon_yyyy", case="upper")
    ('tuesday 3 march 1998', 'TUE 3 MAR 1998')
    """
    month, weekday = _MONTHS[date.month - 1], _DAYS[date.weekday()]
    parts = dict(d=date.day, dd=f"{date.day:02d}", dth=_ordinal(date.day), m=date.month, mm=f"{date.month:02d}",
                 yyyy=f"{date.year:04d}", yy=f"{date.year % 100:02d}", month=month, Month=month.capitalize(),
                 mon=month[:3], Mon=month[:3].capitalize(), weekday=weekday, Weekday=weekday.capitalize(),
                 Wkd=weekday[:3].capitalize())
    text = FORMATS[fmt].format(**parts)
    return text.upper() if case == "upper" else text.lower() if case == "lower" else text


class CharVocab:
    """Character vocabulary with ``PAD = 0``, ``BOS = 1``, ``EOS = 2`` and one id per character after them.

    Examples
    --------
    >>> vocab = CharVocab("0123456789-")
    >>> vocab.encode("1998-03-03")
    [4, 12, 12, 11, 13, 3, 6, 13, 3, 6]
    >>> vocab.decode([1, 4, 12, 2, 0])
    '19'
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, characters: str) -> None:
        if len(set(characters)) != len(characters):
            raise ValueError("characters must not repeat")
        self.tokens = list(self.SPECIALS) + list(characters)
        self._index = {c: i + len(self.SPECIALS) for i, c in enumerate(characters)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self._index))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the vocabulary")
        return [self._index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """The characters of ``ids`` up to the first eos, skipping pad and bos."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(self.SPECIALS):
                out.append(self.tokens[i])
        return "".join(out)


SOURCE_VOCAB = CharVocab("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.'/-")
TARGET_VOCAB = CharVocab("0123456789-")
TARGET_LENGTH = 12  # BOS + 10 characters + EOS

_NUM_DAYS = (LAST_DATE - FIRST_DATE).days + 1


def is_heldout(day_number: np.ndarray) -> np.ndarray:
    """Whether each day (days since 1950-01-01) is a held-out date: a fixed multiplicative hash, not a range,
    so the held-out dates are spread over every year, month and weekday."""
    day_number = np.asarray(day_number, dtype=np.int64)
    return (day_number * 2654435761 % 2**32) % HELDOUT_EVERY == 0


def sample_dates(n: int, rng: np.random.Generator, *, heldout: bool) -> list[_dt.date]:
    """``n`` dates drawn uniformly from the held-out split or from the training split."""
    days = np.flatnonzero(is_heldout(np.arange(_NUM_DAYS)) == heldout)  # (num split days,)
    picked = rng.choice(days, size=n)
    return [FIRST_DATE + _dt.timedelta(days=int(d)) for d in picked]


def make_examples(n: int, rng: np.random.Generator | int | None = None, *,
                  heldout: bool = False) -> tuple[list[str], list[str]]:
    """``n`` (source text, ISO target) pairs from one split, formats and case drawn at random.

    Examples
    --------
    >>> src, tgt = make_examples(3, rng=0)
    >>> len(src), all(len(t) == 10 and t[4] == "-" for t in tgt)
    (3, True)
    """
    n = check_positive_int(n, "n")
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    dates = sample_dates(n, gen, heldout=heldout)
    names = list(FORMATS)
    fmts = gen.integers(0, len(names), size=n)
    cases = gen.choice(["as_is", "as_is", "lower", "upper"], size=n)
    sources = [render(d, names[f], c) for d, f, c in zip(dates, fmts, cases, strict=True)]
    return sources, [d.isoformat() for d in dates]


def encode_batch(sources: Sequence[str], targets: Sequence[str] | None = None):
    """Character ids of a batch.

    Returns
    -------
    src_ids : int64 (B, Ls), right-padded with PAD; src_mask : bool (B, Ls), ``True`` = real character;
    tgt_ids : int64 (B, 12) ``BOS + 10 characters + EOS`` (only when ``targets`` is given).
    """
    encoded = [SOURCE_VOCAB.encode(s) for s in sources]
    width = max(len(e) for e in encoded)
    src = np.full((len(encoded), width), PAD, dtype=np.int64)  # (B, Ls)
    for i, e in enumerate(encoded):
        src[i, :len(e)] = e
    mask = np.arange(width)[None, :] < np.array([len(e) for e in encoded])[:, None]  # (B, Ls)
    if targets is None:
        return src, mask
    tgt = np.array([[BOS] + TARGET_VOCAB.encode(t) + [EOS] for t in targets], dtype=np.int64)  # (B, 12)
    return src, mask, tgt
