"""One tensor of a Hugging Face checkpoint and where it goes in attnkit's model: :class:`TensorMap`.

A family module (:mod:`attnkit.pretrained.families`) states its checkpoint as a list of these; the checkpoint
reader (:mod:`attnkit.pretrained.checkpoint`) validates headers and converts tensors with them, and
:func:`~attnkit.pretrained.checkpoint.checkpoint_tensors` gathers them back for saving.

Weight layouts. attnkit computes ``x @ W`` with W (in, out). Hugging Face ``nn.Linear`` stores (out, in), so
those weights are transposed. GPT-2's ``Conv1D`` already stores (in, out). A transposing layout turns the last two
axes, so a stack of matrices (experts' (E, out, in)) is transposed matrix by matrix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.packed import PackedWeight

__all__ = ["TensorMap"]


@dataclass(frozen=True)
class TensorMap:
    """One checkpoint tensor and where it goes.

    Attributes
    ----------
    source : str
        Hugging Face name, without the ``transformer.`` / ``model.`` prefix of the base model.
    shape : tuple of int
        Its shape in the checkpoint.
    targets : tuple of str
        attnkit parameter names (three for a fused ``c_attn``, else one).
    layout : {"copy", "transpose", "split", "head_split", "head_split_transpose", "row_split_transpose",
              "interleaved_split", "reshape", "head_row_split_transpose"}
        ``copy``: same layout; ``transpose``: (..., out, in) -> (..., in, out); ``split``: equal parts of the
        last axis;
        ``head_split``: a first axis laid out (heads, parts, Dh), each part gathered over the heads (GPT-NeoX's
        fused ``query_key_value``: every head's q, k, v rows together); ``head_split_transpose``: that, then
        each part transposed.
    heads : int
        The number of heads of a ``head_split`` layout (0 otherwise).
        ``interleaved_split``: the last axis alternates the parts (gpt-oss's ``gate_up_proj``: gate, up, gate,
        up, ...), each part gathered with a stride.
    scales : str
        Set when ``source`` holds MXFP4 blocks (gpt-oss's quantized experts): the name of their scales tensor;
        ``shape`` and ``layout`` then describe the dequantized array.
    sizes : tuple of int
        ``row_split_transpose``: the rows (the next-to-last axis) cut into parts of these sizes, each transposed
        (Phi-3's fused ``qkv_proj`` (Hq*Dh + 2 Hkv*Dh, D) and ``gate_up_proj`` (2F, D); Granite 4 hybrid's stacked
        experts' ``input_linear`` (E, 2F, D)). ``reshape``: the parameter's shape,
        the same numbers in the same order (a depthwise ``Conv1d``'s (C, 1, K) weight as (C, K)).
        ``head_row_split_transpose``: the first axis laid out (heads, sum(sizes)), every head's rows cut into
        parts of these sizes, each part gathered over the heads; parts whose target repeats are stacked in
        order, then each target transposed (Qwen3-Next's ``in_proj_qkvz``: every key head's q, k, v and z rows;
        targets ``(W_qkv, W_qkv, W_qkv, W_z)``).
    stack_index, stack_size : int
        ``stack_size > 0``: each target is a stack of ``stack_size`` arrays and this tensor is entry
        ``stack_index`` of it (an expert's matrix, stored in the checkpoint one expert per tensor, as Qwen3-Next
        and DeepSeek-V3 do, in attnkit's (E, ...) parameter).
    """

    source: str
    shape: tuple[int, ...]
    targets: tuple[str, ...]
    layout: str
    heads: int = 0
    sizes: tuple[int, ...] = ()
    scales: str = ""
    stack_index: int = 0
    stack_size: int = 0

    @property
    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape on disk: ``source`` alone, or an MXFP4 pair (``scales`` set): ``source`` the
        blocks (E, R, C / 32, 16) and ``scales`` (E, R, C / 32) of the logical (E, C, R) ``shape``."""
        if not self.scales:
            return {self.source: self.shape}
        e, c, r = self.shape
        return {self.source: (e, r, c // 32, 16), self.scales: (e, r, c // 32)}

    def target_shapes(self) -> dict[str, tuple[int, ...]]:
        """attnkit parameter name -> the shape it receives (a stacked target's whole stack)."""
        shapes = self._part_shapes()
        return {t: (self.stack_size, *s) for t, s in shapes.items()} if self.stack_size else shapes

    def destination(self, params: dict[str, Any], target: str) -> np.ndarray:
        """The array :meth:`convert`'s ``target`` value is copied into: the parameter, or its entry
        ``stack_index`` of a stack."""
        return params[target][self.stack_index] if self.stack_size else params[target]

    def _head_rows(self) -> dict[str, list[tuple[int, int]]]:
        """``head_row_split_transpose``: each target's parts as (offset within a head's rows, size), in order."""
        parts: dict[str, list[tuple[int, int]]] = {}
        for target, offset, size in zip(self.targets, np.cumsum((0,) + self.sizes[:-1]), self.sizes):
            parts.setdefault(target, []).append((int(offset), size))
        return parts

    def _part_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.layout == "head_row_split_transpose":
            return {t: (self.shape[1], self.heads * sum(n for _, n in p)) for t, p in self._head_rows().items()}
        if self.layout == "transpose":
            return {self.targets[0]: (*self.shape[:-2], *self.shape[-2:][::-1])}
        if self.layout == "split":
            part = self.shape[:-1] + (self.shape[-1] // len(self.targets),)
            return {t: part for t in self.targets}
        if self.layout == "row_split_transpose":
            return {t: (*self.shape[:-2], self.shape[-1], n) for t, n in zip(self.targets, self.sizes)}
        if self.layout == "interleaved_split":
            part = self.shape[:-1] + (self.shape[-1] // len(self.targets),)
            return {t: part for t in self.targets}
        if self.layout.startswith("head_split"):
            part = (self.shape[0] // len(self.targets),) + self.shape[1:]
            return {t: part[::-1] if self.layout.endswith("transpose") else part for t in self.targets}
        if self.layout == "reshape":
            return {self.targets[0]: self.sizes}
        return {self.targets[0]: self.shape}

    def parts_apart(self, sources: tuple[str, ...]) -> list[TensorMap]:
        """A ``row_split_transpose`` map as one ``transpose`` map per part, part ``i`` read from the tensor
        ``sources[i]``: the same parameters, from a checkpoint that stores the fused tensor's parts apart
        (llama.cpp's ``ffn_gate`` and ``ffn_up`` of Granite's ``input_linear``).

        Raises
        ------
        ValueError
            For another layout, or a count of sources other than the parts'.
        """
        if self.layout != "row_split_transpose" or len(sources) != len(self.targets) or self.stack_size:
            raise ValueError(f"{self.source}: only an unstacked row_split_transpose map is read from its parts apart, "
                             f"one source per target ({len(self.targets)}); got layout {self.layout!r} and "
                             f"{len(sources)} sources")
        return [TensorMap(source, (*self.shape[:-2], size, self.shape[-1]), (target,), "transpose")
                for source, target, size in zip(sources, self.targets, self.sizes)]

    def convert(self, array: np.ndarray) -> dict[str, np.ndarray]:
        """The attnkit arrays made from the checkpoint array (views where possible)."""
        if self.layout == "transpose":
            return {self.targets[0]: array.swapaxes(-1, -2)}
        if self.layout == "split":
            return dict(zip(self.targets, np.split(array, len(self.targets), axis=-1)))
        if self.layout == "row_split_transpose":
            parts = np.split(array, np.cumsum(self.sizes)[:-1], axis=-2)  # (..., size, In) each
            return {t: p.swapaxes(-1, -2) for t, p in zip(self.targets, parts)}
        if self.layout == "interleaved_split":
            n = len(self.targets)
            return {t: np.ascontiguousarray(array[..., i::n]) for i, t in enumerate(self.targets)}  # (..., F) each
        if self.layout.startswith("head_split"):
            n = len(self.targets)
            grouped = array.reshape(self.heads, n, -1, *array.shape[1:])  # (H, parts, Dh, ...)
            parts = [grouped[:, j].reshape(-1, *array.shape[1:]) for j in range(n)]  # (H*Dh, ...) each
            return dict(zip(self.targets, (p.T for p in parts) if self.layout.endswith("transpose") else parts))
        if self.layout == "reshape":
            return {self.targets[0]: array.reshape(self.sizes)}
        if self.layout == "head_row_split_transpose":
            grouped = array.reshape(self.heads, sum(self.sizes), -1)  # (heads, rows per head, In)
            return {t: np.concatenate([grouped[:, o:o + n].reshape(-1, grouped.shape[-1]) for o, n in p]).T
                    for t, p in self._head_rows().items()}  # (In, heads * rows of the target)
        return {self.targets[0]: array}

    def convert_packed(self, packed: PackedWeight) -> dict[str, PackedWeight] | None:
        """:meth:`convert` of a packed checkpoint array, the parts still packed: each part a set of its stored
        rows (whole blocks), each transpose the same blocks read the other way. None for a layout that would cut
        through stored rows (the caller then dequantizes, and :meth:`convert` does it).

        Layouts kept packed: ``copy``, ``transpose`` (a matrix); ``split`` and ``interleaved_split`` along the
        stored rows (a transposed packed weight's last axis: GPT-2's ``c_attn``, gpt-oss's ``gate_up_proj``);
        ``row_split_transpose`` along them (an untransposed matrix's first axis: Phi-3's fused ``qkv_proj``).
        """
        if self.stack_size:
            return None
        n = len(self.targets)
        if self.layout == "copy":
            return {self.targets[0]: packed}
        if self.layout == "transpose" and packed.ndim == 2:
            return {self.targets[0]: packed.T}
        if self.layout in ("split", "interleaved_split") and packed.transposed:
            width = packed.shape[-1] // n
            cuts = [slice(i * width, (i + 1) * width) if self.layout == "split" else slice(i, None, n)
                    for i in range(n)]
            return {t: packed.take_rows(cut) for t, cut in zip(self.targets, cuts)}
        if self.layout == "row_split_transpose" and packed.ndim == 2 and not packed.transposed:
            ends = np.cumsum(self.sizes).tolist()
            return {t: packed.take_rows(slice(end - size, end)).T for t, size, end in zip(self.targets, self.sizes,
                                                                                             ends)}
        return None

    def gather(self, params: dict[str, Any]) -> Any:
        """The checkpoint array made back from attnkit's parameters (the inverse of :meth:`convert`), contiguous."""
        if self.layout == "head_row_split_transpose":
            dtype = np.asarray(params[self.targets[0]]).dtype
            grouped = np.empty((self.heads, sum(self.sizes), self.shape[1]), dtype)  # (heads, rows per head, In)
            for target, parts in self._head_rows().items():
                rows = np.asarray(self.destination(params, target)).T  # (heads * rows of the target, In)
                start = 0
                for offset, size in parts:
                    part = rows[start:start + self.heads * size]  # (heads * size, In)
                    grouped[:, offset:offset + size] = part.reshape(self.heads, size, -1)
                    start += self.heads * size
            return grouped.reshape(self.shape)
        parts = [np.asarray(self.destination(params, t)) for t in self.targets]
        if self.layout == "transpose":
            return np.ascontiguousarray(parts[0].swapaxes(-1, -2))
        if self.layout == "split":
            return np.concatenate(parts, axis=-1)
        if self.layout == "row_split_transpose":
            rows = [p.swapaxes(-1, -2) for p in parts]  # (..., size, In) each
            return np.ascontiguousarray(np.concatenate(rows, axis=-2))  # (..., sum(sizes), In)
        if self.layout == "interleaved_split":
            return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)  # (..., n*F), parts alternating
        if self.layout.startswith("head_split"):
            if self.layout.endswith("transpose"):
                parts = [p.T for p in parts]  # (H*Dh, In) each
            grouped = [p.reshape(self.heads, -1, *p.shape[1:]) for p in parts]  # (H, Dh, ...) each
            return np.ascontiguousarray(np.stack(grouped, axis=1).reshape(self.shape))  # (H*parts*Dh, ...)
        if self.layout == "reshape":  # np.array, not np.ascontiguousarray, which makes a 0-d array 1-d
            return np.array(parts[0].reshape(self.shape), order="C")
        return np.ascontiguousarray(parts[0])
