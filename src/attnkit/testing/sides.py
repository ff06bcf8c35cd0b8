"""The sides of a comparison: what runs token ids and returns a trace (:mod:`attnkit.testing.trace`).

- :class:`AttnkitSide`: an attnkit ``CausalLM`` (a folder or a GGUF file, in float32 or float64), through its hook
  points (:func:`attnkit.explain.run_with_cache`);
- :class:`TorchSide`: any PyTorch module, through forward hooks on the submodules it names for each trace name,
  and the values it hands to its ``attnkit_record(name, value)`` attribute (the hooks it declares);
- :func:`transformers_side`: a transformers causal LM in eager attention, a :class:`TorchSide` whose points are
  the Llama layout's modules (``model.model.layers[i].input_layernorm``, ``self_attn.q_proj`` / ``q_norm``, ...),
  the rotated heads, probabilities and head outputs read from the modeling module's ``eager_attention_forward``,
  wrapped while the trace runs;
- :class:`RecordedSide`: a trace recorded by any framework, as a mapping or an ``.npz`` file of named arrays.

Every side has ``name``, ``dtype`` (the floating dtype it computes in) and ``trace(ids) -> dict``.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .trace import layer_name, scores_from_probs, split_name

__all__ = ["AttnkitSide", "TorchSide", "RecordedSide", "transformers_side", "torch_side_from_folder",
           "load_torch_weights"]


def _ids_2d(ids: Any) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2) or ids.size == 0:
        raise ValueError(f"input_ids must be a non-empty (L,) or (B, L) array of ints, got {ids.dtype} "
                         f"{ids.shape}")
    return (ids[None] if ids.ndim == 1 else ids).astype(np.int64)  # (B, L)


class AttnkitSide:
    """attnkit's ``CausalLM`` as a side.

    Parameters
    ----------
    model : CausalLM, str or Path
        A model, or a Hugging Face folder or GGUF file loaded with :func:`attnkit.pretrained.load_causal_lm`.
    dtype : numpy float dtype, default float32
        The dtype a path is loaded in (a model keeps its own).
    """

    def __init__(self, model: Any, dtype: Any = np.float32, name: str | None = None) -> None:
        if isinstance(model, (str, Path)):
            from ..pretrained import load_causal_lm

            path, model = str(model), load_causal_lm(model, dtype=dtype, progress=False)
        else:
            path = type(model).__name__
        if not hasattr(model, "named_hook_points"):
            raise TypeError(f"model must be an attnkit CausalLM or a path, got {type(model).__name__}")
        self.model = model
        self.dtype = np.dtype(model.dtype)
        self.name = name or f"attnkit {self.dtype.name} ({path})"

    def trace(self, ids: Any) -> dict[str, np.ndarray]:
        """The trace of ``ids`` (L,) or (B, L): every name this model's layers have."""
        from ..explain import run_with_cache

        ids = _ids_2d(ids)
        logits, cache = run_with_cache(self.model, ids)
        out = {"embed": cache["blocks.0.hook_resid_pre"]}
        for i, layer in enumerate(self.model.layers):
            points = {name.split(".", 2)[2]: value for name, value in cache.items() if name.startswith(f"blocks.{i}.")}
            norm = getattr(layer, "attn_norm", None)
            if norm is not None and type(norm).__name__ != "Identity":
                out[layer_name(i, "norm")] = np.array(norm(points["hook_resid_pre"]))
            for point, op in (("attn.hook_q", "q"), ("attn.hook_k", "k"), ("attn.hook_v", "v"),
                              ("attn.hook_rot_q", "rotary_q"), ("attn.hook_rot_k", "rotary_k"),
                              ("attn.hook_pattern", "probs"), ("attn.hook_z", "heads"),
                              ("hook_attn_out", "attn_out"), ("mlp.hook_router_weights", "router"),
                              ("hook_mlp_out", "mlp"), ("hook_resid_post", "resid")):
                if point in points:
                    out[layer_name(i, op)] = points[point]
        out["logits"] = logits
        return with_scores(out)


