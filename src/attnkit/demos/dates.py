"""The ``attnkit demo --task dates`` run: train a :class:`~attnkit.models.Seq2SeqTransformer` to rewrite
dates in human formats as ISO ``YYYY-MM-DD`` (:mod:`attnkit.demos.date_data`), score it on held-out dates with
greedy decoding and beam search, and save it.

Everything is NumPy and float32, trained with :class:`~attnkit.optim.Adam` on fresh synthetic batches.
A saved model is ``model.npz`` (the parameters) beside ``model.json`` (the architecture and the scores).

Examples
--------
>>> config = DatesConfig(steps=2, batch_size=8, eval_size=4, d_model=16, num_heads=2, num_layers=1)
>>> result = train(config)
>>> len(result.losses), 0.0 <= result.greedy_exact_match <= 1.0
(2, True)
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..decoding.beam_search import check_num_beams
from ..io import atomic_write_files, write_arrays
from ..kernels._threads import blas_single_thread
from ..losses import softmax_cross_entropy
from ..models import Seq2SeqConfig, Seq2SeqTransformer
from ..optim import Adam, clip_grad_norm, warmup_cosine
from . import date_data as date_task
from .training import check_loss

__all__ = ["DatesConfig", "DatesResult", "build_model", "train", "normalise", "alignment", "save_model",
           "MODEL_FILE", "CONFIG_FILE"]

MODEL_FILE = "model.npz"
CONFIG_FILE = "model.json"
_FORMAT = "attnkit-dates-model"


@dataclasses.dataclass(frozen=True)
class DatesConfig:
    """Everything that determines a run (the defaults are ``attnkit demo --task dates``'s)."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    max_grad_norm: float = 1.0
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 128
    cross_attention: str = "dot"
    eval_size: int = 1000
    num_beams: int = 4
    seed: int = 0

    def model_kwargs(self) -> dict[str, Any]:
        return dict(src_vocab_size=len(date_task.SOURCE_VOCAB), tgt_vocab_size=len(date_task.TARGET_VOCAB),
                    d_model=self.d_model, num_heads=self.num_heads, num_encoder_layers=self.num_layers,
                    num_decoder_layers=self.num_layers, d_ff=self.d_ff, max_length=48,
                    cross_attention=self.cross_attention)


@dataclasses.dataclass
class DatesResult:
    """A trained model, its training curve and its held-out scores."""

    config: DatesConfig
    model: Seq2SeqTransformer
    losses: list[float]
    greedy_exact_match: float
    beam_exact_match: float
    examples: list[tuple[str, str, str]]  # (source, expected, greedy output) of the first held-out dates
    train_seconds: float  # wall-clock time of the training steps
    train_cpu_seconds: float  # CPU time of this process during them (the honest figure on a shared machine)
    eval_seconds: float


def build_model(config: DatesConfig) -> Seq2SeqTransformer:
    """A fresh float32 model for ``config`` (weights from ``config.seed``)."""
    model = Seq2SeqTransformer(Seq2SeqConfig(**config.model_kwargs()), rng=np.random.default_rng([config.seed, 1]))
    return model.astype(np.float32)


def _learning_rate(step: int, config: DatesConfig) -> float:
    return warmup_cosine(step, peak=config.lr, warmup=config.warmup, total=config.steps, floor=0.05)


def normalise(model: Seq2SeqTransformer, sources: list[str], *, num_beams: int = 1, batch_size: int = 250) -> list[str]:
    """ISO dates written by ``model`` for ``sources`` (greedy with ``num_beams=1``, else beam search)."""
    out: list[str] = []
    for i in range(0, len(sources), batch_size):
        src, mask = date_task.encode_batch(sources[i:i + batch_size])  # (B, Ls) each
        ids = model.generate(src, mask, bos_token_id=date_task.BOS, eos_token_id=date_task.EOS,
                             max_new_tokens=date_task.TARGET_LENGTH - 1, num_beams=num_beams,
                             pad_token_id=date_task.PAD)  # (B, 1 + n)
        out.extend(date_task.TARGET_VOCAB.decode(row) for row in ids)
    return out


def _length_bucketed_batches(config: DatesConfig, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, ...]]:
    """Endless training batches ``(src_ids, src_mask, tgt_ids)`` of sources of similar length.

    Sources range from 8 to 31 characters; drawing a pool of batches at a time and cutting it by length
    roughly halves the padded positions the encoder computes.
    """
    pool = 8
    while True:
        sources, targets = date_task.make_examples(pool * config.batch_size, rng)
        order = np.argsort([len(s) for s in sources], kind="stable")
        chunks = order.reshape(pool, config.batch_size)  # (pool, B) indices, shortest sources first
        for chunk in chunks[rng.permutation(pool)]:
            yield date_task.encode_batch([sources[i] for i in chunk], [targets[i] for i in chunk])


