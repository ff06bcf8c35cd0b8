"""The ``attnkit demo``: train a small Transformer encoder on a synthetic task, save it, load it back.

Everything here is NumPy (the pictures are drawn by the command line with :mod:`attnkit.viz`). The model
is a :class:`~attnkit.models.TokenTagger` (embedding, sinusoidal positions, pre-norm encoder blocks, a
linear head) trained with :class:`~attnkit.optim.Adam` on one of the tasks of :mod:`attnkit.demos.tasks`, drawn
in-process from a seed. A saved model is two files side by side: ``model.npz`` (the parameters,
:meth:`Module.save`) and ``model.json`` (the architecture and the task, so it can be rebuilt).

Dimension letters: B batch, L sequence length, N layers, H heads.

Examples
--------
>>> config = DemoConfig(steps=3, batch_size=8, eval_size=16, d_model=16, num_heads=2)
>>> result = train(config)
>>> len(result.losses), 0.0 <= result.heldout_accuracy <= 1.0
(3, True)
>>> attention_maps(result.model, [3, 1, 2]).shape  # (N, H, L, L) for one sequence
(2, 2, 3, 3)
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._validation import check_positive_int
from ..io import ArrayArchive, ArrayHeader, read_json
from ..kernels._threads import blas_single_thread
from ..losses import softmax_cross_entropy
from ..models import TokenTagger, TokenTaggerConfig
from ..optim import Adam, clip_grad_norm, warmup_cosine
from . import tasks as _tasks
from .training import check_loss

__all__ = ["DemoConfig", "TrainResult", "build_model", "train", "learning_rate", "save_model", "load_model",
           "attention_maps", "parse_sequence", "MODEL_FILE", "CONFIG_FILE"]

MODEL_FILE = "model.npz"
CONFIG_FILE = "model.json"
_FORMAT = "attnkit-demo-model"
_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything that determines a demo run (the defaults are the ``attnkit demo`` defaults).

    The defaults reach about 99.9% held-out token accuracy on ``sort`` in well under a minute on two cores.
    """

    task: str = "sort"
    seq_len: int = 10
    num_digits: int = 10
    steps: int = 800
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    max_grad_norm: float = 1.0
    seed: int = 0
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 128
    eval_size: int = 2000
    eval_points: int = 10

    def __post_init__(self) -> None:
        if self.task not in _tasks.TASKS:
            raise ValueError(f"task must be one of {', '.join(_tasks.TASKS)}, got {self.task!r}")
        for name in ("seq_len", "num_digits", "steps", "batch_size", "d_model", "num_heads", "num_layers",
                     "d_ff", "eval_size", "eval_points"):
            check_positive_int(getattr(self, name), name)
        check_positive_int(self.seed, "seed", allow_zero=True)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model = {self.d_model} is not divisible by num_heads = {self.num_heads}")

    def model_kwargs(self) -> dict[str, Any]:
        """The :class:`TokenTagger` arguments of this run (what ``model.json`` stores)."""
        return {"vocab_size": self.num_digits, "num_classes": self.num_digits, "max_length": self.seq_len,
                "d_model": self.d_model, "num_heads": self.num_heads, "num_layers": self.num_layers,
                "d_ff": self.d_ff, "positional": "sinusoidal"}


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns: the trained model and its history.

    ``losses`` and ``accuracies`` hold one training-batch value per step; ``eval_steps`` /
    ``eval_accuracies`` the held-out token accuracy at a few steps (the last is ``heldout_accuracy``).
    ``example`` is the first held-out input sequence (L,), ``example_target`` its correct output and
    ``example_prediction`` the model's.
    """

    config: DemoConfig
    model: TokenTagger
    losses: list[float]
    accuracies: list[float]
    eval_steps: list[int]
    eval_accuracies: list[float]
    heldout_accuracy: float
    heldout_sequence_accuracy: float
    example: np.ndarray
    example_target: np.ndarray
    example_prediction: np.ndarray
    seconds: float


def learning_rate(step: int, config: DemoConfig) -> float:
    """Linear warm-up over ``config.warmup`` steps, then a cosine decay to a tenth of ``config.lr``.

    Examples
    --------
    >>> c = DemoConfig(steps=100, warmup=10, lr=1.0)
    >>> [round(learning_rate(s, c), 3) for s in (0, 9, 99)]
    [0.1, 1.0, 0.1]
    """
    return warmup_cosine(step, peak=config.lr, warmup=config.warmup, total=config.steps, floor=0.1)


def _evaluate(model: TokenTagger, ids: np.ndarray, targets: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Token accuracy, whole-sequence accuracy and predictions (B, L) in eval mode."""
    was_training = model.training
    model.eval()
    try:
        pred = model.predict(ids)  # (B, L)
    finally:
        model.train(was_training)
    right = pred == targets  # (B, L)
    return float(right.mean()), float(right.all(axis=1).mean()), pred


