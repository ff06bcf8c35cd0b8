"""One key policy for every family's ``config.json``: metadata is accepted, a key that could change the
computation and is not understood is refused by name.

Metadata is what ``save_pretrained`` and ``from_pretrained`` leave in real folders: ``_``-prefixed keys
(``_name_or_path``, ``_model_name_or_path``), any ``*_token_id``, and the generic keys of transformers'
``PretrainedConfig`` (today's, read from the installed transformers, and the 4.x ones that carried generate's
defaults). A folder of each of the 12 families with every one of them present must load and give
transformers' logits."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.pretrained import load_causal_lm, supported_model_types  # noqa: E402
from attnkit.pretrained.families import REGISTRY  # noqa: E402
from hf_models import SPECS, edit_config, hf_logits, left_padded_batch, saved_model  # noqa: E402

# One tiny model of each model_type: the first of the tests' specs built with the family's config class.
ONE_PER_FAMILY = {name: next(spec for spec, (cls, _, _) in SPECS.items() if cls == entry.hf_config_class)
                  for name, entry in REGISTRY.items()}

# What transformers 4.x's PretrainedConfig wrote into every config.json besides today's generic keys (values
# as a real folder carries them), and what from_pretrained adds to a folder it re-saves.
LEGACY_GENERIC = {
    "add_cross_attention": False, "bad_words_ids": None, "begin_suppress_tokens": None, "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None, "decoder_start_token_id": None, "diversity_penalty": 0.0,
    "do_sample": False, "early_stopping": False, "encoder_no_repeat_ngram_size": 0,
    "exponential_decay_length_penalty": None, "finetuning_task": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "is_decoder": False, "length_penalty": 1.0, "max_length": 20, "min_length": 0,
    "no_repeat_ngram_size": 0, "num_beam_groups": 1, "num_beams": 1, "num_return_sequences": 1,
    "output_scores": False, "prefix": None, "pruned_heads": {}, "remove_invalid_values": False,
    "repetition_penalty": 1.0, "return_dict_in_generate": False, "sep_token_id": None, "suppress_tokens": None,
    "task_specific_params": None, "temperature": 1.0, "tf_legacy_loss": False, "tie_encoder_decoder": False,
    "tokenizer_class": None, "top_k": 50, "top_p": 1.0, "torch_dtype": "float32", "torchscript": False,
    "typical_p": 1.0, "use_bfloat16": False, "_model_name_or_path": "google/gemma-3-270m", "unk_token_id": 3,
    "mask_token_id": 4, "_attn_implementation_autoset": True,
}


def every_generic_key() -> dict:
    """Today's PretrainedConfig keys with their default values, plus the legacy ones above."""
    keys = transformers.PretrainedConfig().to_dict()
    keys.pop("model_type")  # the family's own
    return {**LEGACY_GENERIC, **keys, "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
            "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "problem_type": "single_label_classification",
            "output_hidden_states": True, "return_dict": False, "architectures": ["SomethingForCausalLM"]}


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_policy")


def test_one_model_per_supported_family():
    assert sorted(ONE_PER_FAMILY) == sorted(supported_model_types())


@pytest.mark.parametrize("family", sorted(ONE_PER_FAMILY))
def test_a_folder_with_every_generic_key_loads_and_computes_the_same(family, hf_root, tmp_path):
    folder, hf = saved_model(ONE_PER_FAMILY[family], hf_root)
    generic = every_generic_key()
    edited = edit_config(folder, tmp_path / "generic", **{k: v for k, v in generic.items()
                                                          if k not in _family_config(folder)})
    lm = load_causal_lm(edited)
    ids, mask = left_padded_batch(np.random.default_rng(3), (5, 2))
    ours, theirs = lm(ids, mask), hf_logits(hf, ids, mask)
    assert np.max(np.abs(ours[mask] - theirs[mask])) / np.max(np.abs(theirs[mask])) < 2e-5


def _family_config(folder):
    import json

    return json.loads((folder / "config.json").read_text())


# Keys that would change the computation in some model, but not in the family's reader.
REFUSED = [("gpt2", "n_kv_head"), ("llama", "sliding_window"), ("mistral", "attention_bias"),
           ("qwen2", "attention_bias"), ("qwen3", "use_mrope"), ("llama", "rope_local_base_freq"),
           ("gemma2", "rope_local_base_freq"), ("gpt_neox", "num_key_value_heads")]


@pytest.mark.parametrize("family, key", REFUSED)
def test_a_key_that_could_change_the_computation_is_refused_by_name(family, key, hf_root, tmp_path):
    folder, _ = saved_model(ONE_PER_FAMILY[family], hf_root)
    with pytest.raises(ValueError, match=f"{family} config: key {key!r} is not understood"):
        load_causal_lm(edit_config(folder, tmp_path / "edited", **{key: 4}))
