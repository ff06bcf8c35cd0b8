"""Config values that pass a first look but used to crash later or raise the wrong type, and JSON files that
are not what they claim: each is one ValueError naming the key or the file, before any model is built."""
import json
import shutil
import tracemalloc

import pytest

from attnkit.io import read_json
from attnkit.pretrained import decoder_config_from_hf, load_causal_lm, load_tokenizer, read_decoder_config
from hf_models import saved_model

BASE = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("changes,match", [
    (dict(rope_theta=1, rope_scaling=YARN), "rope_theta must be greater than 1 for rope_type 'yarn', got 1.0"),
    (dict(rope_parameters=dict(YARN, rope_theta=0.5)), "rope_theta must be greater than 1 for rope_type 'yarn'"),
    (dict(rope_scaling={"rope_type": ["linear"], "factor": 2.0}), r"rope_type'\] \['linear'\] is not supported"),
    (dict(rope_scaling={"rope_type": 3, "factor": 2.0}), r"rope_type'\] 3 is not supported"),
    (dict(hidden_act=["silu"]), r"'hidden_act' must be one of .*, got \['silu'\]"),
    (dict(hidden_act={"silu": 1}), r"'hidden_act' must be one of .*, got \{'silu': 1\}"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 16}),
     r"'low_freq_factor'\] \(1.0\) must be smaller than \['high_freq_factor'\] \(1.0\)"),
    (dict(rope_scaling=dict(YARN, beta_fast=5e-324)),  # was OverflowError: cannot convert float infinity to integer
     r"rope_scaling\['beta_fast'\] = 5e-324 puts YaRN's correction range at log\(16 / \(5e-324 \* 2 pi\)\)"),
    (dict(rope_scaling=dict(YARN, beta_slow=1e308)),  # was ValueError: math domain error
     r"rope_scaling\['beta_slow'\] = 1e\+308 puts YaRN's correction range at log\(16 / \(1e\+308 \* 2 pi\)\)"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0, 1.0],
                        "original_max_position_embeddings": 1}),  # was ZeroDivisionError
     r"rope_scaling\['original_max_position_embeddings'\] = 1 leaves longrope's attention factor "
     r"sqrt\(1 \+ ln\(factor\) / ln\(1\)\) undefined"),
])
def test_values_that_used_to_crash_later_are_refused_up_front(changes, match):
    with pytest.raises(ValueError, match=match):
        decoder_config_from_hf({**BASE, **changes})


TABLES = r"the rotary cos/sin tables must be finite in float16 \(at most 65504\)"


@pytest.mark.parametrize("scaling,match", [
    (dict(YARN, mscale=1e308, mscale_all_dim=1.0),
     r"\['mscale'\] = 1e\+308 with \['mscale_all_dim'\] = 1.0 gives an attention factor of 1.2175\d*e\+307"),
    (dict(YARN, mscale=1e10, mscale_all_dim=1.0), r"\['mscale'\] = 10000000000.0 with \['mscale_all_dim'\] = 1.0 "
                                                  r"gives an attention factor of 1217511438"),
    (dict(YARN, factor=1e300, mscale=1e308, mscale_all_dim=1e308),
     r"\['mscale'\] = 1e\+308 with \['mscale_all_dim'\] = 1e\+308 gives an attention factor of nan"),
    (dict(YARN, factor=1e300, mscale=1.0, mscale_all_dim=1e308),
     r"\['mscale'\] = 1.0 with \['mscale_all_dim'\] = 1e\+308 gives an attention factor of 0.0"),
    (dict(YARN, attention_factor=1e39), r"\['attention_factor'\] = 1e\+39 gives an attention factor of 1e\+39"),
    (dict(YARN, attention_factor=1e5), r"\['attention_factor'\] = 100000.0 gives an attention factor of 100000.0"),
    (dict(YARN, factor=5e-324), r"\['factor'\] = 5e-324 gives inverse frequencies up to (inf|nan)"),
    ({"rope_type": "linear", "factor": 5e-324}, r"\['factor'\] = 5e-324 gives inverse frequencies up to inf"),
    ({"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0, 5e-324], "attention_factor": 2.0,
      "original_max_position_embeddings": 16}, r"\['long_factor'\] = \[1.0, 5e-324\] gives inverse frequencies up "
                                               r"to inf"),
    ({"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0, 1.0], "attention_factor": 7e4,
      "original_max_position_embeddings": 16}, r"\['attention_factor'\] = 70000.0 gives an attention factor"),
])
def test_rope_scalings_whose_tables_overflow_are_refused_naming_the_key(scaling, match):
    """Each value is a finite positive number, as the key requires, yet the cos/sin tables built from it were
    inf or NaN (NaN logits), in float16 and mostly in float32 too. The check computes the tables' extreme rows
    as the rotary layer does."""
    config = {**BASE, "head_dim": 4, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=rf"llama config: rope_scaling{match}.*; {TABLES}"):
        decoder_config_from_hf(config)


def test_rope_scalings_at_the_edge_of_the_tables_load():
    """The largest attention factor whose tables fit float16 is accepted, and real YaRN settings (DeepSeek's
    mscale = mscale_all_dim, gpt-oss's defaults) are untouched."""
    edge = decoder_config_from_hf({**BASE, "rope_scaling": dict(YARN, attention_factor=65504.0)})
    assert edge.rotary.scaling["attention_factor"] == 65504.0
    deepseek = decoder_config_from_hf({**BASE, "rope_scaling": dict(YARN, factor=40.0, mscale=0.707,
                                                                    mscale_all_dim=0.707)})
    assert deepseek.rotary.scaling["mscale"] == 0.707


@pytest.mark.parametrize("text,match", [
    ("[" * 100_000, "is not valid JSON: nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "is not valid JSON: nested too deeply"),
    ("{", "is not valid JSON: Expecting property name"),
    ("[1, 2]", "must hold a JSON object, got list"),
])
def test_json_files_that_are_not_what_they_claim(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        read_decoder_config(tmp_path)


def test_json_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "tokenizer_config.json"
    path.write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON: not UTF-8 text \(invalid start "
                                         r"byte at byte 15\)"):
        read_json(path)


def test_a_nested_tokenizer_config_is_one_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel",
                                                        "vocab": {"a": 0}, "unk_token": "a"}}))
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON: nested too deeply"):
        load_tokenizer(tmp_path)


def test_a_claimed_depth_beyond_the_checkpoint_costs_nothing(tmp_path):
    folder = shutil.copytree(saved_model("llama_gqa", tmp_path)[0], tmp_path / "deep")  # the shared one stays
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1_000_000
    (folder / "config.json").write_text(json.dumps(config))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="num_hidden_layers = 1000000 cannot match a checkpoint of 35 tensors"):
            load_causal_lm(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20e6  # (building a map of a million layers took 4.7 GB)
