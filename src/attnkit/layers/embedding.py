"""``Embedding``: a learnable lookup table from integer token ids to vectors.

Dimension letters: ``...`` any leading dims of the ids (e.g. (B, L)), V ``num_embeddings``, D ``embedding_dim``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal

__all__ = ["Embedding"]


class Embedding(Module):
    """Token embedding ``y[..., :] = weight[ids[...], :]`` (``torch.nn.Embedding``, same layout).

    Parameters
    ----------
    num_embeddings : int
        Vocabulary size V.
    embedding_dim : int
        Vector size D.
    padding_idx : int, optional
        An id whose row starts at zero and never receives a gradient (as in torch).
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, std^2)`` initial table.
    std : float, default 1.0
        Standard deviation of the initial table (1 as torch; 0.02 as GPT-2 and Llama).

    Attributes
    ----------
    weight : ndarray, shape (V, D); ``grads["weight"]`` the same. Or a packed (quantized) table
        (:class:`~attnkit.kernels.packed.PackedWeight`, ``load(..., keep_quantized=True)``): a lookup then
        dequantizes only the rows it reads, and the table has no gradient.

    Shapes
    ------
    ids : integer array (...) with values in [0, V) -> y : (..., D) in the table's dtype (float64 unless
    the module was converted with ``astype``). ``backward`` returns ``None``: integer ids have no gradient.

    Examples
    --------
    >>> emb = Embedding(5, 3, padding_idx=0, rng=0)
    >>> ids = np.array([[1, 2, 2], [0, 4, 1]])
    >>> y = emb(ids)
    >>> y.shape, np.array_equal(y[0, 1], emb.weight[2])
    ((2, 3, 3), True)
    >>> emb.backward(np.ones_like(y))
    >>> emb.grads["weight"][:, 0]  # row i collects one gradient per occurrence of id i, padding excepted
    array([0., 2., 2., 0., 1.])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: int | None = None,
                 rng: np.random.Generator | int | None = None, std: float = 1.0) -> None:
        super().__init__()
        self.num_embeddings = check_positive_int(num_embeddings, "num_embeddings")
        self.embedding_dim = check_positive_int(embedding_dim, "embedding_dim")
        if padding_idx is not None:
            padding_idx = check_positive_int(padding_idx, "padding_idx", allow_zero=True)
            if padding_idx >= self.num_embeddings:
                raise ValueError(f"padding_idx = {padding_idx} is out of range for num_embeddings = "
                                 f"{self.num_embeddings}")
        self.padding_idx = padding_idx
        table = normal(as_generator(rng), (self.num_embeddings, self.embedding_dim), std=std)  # (V, D)
        if padding_idx is not None:
            table[padding_idx] = 0.0
        self.register_parameter("weight", table)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"padding_idx={self.padding_idx}")

    def forward(self, ids: Any) -> np.ndarray:
        """Look up every id; returns (..., D). Saves the ids for :meth:`backward`."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding: ids must be an integer array, got dtype {ids.dtype} with shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(f"Embedding: ids must lie in [0, num_embeddings={self.num_embeddings}), got min "
                             f"{ids.min()} and max {ids.max()} (ids shape {ids.shape})")
        self.save_for_backward(ids)
        return self._parameters["weight"][ids]  # (..., D)

    def backward(self, grad_output: Any) -> None:
        """Scatter-add ``grad_output`` (..., D) into ``grads["weight"]`` row by id; returns ``None``."""
        if self.saved_tensors is None:
            raise RuntimeError("Embedding.backward called before forward")
        if not self.grads.wanted:  # the table's gradient is all an embedding's backward forms
            return None
        weight_grad = self.grads["weight"]
        (ids,) = self.saved_tensors
        g = check_grad_output(grad_output, ids.shape + (self.embedding_dim,), weight_grad.dtype, "Embedding")
        flat_ids = ids.reshape(-1)  # (N,)
        flat_g = g.reshape(-1, self.embedding_dim)  # (N, D)
        if self.padding_idx is not None:
            flat_g = np.where((flat_ids == self.padding_idx)[:, None], 0, flat_g)  # (N, D)
        np.add.at(weight_grad, flat_ids, flat_g)
        return None
