"""The package root is the table of contents: the main entry points import from ``attnkit`` itself, and it
holds no module that only re-exports another's."""
import ast
import pathlib

import numpy as np

import attnkit


def test_the_main_entry_points_import_from_the_root():
    from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    from attnkit.pretrained import load, load_causal_lm, load_tokenizer, supported_model_types

    assert (attnkit.CausalLM, attnkit.DecoderConfig, attnkit.load, attnkit.load_causal_lm, attnkit.load_tokenizer,
            attnkit.supported_model_types) == (CausalLM, DecoderConfig, load, load_causal_lm, load_tokenizer,
                                               supported_model_types)
    config = attnkit.DecoderConfig(family="llama", vocab_size=9, hidden_size=8, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=4, mlp=MLPConfig(8))
    assert attnkit.CausalLM(config, rng=0)(np.array([[1, 2]])).shape == (1, 2, 9)
    assert "llama" in attnkit.supported_model_types()


def test_the_root_holds_no_re_export_module():
    root = pathlib.Path(attnkit.__file__).parent
    shims = []
    for path in root.glob("*.py"):
        body = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        if body and all(isinstance(node, ast.ImportFrom) and [a.name for a in node.names] == ["*"] for node in body):
            shims.append(path.name)
    assert shims == []