def build_model(config: DemoConfig) -> TokenTagger:
    """A fresh float32 :class:`TokenTagger` for ``config`` (weights from ``config.seed``)."""
    model = TokenTagger(TokenTaggerConfig(**config.model_kwargs()), rng=np.random.default_rng([config.seed, 1]))
    return model.astype(np.float32)


def train(config: DemoConfig, on_step: Callable[[int, float, float], None] | None = None) -> TrainResult:
    """Train a :class:`TokenTagger` on ``config.task`` with Adam and return it with its history.

    Parameters
    ----------
    config : DemoConfig
    on_step : callable, optional
        Called after every step as ``on_step(step, loss, batch_accuracy)`` (step counts from 1), e.g. to
        move a progress bar.

    Returns
    -------
    TrainResult

    Notes
    -----
    The training batches, the initial weights and the held-out set come from three independent streams
    of ``config.seed``; the held-out set has ``config.eval_size`` fresh sequences.
    """
    start = time.perf_counter()
    model = build_model(config)
    optimizer = Adam(model, lr=config.lr, betas=(0.9, 0.98))
    data_rng = np.random.default_rng([config.seed, 2])
    eval_ids, eval_targets = _tasks.make_batch(config.task, config.eval_size, config.seq_len, config.num_digits,
                                               rng=np.random.default_rng([config.seed, 3]))  # (E, L) each
    eval_at = set(np.linspace(0, config.steps, config.eval_points + 1).round().astype(int)[1:].tolist())
    losses, accuracies, eval_steps, eval_accuracies = [], [], [], []
    # The demo's matrices are tiny ((B*L, 64) @ (64, 64)): a multi-threaded BLAS only adds synchronisation,
    # and on a busy machine its spinning threads make a step ~10x slower.
    with blas_single_thread():
        for step in range(1, config.steps + 1):
            ids, targets = _tasks.make_batch(config.task, config.batch_size, config.seq_len, config.num_digits,
                                             rng=data_rng)  # (B, L) each
            model.zero_grad()
            logits = model(ids)  # (B, L, C)
            loss, grad = softmax_cross_entropy(logits, targets)
            loss = check_loss(loss, step, config.lr)
            model.backward(grad)
            clip_grad_norm(model, config.max_grad_norm)
            optimizer.lr = learning_rate(step - 1, config)
            optimizer.step()
            accuracy = float(np.mean(logits.argmax(axis=-1) == targets))
            losses.append(loss)
            accuracies.append(accuracy)
            if step in eval_at:
                eval_steps.append(step)
                eval_accuracies.append(_evaluate(model, eval_ids, eval_targets)[0])
            if on_step is not None:
                on_step(step, loss, accuracy)
        token_acc, seq_acc, pred = _evaluate(model, eval_ids, eval_targets)
    return TrainResult(config=config, model=model, losses=losses, accuracies=accuracies, eval_steps=eval_steps,
                       eval_accuracies=eval_accuracies, heldout_accuracy=token_acc,
                       heldout_sequence_accuracy=seq_acc, example=eval_ids[0],
                       example_target=eval_targets[0], example_prediction=pred[0],
                       seconds=time.perf_counter() - start)


