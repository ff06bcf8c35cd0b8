"""Error tables: how far attnkit and transformers are from each other, and each from attnkit's float64 run.

For one causal LM saved by transformers, :func:`measure_model` runs the same token ids through

* transformers in float32 and with its weights in bfloat16 (the model saved in bfloat16 and loaded with
  ``from_pretrained(dtype=torch.bfloat16)``, computing in bfloat16, as such checkpoints run),
* attnkit in float32 and in float64, loading the float32 folder and the bfloat16 folder (the same rounded
  weights transformers runs; attnkit widens them on load),

and measures three quantities: the logits, the last hidden state (the head's input, after the final norm) and
the gradient of the loss (mean next-token cross-entropy) with respect to the token-embedding matrix, which
every layer's backward reaches. Each error is ``max |a - b| / max |b|`` (:func:`relative_error`), ``b`` the
second named side. The embedding gradient's row of the model's ``pad_token_id`` is left out: transformers'
``nn.Embedding(padding_idx=...)`` gives that row no gradient by convention (it is never trained), while attnkit
gives every row its exact gradient, and the two differ wherever the pad id appears among the tokens.

================================  ===========================================================================
comparison (key)                  meaning
================================  ===========================================================================
``ak32_vs_hf32``                  attnkit float32 against transformers float32 (the same float32 weights)
``hf32_vs_ak64``                  transformers float32 against attnkit float64: transformers' own float32 error
``ak32_vs_ak64``                  attnkit float32 against attnkit float64: attnkit's own float32 error
``ak32_vs_hfbf16``                attnkit float32 against transformers bfloat16 (the same bfloat16 weights)
``hfbf16_vs_ak64``                transformers bfloat16 against attnkit float64 on those weights
``ak32_vs_ak64_bf16w``            attnkit float32 against float64, both on the bfloat16 weights
``ak32_vs_hf32_bf16w``            attnkit float32 against transformers float32, both on the bfloat16 weights:
                                  the two read the same numbers from the bfloat16 checkpoint
================================  ===========================================================================

By FlashAttention's rule, an implementation in a dtype is right when its error against the float64 oracle is
at most about twice another correct implementation's in that dtype: compare ``hf32_vs_ak64`` with
``ak32_vs_ak64``.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from ..pretrained import load_causal_lm
from .conformance import relative_error

__all__ = ["COMPARISONS", "QUANTITIES", "measure_model"]

QUANTITIES = ("logits", "hidden", "grad")
COMPARISONS = ("ak32_vs_hf32", "hf32_vs_ak64", "ak32_vs_ak64", "ak32_vs_hfbf16", "hfbf16_vs_ak64",
               "ak32_vs_ak64_bf16w", "ak32_vs_hf32_bf16w")


def _loss_grad(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Gradient (B, L, V) of the mean next-token cross-entropy with respect to the logits, in their dtype."""
    z = logits - logits.max(axis=-1, keepdims=True)  # (B, L, V)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    grad = np.zeros_like(p)
    rows, cols = np.meshgrid(np.arange(ids.shape[0]), np.arange(ids.shape[1] - 1), indexing="ij")
    grad[:, :-1] = p[:, :-1]
    grad[rows, cols, ids[:, 1:]] -= 1.0
    return grad / (ids.shape[0] * (ids.shape[1] - 1))  # (B, L, V): the last position predicts nothing


def _attnkit_run(folder: Path, dtype, ids: np.ndarray) -> dict[str, np.ndarray]:
    """attnkit's logits, last hidden state and embedding gradient of ``folder`` in ``dtype`` (float64 copies)."""
    lm = load_causal_lm(folder, dtype=dtype, progress=False)
    hidden = lm.norm.forward(lm.layer_outputs(ids)[-1])  # (B, L, D): the head's input
    lm.zero_grad()
    logits = lm(ids)  # (B, L, V)
    lm.backward(_loss_grad(logits, ids))
    grad = dict(lm.named_gradients())["embed.weight"]  # (V, D)
    return {"logits": logits.astype(np.float64), "hidden": hidden.astype(np.float64),
            "grad": grad.astype(np.float64)}


def _transformers_run(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    """transformers' logits, last hidden state and embedding gradient (float64 copies)."""
    import torch

    tokens = torch.from_numpy(ids)
    with torch.no_grad():
        # the decoder stack itself (Llama 4's text model answers get_decoder and base_model with itself)
        decoder = model.get_decoder()
        decoder = model.model if decoder is model else decoder
        hidden = decoder(input_ids=tokens).last_hidden_state  # (B, L, D)
    model.zero_grad()
    logits = model(input_ids=tokens).logits  # (B, L, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    grad = model.get_input_embeddings().weight.grad  # (V, D)
    return {"logits": logits.detach().double().numpy(), "hidden": hidden.double().numpy(),
            "grad": grad.double().numpy()}


def _transformers_load(folder: Path, dtype):
    """The folder loaded as users load a checkpoint (``from_pretrained`` with ``dtype``): buffers such as the
    rotary frequencies are computed by the model, not rounded with the weights. Eager attention and experts
    (torch's grouped_mm needs 16-byte strides, which tiny bfloat16 experts do not have)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    return model.eval()


def measure_model(folder: str | Path, model, input_ids: np.ndarray,
                  work_dir: str | Path) -> dict[str, dict[str, float]]:
    """The error table's row of one model: ``{comparison: {quantity: error}}`` (:data:`COMPARISONS`,
    :data:`QUANTITIES`).

    Parameters
    ----------
    folder : path
        The model saved by ``save_pretrained`` in float32.
    model : transformers causal LM
        The same model, float32, in eval mode (not changed: the bfloat16 run uses a copy).
    input_ids : ndarray of int, shape (B, L)
        Tokens, L >= 2 (no padding).
    work_dir : path
        An empty folder for the bfloat16 copy of the model.
    """
    import torch

    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"input_ids must have shape (B, L) with L >= 2, got {ids.shape}")
    bf16_folder = Path(work_dir) / "bfloat16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(bf16_folder)  # the weights rounded, as published
    runs = {"hf32": _transformers_run(model, ids),
            "hfbf16": _transformers_run(_transformers_load(bf16_folder, torch.bfloat16), ids),
            "hf32_bf16w": _transformers_run(_transformers_load(bf16_folder, torch.float32), ids),
            "ak32": _attnkit_run(Path(folder), np.float32, ids), "ak64": _attnkit_run(Path(folder), np.float64, ids),
            "ak32_bf16w": _attnkit_run(bf16_folder, np.float32, ids),
            "ak64_bf16w": _attnkit_run(bf16_folder, np.float64, ids)}
    pad = getattr(model.config, "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad < runs["ak32"]["grad"].shape[0]:  # see the module's docstring
        for run in runs.values():
            run["grad"] = np.delete(run["grad"], pad, axis=0)  # (V - 1, D)
    pairs = {"ak32_vs_hf32": ("ak32", "hf32"), "hf32_vs_ak64": ("hf32", "ak64"), "ak32_vs_ak64": ("ak32", "ak64"),
             "ak32_vs_hfbf16": ("ak32_bf16w", "hfbf16"), "hfbf16_vs_ak64": ("hfbf16", "ak64_bf16w"),
             "ak32_vs_ak64_bf16w": ("ak32_bf16w", "ak64_bf16w"), "ak32_vs_hf32_bf16w": ("ak32_bf16w", "hf32_bf16w")}
    return {key: {q: relative_error(runs[a][q], runs[b][q]) for q in QUANTITIES} for key, (a, b) in pairs.items()}
