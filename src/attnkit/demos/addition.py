"""Train a small decoder-only language model to add numbers, in NumPy, then decode its answers with the cache.

The text of one example is ``"07+35=" + reversed(sum) + <eos>``, e.g. ``07+35=240<eos>`` for 42 (the sum's
digits are written least significant first, the order in which carries are computed, so that each digit
depends only on what the model has already seen). The model is a Llama-style :class:`~attnkit.models.CausalLM`
(RMSNorm, SwiGLU, rotary positions, grouped-query attention) trained with Adam on the cross-entropy of the
answer tokens only; answers are then produced by greedy decoding with a :class:`~attnkit.decoding.cache.KVCache`
(one prefill of the prompt, then one token per step) and scored by exact match.

Dimension letters: B batch, L tokens, V vocabulary (10 digits, ``+``, ``=``, ``<eos>``).

Examples
--------
>>> result = train_addition(AdditionConfig(steps=2, batch_size=8, eval_size=8))
>>> len(result.losses), 0.0 <= result.accuracy <= 1.0
(2, True)
>>> encode(7, 35, digits=2).tolist()
[0, 7, 10, 3, 5, 11]
>>> decode_answer([2, 4, 0, 12])
42
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from .._validation import check_positive_int
from ..io import read_json
from ..kernels._threads import blas_single_thread
from ..losses import softmax_cross_entropy
from ..models import CausalLM, DecoderConfig, MLPConfig, SpecialTokens
from ..optim import Adam, clip_grad_norm, warmup_cosine
from .training import check_loss

__all__ = [
    "AdditionConfig",
    "AdditionResult",
    "decode_answer",
    "encode",
    "is_addition_folder",
    "load_model",
    "parse_prompt",
    "greedy_answers",
    "make_batch",
    "train_addition",
]

PLUS, EQUALS, EOS = 10, 11, 12
VOCAB = 13
TOKENS = (*"0123456789", "+", "=", "<eos>")  # the text of each id
_IGNORE = -100


@dataclasses.dataclass(frozen=True)
class AdditionConfig:
    """What to train: the task size, the model size and the optimisation."""

    digits: int = 2
    steps: int = 1500
    batch_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    lr: float = 3e-3
    eval_size: int = 500
    seed: int = 0
    max_seconds: float | None = None  # stop early when training has taken this long

    def __post_init__(self) -> None:
        for name in ("digits", "steps", "batch_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "eval_size"):
            check_positive_int(getattr(self, name), name)
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")

    def model_config(self) -> DecoderConfig:
        head_dim = self.hidden_size // self.num_heads
        return DecoderConfig(family="llama", vocab_size=VOCAB, hidden_size=self.hidden_size,
                             num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=head_dim, mlp=MLPConfig(2 * self.hidden_size),
                             max_position_embeddings=4 * self.digits + 4, tokens=SpecialTokens(eos=EOS, pad=EOS))


@dataclasses.dataclass
class AdditionResult:
    model: CausalLM
    losses: list[float]
    accuracy: float  # exact-match accuracy of greedy cached decoding on held-out pairs
    seconds: float
    examples: list[str]  # a few held-out "a+b=c" lines as the model answered them


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """Decimal digits of every value, most significant first: (N,) -> (N, width)."""
    powers = 10 ** np.arange(width - 1, -1, -1)  # (width,)
    return (values[:, None] // powers) % 10  # (N, width)


def encode(a: int, b: int, digits: int) -> np.ndarray:
    """The prompt ``a+b=`` as token ids (each operand zero-padded to ``digits``)."""
    d = _digits(np.array([a, b]), digits)  # (2, digits)
    return np.concatenate([d[0], [PLUS], d[1], [EQUALS]]).astype(np.int64)


def decode_answer(tokens) -> int | None:
    """The number written (least significant digit first) before the first ``<eos>``; None if malformed."""
    out = []
    for t in tokens:
        if t == EOS:
            break
        if not 0 <= t <= 9:
            return None
        out.append(int(t))
    else:
        return None
    return int("".join(map(str, reversed(out)))) if out else None


def make_batch(rng: np.random.Generator, size: int, digits: int):
    """``(ids (B, L), targets (B, L), a (B,), b (B,))``: targets are the next tokens of the answer only."""
    a = rng.integers(0, 10 ** digits, size)
    b = rng.integers(0, 10 ** digits, size)
    da, db = _digits(a, digits), _digits(b, digits)  # (B, digits)
    answer = _digits(a + b, digits + 1)[:, ::-1]  # (B, digits + 1), least significant first
    plus, equals, eos = (np.full((size, 1), token) for token in (PLUS, EQUALS, EOS))  # (B, 1) each
    text = np.concatenate([da, plus, db, equals, answer, eos], axis=1)  # (B, L + 1)
    ids, targets = text[:, :-1], text[:, 1:].copy()  # (B, L)
    targets[:, :2 * digits + 1] = _IGNORE  # no loss on predicting the operands
    return ids.astype(np.int64), targets.astype(np.int64), a, b


def greedy_answers(model: CausalLM, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy continuation of ``prompts`` (B, L) by ``new_tokens`` tokens, prefill + one cached step each."""
    cache = model.new_cache(prompts.shape[0], max_length=prompts.shape[1] + new_tokens)
    logits = model(prompts, cache=cache)[:, -1]  # (B, V)
    out = []
    for step in range(new_tokens):
        token = logits.argmax(axis=-1)  # (B,)
        out.append(token)
        if step + 1 < new_tokens:
            logits = model(token[:, None], cache=cache)[:, -1]  # (B, V)
    return np.stack(out, axis=1)  # (B, new_tokens)