def with_scores(trace: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``trace`` with ``layers.{i}.scores`` made from each ``layers.{i}.probs`` it has (and does not already
    have scores for)."""
    for name in [n for n in trace if n.endswith(".probs")]:
        scores = name[: -len("probs")] + "scores"
        if scores not in trace:
            trace[scores] = scores_from_probs(trace[name])
    return trace


class RecordedSide:
    """A recorded trace: a mapping of trace names to arrays, or an ``.npz`` file of them (recorded for the ids
    the comparison runs; ``trace`` refuses other ids when the recording holds ``input_ids``)."""

    def __init__(self, source: Mapping[str, Any] | str | Path, name: str | None = None) -> None:
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise ValueError(f"recorded activations: {str(path)!r} is not a file")
            try:
                with np.load(path, allow_pickle=False) as data:
                    source = {key: data[key] for key in data.files}
            except (ValueError, OSError) as exc:
                raise ValueError(f"recorded activations: cannot read {str(path)!r} as .npz: {exc}") from None
            name = name or f"recorded ({path})"
        if not isinstance(source, Mapping):
            raise TypeError(f"recorded activations must be a mapping or an .npz path, got {type(source).__name__}")
        arrays = {str(k): np.asarray(v) for k, v in source.items()}
        self.input_ids = arrays.pop("input_ids", None)
        for key, value in arrays.items():
            split_name(key)  # a ValueError naming the bad key
            if value.dtype.kind != "f":
                raise ValueError(f"recorded activations: {key!r} has dtype {value.dtype}, expected floats")
        if not arrays:
            raise ValueError("recorded activations: no arrays")
        self.arrays = arrays
        kinds = [v.dtype for k, v in arrays.items() if not k.endswith(".scores")]
        self.dtype = max(kinds or [np.dtype(np.float64)], key=lambda d: np.finfo(d).eps)
        self.name = name or "recorded"

    def trace(self, ids: Any) -> dict[str, np.ndarray]:
        ids = _ids_2d(ids)
        if self.input_ids is not None and not np.array_equal(_ids_2d(self.input_ids), ids):
            raise ValueError(f"recorded activations were recorded for input_ids {self.input_ids.tolist()}, not "
                             f"{ids.tolist()}")
        return with_scores(dict(self.arrays))


class TorchSide:
    """A PyTorch module as a side: forward hooks on the submodules named for trace names, and the values the
    module records itself.

    A module records values no submodule outputs (rotated heads, probabilities) by calling its attribute
    ``attnkit_record(trace_name, tensor)``: the side sets it for the run when the module has it (None otherwise).

    Parameters
    ----------
    module : torch.nn.Module
        Called as ``module(ids)`` with ids (B, L) int64; returns the logits (B, L, V) or an object with ``.logits``.
    points : mapping of str to str, optional
        Trace name (``"layers.0.norm"``) to the dotted path of the submodule whose output it is (the first element
        of a tuple output). Default: the module's ``attnkit_points`` attribute, else none.
    name : str, optional
        Shown in the table (default: the module's class and dtype).
    """

    def __init__(self, module: Any, points: Mapping[str, str] | None = None, name: str | None = None) -> None:
        torch = _torch()

        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.points = dict(getattr(module, "attnkit_points", {}) if points is None else points)
        for key, path in self.points.items():
            split_name(key)
            try:
                module.get_submodule(path)
            except AttributeError:
                raise ValueError(f"points[{key!r}]: the module has no submodule {path!r}") from None
        floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
        self.torch_dtype = floats[0] if floats else torch.float32
        self.dtype = _numpy_dtype(self.torch_dtype)
        self.name = name or f"torch {type(module).__name__} ({str(self.torch_dtype).removeprefix('torch.')})"

    @contextmanager
    def _recording(self, found: dict[str, Any]):
        def keeper(key: str) -> Callable:
            def hook(_module, _inputs, output):
                found[key] = output[0] if isinstance(output, (tuple, list)) else output
            return hook

        handles = [self.module.get_submodule(path).register_forward_hook(keeper(key))
                   for key, path in self.points.items()]
        has_recorder = hasattr(self.module, "attnkit_record")
        if has_recorder:
            self.module.attnkit_record = found.__setitem__
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            if has_recorder:
                self.module.attnkit_record = None

    def _run(self, ids: np.ndarray) -> Any:
        return self.module(self._torch.from_numpy(ids))

    def trace(self, ids: Any) -> dict[str, np.ndarray]:
        torch = _torch()

        self._torch = torch
        ids = _ids_2d(ids)
        found: dict[str, Any] = {}
        with torch.no_grad(), self._recording(found):
            out = self._run(ids)
        logits = getattr(out, "logits", out)
        if isinstance(logits, torch.Tensor):
            found.setdefault("logits", logits)
        return with_scores({key: _to_numpy(value) for key, value in found.items()})


def _torch() -> Any:
    """PyTorch, or an ImportError saying how to install it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError("a PyTorch or transformers side needs PyTorch, which is not installed: "
                          "pip install 'attnkit[torch]'") from exc
    return torch


def _numpy_dtype(torch_dtype: Any) -> np.dtype:
    """The NumPy dtype of a torch float dtype; bfloat16 has none and is reported as its own name's float32 kin
    with bfloat16's precision handled by the caller (``eps``)."""
    name = str(torch_dtype).removeprefix("torch.")
    return np.dtype(name) if name in ("float16", "float32", "float64") else np.dtype(np.float32)


def _to_numpy(value: Any) -> np.ndarray:
    value = value.detach()
    if not value.is_floating_point():
        return value.numpy()
    name = str(value.dtype).removeprefix("torch.")
    return value.numpy() if name in ("float16", "float32", "float64") else value.float().numpy()


# -- transformers ----------------------------------------------------------------------------------------------
class _TransformersSide(TorchSide):
    """A transformers causal LM of the Llama layout (``model.model.layers``), eager attention."""

    def _run(self, ids: np.ndarray) -> Any:
        torch = self._torch
        modeling = {sys.modules[type(layer.self_attn).__module__] for layer in self.module.model.layers}
        # a modeling module without the function (its attention not the eager kind) gives no heads or probabilities
        originals = {mod: mod.eager_attention_forward for mod in modeling if hasattr(mod, "eager_attention_forward")}
        for mod, original in originals.items():
            mod.eager_attention_forward = _recording_attention(original, self._found)
        try:
            return self.module(input_ids=torch.from_numpy(ids), use_cache=False)
        finally:
            for mod, original in originals.items():
                mod.eager_attention_forward = original

    @contextmanager
    def _recording(self, found: dict[str, Any]):
        self._found = found
        layers = self.module.model.layers
        heads_first: set[str] = set()  # the q/k norms that see (B, H, L, Dh) (Gemma 3), not (B, L, H, Dh)
        handles = [layers[0].register_forward_pre_hook(_first_input(found), with_kwargs=True)]
        for i, layer in enumerate(layers):
            for op in ("q", "k"):
                norm = getattr(layer.self_attn, f"{op}_norm", None)
                if norm is not None:
                    handles.append(norm.register_forward_pre_hook(_layout_probe(layer_name(i, op), heads_first)))
            router = getattr(getattr(layer, "mlp", None), "gate", None)
            if router is not None:  # a mixture of experts' router: (logits, weights, indices)
                handles.append(router.register_forward_hook(_router_weights(layer_name(i, "router"), found)))
        try:
            with super()._recording(found):
                yield
        finally:
            for handle in handles:
                handle.remove()
        batch, length = found["embed"].shape[:2] if "embed" in found else (0, 0)
        for i, layer in enumerate(layers):
            if layer_name(i, "router") in found:
                found[layer_name(i, "router")] = found[layer_name(i, "router")].reshape(batch, length, -1)  # (B, L, k)
            head_dim = layer.self_attn.head_dim
            for op in ("q", "k", "v"):
                key = layer_name(i, op)
                if key in found:
                    value = found[key].transpose(1, 2) if key in heads_first else found[key]
                    found[key] = value.reshape(*value.shape[:2], -1, head_dim)  # (B, L, H, Dh)


def _first_input(found: dict[str, Any]) -> Callable:
    def hook(_module, args, kwargs):
        found["embed"] = args[0] if args else kwargs["hidden_states"]
    return hook


def _router_weights(key: str, found: dict[str, Any]) -> Callable:
    """A forward hook keeping a router's chosen experts' weights (B*L, k), when it returns (logits, weights,
    indices)."""
    def hook(_module, _inputs, output):
        if isinstance(output, tuple) and len(output) == 3:
            found[key] = output[1]
    return hook


def _layout_probe(key: str, heads_first: set[str]) -> Callable:
    """A pre-hook noting whether a q/k norm's input is a (B, H, L, Dh) view of (B, L, H, Dh) storage."""
    def hook(_module, args):
        x = args[0]
        if x.ndim == 4 and x.stride(1) < x.stride(2):
            heads_first.add(key)
    return hook


def _recording_attention(original: Callable, found: dict[str, Any]) -> Callable:
    """``original`` (a modeling module's ``eager_attention_forward``) that also records the rotated heads, the
    probabilities and the heads' outputs of the calling layer."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
        layer = getattr(module, "layer_idx", None)
        if layer is None or weights is None:
            return out, weights
        found[layer_name(layer, "rotary_q")] = query.transpose(1, 2)  # (B, L, H, Dh)
        found[layer_name(layer, "rotary_k")] = key.transpose(1, 2)  # (B, S, Hkv, Dh)
        found[layer_name(layer, "probs")] = weights[..., :key.shape[2]]  # (B, H, L, S) without sink columns
        found[layer_name(layer, "heads")] = out  # (B, L, H, Dh)
        return out, weights
    return attention


def _transformers_points(model: Any) -> dict[str, str]:
    """Trace name to submodule path for a transformers causal LM of the Llama layout."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"transformers model {type(model).__name__} has no model.layers: attnkit.testing reads "
                         f"the Llama layout (Llama, Mistral, Qwen, Gemma, OLMo 2, Mixtral, ...)")
    points = {}
    for i, layer in enumerate(layers):
        base = f"model.layers.{i}"
        attn = layer.self_attn
        children = dict(layer.named_children())
        if "input_layernorm" in children:
            points[layer_name(i, "norm")] = f"{base}.input_layernorm"
        for op in ("q", "k"):
            proj = f"{op}_norm" if hasattr(attn, f"{op}_norm") else f"{op}_proj"
            if hasattr(attn, proj):
                points[layer_name(i, op)] = f"{base}.self_attn.{proj}"
        if hasattr(attn, "v_proj"):
            points[layer_name(i, "v")] = f"{base}.self_attn.v_proj"
        post_norms = "post_feedforward_layernorm" in children
        points[layer_name(i, "attn_out")] = f"{base}.post_attention_layernorm" if post_norms else f"{base}.self_attn"
        points[layer_name(i, "mlp")] = f"{base}.post_feedforward_layernorm" if post_norms else f"{base}.mlp"
        points[layer_name(i, "resid")] = base
    return points


def transformers_side(model: Any, name: str | None = None) -> TorchSide:
    """A transformers causal LM (a model, or a folder loaded in float32 with eager attention) as a side.

    Parameters
    ----------
    model : transformers PreTrainedModel, str or Path
        Of the Llama layout (``model.model.layers[i]`` with ``input_layernorm``, ``self_attn.q_proj`` ..., ``mlp``);
        it runs its eager attention (the rotated heads and probabilities are read there).
    """
    if isinstance(model, (str, Path)):
        from ..pretrained._extra import import_extra

        transformers = import_extra("transformers", "run a transformers model")
        torch = _torch()

        folder = str(model)
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # one line per error on the command line, no bars
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                                      dtype=torch.float32).eval()
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        name = name or f"transformers float32 ({folder})"
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation != "eager":
        raise ValueError(f"the transformers model must run eager attention (attn_implementation='eager'), "
                         f"got {implementation!r}")
    side = _TransformersSide(model, _transformers_points(model))
    side.name = name or f"transformers {type(model).__name__} ({side.dtype.name})"
    return side