def save_model(result: TrainResult, folder: str | Path) -> tuple[Path, Path]:
    """Write ``model.npz`` (parameters) and ``model.json`` (architecture, task, scores) into ``folder``.

    Both files are written in full to temporary files first and only then renamed into place
    (:func:`attnkit.io.atomic_write_files`), so a failed save (disk full, a file-size limit, an error,
    Ctrl-C) leaves the folder's previous pair intact and loadable.

    Returns the two paths.
    """
    from ..io import atomic_write_files, write_arrays

    folder = Path(folder)
    model_path, config_path = folder / MODEL_FILE, folder / CONFIG_FILE
    c = result.config
    meta = {
        "format": _FORMAT, "version": _FORMAT_VERSION,
        "task": c.task, "seq_len": c.seq_len, "num_digits": c.num_digits,
        "tokens": _tasks.token_names(c.num_digits),
        "model": c.model_kwargs(), "dtype": "float32",
        "training": dataclasses.asdict(c),
        "heldout_token_accuracy": round(result.heldout_accuracy, 6),
        "heldout_sequence_accuracy": round(result.heldout_sequence_accuracy, 6),
    }
    config_bytes = (json.dumps(meta, indent=2) + "\n").encode("utf-8")
    state = result.model.state_dict()
    atomic_write_files({model_path: lambda f: write_arrays(f, state), config_path: lambda f: f.write(config_bytes)})
    return model_path, config_path


def _model_paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.is_dir():
        return path / MODEL_FILE, path / CONFIG_FILE
    return path, path.with_suffix(".json")


_MODEL_FIELDS = ("vocab_size", "num_classes", "max_length", "d_model", "num_heads", "num_layers", "d_ff")
_MAX_LENGTH = 1 << 16  # the sinusoidal table (max_length, d_model) is built, not loaded: bound it


def _positive_int(value: Any, name: str, where: Path, maximum: int | None = None) -> int:
    """A size read from ``model.json``: the library's check, its message prefixed with the file."""
    try:
        return check_positive_int(value, name, maximum=maximum)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_architecture(arch: Any, where: Path) -> dict[str, Any]:
    """The ``model`` entry of ``model.json``: known keys only, positive integer sizes."""
    if not isinstance(arch, dict):
        raise ValueError(f"{where}: \"model\" must be an object of TokenTagger arguments, got {type(arch).__name__}")
    unknown = sorted(set(arch) - set(_MODEL_FIELDS) - {"positional"})
    missing = [name for name in _MODEL_FIELDS[:3] if name not in arch]
    if unknown or missing:
        raise ValueError(f"{where}: \"model\" has unknown keys {unknown} or lacks {missing}")
    for name in _MODEL_FIELDS:
        if name in arch and not (name == "d_ff" and arch[name] is None):
            _positive_int(arch[name], f"model.{name}", where)
    if arch.get("d_model", 64) % arch.get("num_heads", 4):
        raise ValueError(f"{where}: model.d_model {arch.get('d_model', 64)} is not divisible by model.num_heads "
                         f"{arch.get('num_heads', 4)}")
    if arch["max_length"] > _MAX_LENGTH:
        raise ValueError(f"{where}: model.max_length {arch['max_length']} is above {_MAX_LENGTH}")
    if arch.get("positional", "sinusoidal") not in ("sinusoidal", "learned"):
        raise ValueError(f"{where}: model.positional must be 'sinusoidal' or 'learned', got {arch['positional']!r}")
    return arch