def train(config: DatesConfig, on_step: Callable[[int, float, float], None] | None = None) -> DatesResult:
    """Train on ``config.steps`` fresh batches, then score greedy and beam-search exact match on held-out dates.

    ``on_step(step, loss, token_accuracy)`` is called after every step (step counts from 1).
    """
    check_num_beams(config.num_beams)  # before training, not after it: the run would be lost
    start, cpu_start = time.perf_counter(), time.process_time()
    model = build_model(config)
    optimizer = Adam(model, lr=config.lr, betas=(0.9, 0.98))
    batches = _length_bucketed_batches(config, np.random.default_rng([config.seed, 2]))
    losses: list[float] = []
    # Tiny matrices: a multi-threaded BLAS only adds synchronisation (and spins on a busy machine).
    with blas_single_thread():
        for step in range(1, config.steps + 1):
            src, mask, tgt = next(batches)
            model.zero_grad()
            logits = model(src, tgt[:, :-1], mask)  # (B, 11, V)
            loss, grad = softmax_cross_entropy(logits, tgt[:, 1:])
            loss = check_loss(loss, step, config.lr)
            model.backward(grad)
            clip_grad_norm(model, config.max_grad_norm)
            optimizer.lr = _learning_rate(step - 1, config)
            optimizer.step()
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss, float(np.mean(logits.argmax(-1) == tgt[:, 1:])))
        train_seconds, train_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        sources, targets = date_task.make_examples(config.eval_size, np.random.default_rng([config.seed, 3]),
                                                   heldout=True)
        model.eval()
        greedy = normalise(model, sources)
        beam = normalise(model, sources, num_beams=config.num_beams)
    return DatesResult(config=config, model=model, losses=losses,
                       greedy_exact_match=float(np.mean([g == t for g, t in zip(greedy, targets, strict=True)])),
                       beam_exact_match=float(np.mean([b == t for b, t in zip(beam, targets, strict=True)])),
                       examples=list(zip(sources[:8], targets[:8], greedy[:8], strict=True)),
                       train_seconds=train_seconds, train_cpu_seconds=train_cpu_seconds,
                       eval_seconds=time.perf_counter() - start - train_seconds)


def alignment(model: Seq2SeqTransformer, source: str) -> tuple[np.ndarray, list[str], list[str]]:
    """Cross-attention of the greedy output over the source characters, averaged over heads, for the last
    decoder block: ``(weights (Lout, Ls), output characters, source characters)``."""
    src, mask = date_task.encode_batch([source])  # (1, Ls) each
    ids = model.generate(src, mask, bos_token_id=date_task.BOS, eos_token_id=date_task.EOS,
                         max_new_tokens=date_task.TARGET_LENGTH - 1, pad_token_id=date_task.PAD)  # (1, 1 + n)
    weights = model.cross_attention_weights(src, ids[:, :-1], mask)  # (N_dec, 1, H, n, Ls)
    out_tokens = [date_task.TARGET_VOCAB.tokens[t] for t in ids[0, 1:]]
    return weights[-1, 0].mean(axis=0), out_tokens, list(source)  # (n, Ls)


@dataclasses.dataclass
class AttentionMaps:
    """Every attention of the encoder-decoder on one source and its greedy output.

    ``encoder`` (N_enc, H, Ls, Ls): the encoder's self-attention over the source characters;
    ``decoder`` (N_dec, H, Lt, Lt): the decoder's causal self-attention over its input (``<bos>`` and the
    output but its last token); ``cross`` (N_dec, H, Lt, Ls): each decoder position reading the source.
    ``source_tokens`` (Ls), ``decoder_tokens`` (Lt, what the decoder reads) and ``output_tokens`` (Lt, what
    it writes at each position)."""

    encoder: np.ndarray
    decoder: np.ndarray
    cross: np.ndarray
    source_tokens: list[str]
    decoder_tokens: list[str]
    output_tokens: list[str]


def attention_maps(model: Seq2SeqTransformer, source: str) -> AttentionMaps:
    """The encoder, decoder and cross-attention weights of every block and head for ``source`` and the model's
    greedy output (what the explorer pages show)."""
    src, mask = date_task.encode_batch([source])  # (1, Ls) each
    ids = model.generate(src, mask, bos_token_id=date_task.BOS, eos_token_id=date_task.EOS,
                         max_new_tokens=date_task.TARGET_LENGTH - 1, pad_token_id=date_task.PAD)  # (1, 1 + n)
    pad = None if mask.all() else mask  # (1, Ls); True = real character
    memory, encoder_w = model.transformer.encoder(model.src_positional(model.src_embedding(src)),
                                                  key_padding_mask=pad, need_weights=True)  # (1, Ls, D)
    h = model.tgt_positional(model.tgt_embedding(ids[:, :-1]))  # (1, Lt, D)
    decoder_w, cross_w = [], []
    for block in model.transformer.decoder.layers:
        h, self_w, cross = block(h, memory, None, None, None, pad, True, True)  # (1, Lt, D)
        decoder_w.append(self_w[0])
        cross_w.append(cross[0])
    vocab = date_task.TARGET_VOCAB.tokens
    return AttentionMaps(np.stack([w[0] for w in encoder_w]), np.stack(decoder_w), np.stack(cross_w),
                         list(source), [vocab[t] for t in ids[0, :-1]], [vocab[t] for t in ids[0, 1:]])


def save_model(result: DatesResult, folder: str | Path) -> tuple[Path, Path]:
    """Write ``model.npz`` and ``model.json`` into ``folder`` (each atomically); returns the two paths."""
    folder = Path(folder)
    model_path, config_path = folder / MODEL_FILE, folder / CONFIG_FILE
    state = result.model.state_dict()
    meta = {"format": _FORMAT, "model": result.config.model_kwargs(), "dtype": "float32",
            "source_characters": "".join(date_task.SOURCE_VOCAB.tokens[3:]),
            "target_characters": "".join(date_task.TARGET_VOCAB.tokens[3:]),
            "training": dataclasses.asdict(result.config),
            "heldout_exact_match": {"greedy": result.greedy_exact_match,
                                    f"beam_{result.config.num_beams}": result.beam_exact_match}}
    atomic_write_files({model_path: lambda f: write_arrays(f, state),
                        config_path: lambda f: f.write((json.dumps(meta, indent=2) + "\n").encode("utf-8"))})
    return model_path, config_path