# -- a user's module with a folder's weights -------------------------------------------------------------------
def load_torch_weights(module: Any, folder: str | Path, name_map: Mapping[str, str] | None = None) -> None:
    """Copy a Hugging Face folder's safetensors tensors into ``module``'s parameters and buffers.

    ``name_map`` maps the module's state-dict names to the folder's tensor names; a name it leaves out is looked
    up as it is. Every tensor of the module's state dict must be found, with the same shape.
    """
    torch = _torch()
    from ..pretrained._extra import import_extra

    load_file = import_extra("safetensors.torch", "read a folder's weights into a PyTorch module").load_file
    stored: dict[str, Any] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        stored.update(load_file(str(file)))
    if not stored:
        raise ValueError(f"{str(folder)!r} has no .safetensors files")
    name_map = dict(name_map or {})
    state = module.state_dict()
    missing = [n for n in state if name_map.get(n, n) not in stored]
    if missing:
        raise ValueError(f"the folder has no tensor for {', '.join(missing[:5])} (give a name map from the module's "
                         f"names to the folder's: {', '.join(sorted(stored)[:4])}, ...)")
    with torch.no_grad():
        for key, target in state.items():
            source = stored[name_map.get(key, key)]
            if tuple(source.shape) != tuple(target.shape):
                raise ValueError(f"{key}: the folder's {name_map.get(key, key)} has shape {tuple(source.shape)}, "
                                 f"the module's {tuple(target.shape)}")
            target.copy_(source.to(target.dtype))


def torch_side_from_folder(factory: Callable, folder: str | Path, name_map: Mapping[str, str] | None = None,
                           name: str | None = None) -> TorchSide:
    """``factory(config)`` (config: the folder's ``config.json`` as a dict) as a side, with the folder's weights
    copied in by :func:`load_torch_weights`."""
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    module = factory(config)
    load_torch_weights(module, folder, name_map)
    module.eval()
    return TorchSide(module, name=name or f"torch {getattr(factory, '__name__', 'module')} ({folder})")