def _check_meta(meta: Any, where: Path) -> dict[str, Any]:
    """Every field of ``model.json`` that loading and the command line use, checked for type and range."""
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"{where} does not describe an attnkit demo model (no \"format\": \"{_FORMAT}\")")
    arch = _check_architecture(meta.get("model"), where)
    tokens = meta.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"{where}: \"tokens\" must be a list of non-empty strings")
    if len(tokens) < max(arch["vocab_size"], arch["num_classes"]):
        raise ValueError(f"{where}: {len(tokens)} tokens for vocab_size {arch['vocab_size']} and num_classes "
                         f"{arch['num_classes']}")
    if not isinstance(meta.get("task"), str):
        raise ValueError(f"{where}: \"task\" must be a string, got {meta.get('task')!r}")
    _positive_int(meta.get("seq_len"), "\"seq_len\"", where, maximum=arch["max_length"])
    accuracy = meta.get("heldout_token_accuracy", 0.0)
    if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)):
        raise ValueError(f"{where}: \"heldout_token_accuracy\" must be a number, got {accuracy!r}")
    if meta.get("dtype", "float32") not in ("float32", "float64"):
        raise ValueError(f"{where}: \"dtype\" must be 'float32' or 'float64', got {meta.get('dtype')!r}")
    return meta


def _stored_headers(model_path: Path) -> dict[str, ArrayHeader]:
    """Every entry's header in the ``.npz`` archive, checked against the sizes the zip records (no array
    is read): a header's shape is a claim, and an archive whose data could not hold it is refused."""
    try:
        with ArrayArchive(model_path) as archive:
            return dict(archive.headers)
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise ValueError(f"{model_path} is not a complete .npz archive of arrays: {exc}") from None


# Probe sizes: distinct primes, so every axis of the probe's parameters names the size it stands for.
_PROBE = {"vocab_size": 31, "num_classes": 37, "max_length": 41, "d_model": 43, "d_ff": 47}