def _evaluate(model: CausalLM, config: AdditionConfig, rng: np.random.Generator):
    ids, _, a, b = make_batch(rng, config.eval_size, config.digits)
    prompts = ids[:, :2 * config.digits + 2]  # (B, Lprompt)
    answers = greedy_answers(model, prompts, config.digits + 2)  # (B, digits + 2)
    got = [decode_answer(row) for row in answers]
    correct = np.array([g == x + y for g, x, y in zip(got, a, b)])
    examples = [f"{x}+{y}={g if g is not None else '?'}{'' if ok else '  (wrong)'}"
                for x, y, g, ok in list(zip(a, b, got, correct))[:5]]
    return float(correct.mean()), examples


def train_addition(config: AdditionConfig = AdditionConfig(), progress=None) -> AdditionResult:
    """Train on fresh random pairs each step, then score greedy cached decoding on held-out pairs.

    ``progress(step, loss)``, if given, is called after every step (steps count from 1). BLAS runs on one
    thread: the matrices are
    so small that waking a second thread costs more than it saves (and far more on a busy machine).
    """
    with blas_single_thread():
        return _train(config, progress)


def _train(config: AdditionConfig, progress) -> AdditionResult:
    rng = np.random.default_rng(config.seed)
    model = CausalLM(config.model_config(), rng=rng).astype(np.float32)
    optimizer = Adam(model, lr=config.lr)
    losses, start = [], time.perf_counter()
    for step in range(config.steps):
        optimizer.lr = warmup_cosine(step, peak=config.lr, warmup=100, total=config.steps, floor=0.02)
        ids, targets, _, _ = make_batch(rng, config.batch_size, config.digits)
        logits = model(ids)  # (B, L, V)
        loss, grad = softmax_cross_entropy(logits, targets, ignore_index=_IGNORE)
        loss = check_loss(loss, step + 1, config.lr)
        optimizer.zero_grad()
        model.backward(grad)
        clip_grad_norm(model, 1.0)
        optimizer.step()
        losses.append(float(loss))
        if progress is not None:
            progress(step + 1, float(loss))
        if config.max_seconds is not None and time.perf_counter() - start > config.max_seconds:
            break
    seconds = time.perf_counter() - start
    model.eval()
    accuracy, examples = _evaluate(model, config, np.random.default_rng(config.seed + 1))
    return AdditionResult(model, losses, accuracy, seconds, examples)


if __name__ == "__main__":  # a quick look without the CLI: python -m attnkit.demos.addition
    result = train_addition(progress=lambda step, loss: step % 100 or print(f"step {step:5d}  loss {loss:.4f}"))
    print(f"trained {len(result.losses)} steps in {result.seconds:.1f} s; held-out exact match {result.accuracy:.1%}")
    print("\n".join(result.examples))


def is_addition_folder(path: str | Path) -> bool:
    """Whether ``path`` holds what ``attnkit demo --task addition`` writes: ``model.npz`` and the
    ``DecoderConfig`` of a 13-token vocabulary as ``config.json``."""
    folder = Path(path)
    try:
        config = read_json(folder / "config.json")
    except (OSError, ValueError):
        return False
    return (folder / "model.npz").is_file() and isinstance(config, dict) and config.get("vocab_size") == VOCAB \
        and "family" in config


def load_model(path: str | Path) -> CausalLM:
    """The model ``attnkit demo --task addition`` saved in the folder ``path``.

    Raises
    ------
    ValueError
        The folder is not one (see :func:`is_addition_folder`), or its files do not match.
    """
    folder = Path(path)
    if not is_addition_folder(folder):
        raise ValueError(f"{str(folder)!r} is not a folder written by 'attnkit demo --task addition' (model.npz "
                         f"and config.json with a {VOCAB}-token vocabulary)")
    try:
        config = DecoderConfig.from_dict(read_json(folder / "config.json"))
    except TypeError as err:
        raise ValueError(f"{str(folder / 'config.json')!r} is not a DecoderConfig: {err}") from None
    model = CausalLM(config, rng=0)
    model.load(folder / "model.npz")
    return model


def parse_prompt(text: str) -> np.ndarray:
    """Token ids of a prompt written with the task's characters, e.g. ``"07+35="`` (spaces ignored).

    Examples
    --------
    >>> parse_prompt("07+35=").tolist()
    [0, 7, 10, 3, 5, 11]
    """
    chars = [c for c in str(text) if not c.isspace()]
    unknown = sorted({c for c in chars if c not in TOKENS[:EOS]})
    if not chars or unknown:
        raise ValueError(f"the prompt must be digits, '+' and '=' (like \"07+35=\"), got {text!r}")
    return np.array([TOKENS.index(c) for c in chars], dtype=np.int64)