def _expected_shapes(arch: dict[str, Any], where: Path, entries: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes a TokenTagger of ``arch`` has, from a probe of the same depth and layout with
    small sizes (the real model is not built). ``entries`` (the archive's count) bounds the depth first."""
    layers = arch.get("num_layers", 2)
    if layers > entries:
        raise ValueError(f"{where}: model.num_layers {layers} is more than the {entries} arrays the weights hold")
    sizes = {**{name: arch[name] for name in ("vocab_size", "num_classes", "max_length", "d_model")},
             "d_ff": arch.get("d_ff") or 4 * arch.get("d_model", 64)}
    probe = TokenTagger(TokenTaggerConfig(_PROBE["vocab_size"], _PROBE["num_classes"], _PROBE["max_length"],
                                          d_model=_PROBE["d_model"], num_heads=1, num_layers=layers,
                                          d_ff=_PROBE["d_ff"], positional=arch.get("positional", "sinusoidal")),
                        rng=0)
    by_prime = {prime: sizes[name] for name, prime in _PROBE.items()}

    def real(axis: int) -> int:
        prime = next(p for p in by_prime if axis % p == 0)
        return axis // prime * by_prime[prime]

    return {name: tuple(real(axis) for axis in value.shape) for name, value in probe.state_dict().items()}


def _check_stored(headers: dict[str, ArrayHeader], arch: dict[str, Any], model_path: Path,
                  config_path: Path) -> None:
    """Refuse, before the model is built, weights whose entries, shapes or dtypes do not fit ``arch``."""
    needed, stored = _minimum_parameters(arch), sum(h.size for h in headers.values())
    if needed > stored:
        raise ValueError(f"{config_path} describes a model of at least {needed:,} parameters, but {model_path} "
                         f"holds {stored:,} numbers")
    expected = _expected_shapes(arch, config_path, len(headers))
    missing, unknown = sorted(set(expected) - set(headers)), sorted(set(headers) - set(expected))
    if missing or unknown:
        raise ValueError(f"{model_path} does not match {config_path}: missing entries {missing[:5]}, unknown "
                         f"entries {unknown[:5]}")
    for name, shape in expected.items():
        header = headers[name]
        if header.shape != shape or header.dtype.kind != "f":
            raise ValueError(f"{model_path} does not match {config_path}: entry {name!r} is {header.shape} "
                             f"{header.dtype}, the model needs {shape} floating point")


def _minimum_parameters(arch: dict[str, Any]) -> int:
    """A lower bound on a TokenTagger's parameter count: embeddings, attention and MLP matrices, head."""
    d, layers = arch["d_model"], arch.get("num_layers", 2)
    d_ff = arch.get("d_ff") or 4 * d
    learned = arch["max_length"] * d if arch.get("positional") == "learned" else 0
    return arch["vocab_size"] * d + learned + layers * (4 * d * d + 2 * d * d_ff) + d * arch["num_classes"]


def load_model(path: str | Path) -> tuple[TokenTagger, dict[str, Any]]:
    """Rebuild a model saved by :func:`save_model`.

    ``model.json`` is checked field by field, and every entry of ``model.npz`` (name, shape, dtype, read
    from its header by :class:`attnkit.io.ArrayArchive`, which checks each header's claim against the
    sizes the zip records) against the shapes the configuration implies, before the model is built: a
    tampered or truncated folder raises ``ValueError`` instead of allocating what it claims.

    Parameters
    ----------
    path : str or Path
        The folder holding ``model.npz`` and ``model.json``, or the ``.npz`` file (its ``.json`` beside it).

    Returns
    -------
    model : TokenTagger
        In eval mode, float32.
    meta : dict
        The contents of the JSON file (``task``, ``seq_len``, ``tokens``, ``model``, scores ...).

    Raises
    ------
    FileNotFoundError
        A missing file (the message names it).
    ValueError
        A JSON file that is not an attnkit demo model, or parameters that do not fit it.
    """
    model_path, config_path = _model_paths(path)
    for p in (model_path, config_path):
        if not p.is_file():
            raise FileNotFoundError(f"no such file: {p}")
    meta = _check_meta(read_json(config_path, expect=None), config_path)
    _check_stored(_stored_headers(model_path), meta["model"], model_path, config_path)
    model = TokenTagger(TokenTaggerConfig(**meta["model"]), rng=0).astype(np.dtype(meta.get("dtype", "float32")))
    try:
        model.load(model_path)
    except (KeyError, ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{model_path} does not match {config_path}: {exc}") from exc
    return model.eval(), meta


def parse_sequence(text: str | Sequence[Any], tokens: Sequence[str], max_length: int) -> np.ndarray:
    """Token ids (L,) of a sequence written as ``"3 1 2"`` (spaces or commas) or ``"312"`` (one char each).

    Examples
    --------
    >>> parse_sequence("3 1 4", [str(i) for i in range(10)], 10)
    array([3, 1, 4])
    >>> parse_sequence("9,0", [str(i) for i in range(10)], 10)
    array([9, 0])
    """
    if isinstance(text, str):
        parts = text.replace(",", " ").split()
        if len(parts) == 1 and all(len(t) == 1 for t in tokens):
            parts = list(parts[0])
    else:
        parts = [str(t) for t in text]
    if not parts:
        raise ValueError("the input sequence is empty")
    index = {t: i for i, t in enumerate(tokens)}
    unknown = [p for p in parts if p not in index]
    if unknown:
        raise ValueError(f"unknown tokens {unknown[:5]} in the input; the model knows {' '.join(tokens)}")
    if len(parts) > max_length:
        raise ValueError(f"the input has {len(parts)} tokens, the model takes at most {max_length}")
    return np.array([index[p] for p in parts])


def attention_maps(model: TokenTagger, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The attention weights of every layer and head for one sequence of token ids, as (N, H, L, L).

    Also usable as ``plot_attention(attention_maps(model, ids), tokens)``.
    """
    ids = np.asarray(ids)[None, :]  # (1, L)
    was_training = model.training
    model.eval()
    try:
        _, weights = model(ids, need_weights=True)  # [(1, H, L, L)] * N
    finally:
        model.train(was_training)
    return np.stack([w[0] for w in weights])  # (N, H, L, L)
