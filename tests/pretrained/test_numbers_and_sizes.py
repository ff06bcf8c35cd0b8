"""Numbers, sizes and shapes in a model folder: every number of ``config.json`` and ``generation_config.json``
goes through one checked conversion (a ValueError naming the file and the key, never an OverflowError), every
scale, multiplier and soft-cap lies in float16's normal range, and the config's sizes meet the checkpoint's
tensor shapes before anything is computed or allocated for them."""
import json
import re
import tracemalloc

import numpy as np
import pytest

from attnkit.decoding import GenerationConfig
from attnkit.pretrained import decoder_config_from_hf, load_causal_lm, supported_model_types
from hf_models import edit_config, saved_model

HUGE = 10**400  # a JSON integer Python reads, but no float holds: float(HUGE) raises OverflowError
DIGITS = "an integer of 401 digits"


def _edited(tmp_path, name, **changes):
    return edit_config(saved_model(name, tmp_path)[0], tmp_path / "edited", **changes)


# -- one checked conversion -------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, says", [
    (dict(rope_theta=HUGE), "'rope_theta' must be a finite positive number"),
    (dict(rms_norm_eps=HUGE), "'rms_norm_eps' must be a positive number up to 65504"),
    (dict(partial_rotary_factor=HUGE), "'partial_rotary_factor' must be a finite positive number"),
    (dict(rope_parameters={"rope_type": "linear", "factor": HUGE, "rope_theta": 100.0}),
     "'factor' must be a finite positive number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": HUGE}), "'rope_theta' must be a finite positive"),
    (dict(max_position_embeddings=HUGE), "'max_position_embeddings' must be a positive integer up to 2147483647"),
    (dict(vocab_size=HUGE), "'vocab_size' must be a positive integer up to 2147483647"),
    (dict(num_hidden_layers=HUGE), "'num_hidden_layers' must be a positive integer up to 1048576"),
])
def test_an_integer_too_large_for_a_float_in_config_json_is_refused_naming_the_file_and_key(tmp_path, changes,
                                                                                            says):
    """0.4 raised "OverflowError: int too large to convert to float" for the float keys (reported by the CLI as
    attnkit's internal error); an int key must be refused as out of range, not converted later."""
    folder = _edited(tmp_path, "llama_gqa", **changes)
    with pytest.raises(ValueError) as info:
        load_causal_lm(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'config.json'}: llama config: ") and says in message, message
    assert message.endswith(f"got {DIGITS}"), message


@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps", "max_position_embeddings"])
def test_a_number_python_cannot_read_is_refused_naming_the_file(tmp_path, key):
    """Past 4300 digits Python's json refuses the integer itself (a bare ValueError without the file's name)."""
    folder = _edited(tmp_path, "llama_gqa")
    text = (folder / "config.json").read_text()
    config = json.loads(text)
    config[key] = 0
    (folder / "config.json").write_text(json.dumps(config).replace(f'"{key}": 0', f'"{key}": {"9" * 5000}'))
    with pytest.raises(ValueError, match=rf"^{folder / 'config.json'} is not a JSON file attnkit reads: it holds an "
                                         r"integer of more than 4300 digits$"):
        load_causal_lm(folder)


GENERATION_KEYS = {"temperature": "temperature must be a finite positive number",
                   "top_p": r"top_p must be a number in \[0, 1\]", "min_p": r"min_p must be a number in \[0, 1\]",
                   "repetition_penalty": "repetition_penalty must be a finite positive number",
                   "length_penalty": "length_penalty must be a finite number",
                   "max_new_tokens": "max_new_tokens must be at most 2147483647",
                   "num_return_sequences": "num_return_sequences must be at most 1024"}


@pytest.mark.parametrize("key", list(GENERATION_KEYS))
def test_an_integer_too_large_for_a_float_in_generation_config_json_is_refused_naming_the_file(tmp_path, key):
    folder = _edited(tmp_path, "llama_gqa")
    (folder / "generation_config.json").write_text(json.dumps({key: HUGE, "do_sample": True}))
    with pytest.raises(ValueError, match=rf"^{folder / 'generation_config.json'}: {GENERATION_KEYS[key]}, got "
                                         rf"{DIGITS}$"):
        load_causal_lm(folder)


@pytest.mark.parametrize("value", [HUGE, -HUGE, 10**5000], ids=["10**400", "-10**400", "10**5000"])
@pytest.mark.parametrize("key", list(GENERATION_KEYS))
def test_generation_config_and_generate_refuse_a_huge_integer_naming_the_argument(key, value):
    """The same numbers as arguments: GenerationConfig(...) and generate(...) (whose options are a
    GenerationConfig over the model's), a ValueError naming the argument and the integer's length."""
    from attnkit.models import CausalLM, DecoderConfig, MLPConfig

    with pytest.raises(ValueError, match=rf"^{key} must be .*, got (an|a negative) integer of (401|5001) digits"):
        GenerationConfig(**{key: value, "do_sample": True})
    lm = CausalLM(DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=4, mlp=MLPConfig(12)), rng=0)
    with pytest.raises(ValueError, match=rf"^{key} must be"):
        lm.generate(np.array([[1, 2]]), **{key: value, "do_sample": True})


# -- scales, multipliers and soft-caps -----------------------------------------------------------------------
FACTOR = r"must be a number in \[2\*\*-14, 65504\] \(float16's normal range\)"


@pytest.mark.parametrize("name, key, value", [
    ("deepseek_v3", "routed_scaling_factor", 1e308),  # the case found: every logit NaN, silently
    ("deepseek_v3", "routed_scaling_factor", 5e-324),
    ("gemma2", "final_logit_softcapping", 1e-320),  # 0 in float32: the logits divided by 0
    ("gemma2", "final_logit_softcapping", 1e308),  # inf in float32: inf * 0 = NaN
    ("gemma2", "attn_logit_softcapping", 1e-320),
    ("gemma2", "query_pre_attn_scalar", 5e-324),  # a scale of 4.5e161: the scores overflow
    ("gemma2", "query_pre_attn_scalar", 1e300),
    ("gpt_oss", "swiglu_alpha", 1e308),  # alpha * gate is inf, times a gate of 0: NaN
    ("gpt_oss", "swiglu_limit", 1e-320),
])
def test_a_scale_multiplier_or_softcap_outside_float16s_range_is_refused_naming_the_key(tmp_path, name, key, value):
    folder = _edited(tmp_path, name, **{key: value})
    got = re.escape(repr(value))
    with pytest.raises(ValueError, match=rf"config.json: {name} config: '{key}' {FACTOR}, got {got}$"):
        load_causal_lm(folder)


@pytest.mark.parametrize("name, key", [("llama_gqa", "rms_norm_eps"), ("gpt2", "layer_norm_epsilon")])
def test_a_norm_epsilon_that_overflows_where_it_is_added_is_refused(tmp_path, name, key):
    """A norm's epsilon is added to the variance in the model's dtype: 1e308 loaded on 0.4 and overflowed (a
    RuntimeWarning, then every activation 0)."""
    folder = _edited(tmp_path, name, **{key: 1e308})
    with pytest.raises(ValueError, match=rf"'{key}' must be a positive number up to 65504, got 1e\+308$"):
        load_causal_lm(folder)


def test_the_case_found_gave_nan_logits_and_the_edges_of_the_range_still_compute(tmp_path):
    """routed_scaling_factor 1e308 loaded on 0.4 and every logit was NaN; 65504 (the range's top) is finite."""
    from attnkit.pretrained.families import family

    folder, _ = saved_model("deepseek_v3", tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"'routed_scaling_factor' {FACTOR}, got 1e\+308"):
        family("deepseek_v3").config_from_hf({**raw, "routed_scaling_factor": 1e308})
    for value in (65504.0, 2.0 ** -14):
        lm = load_causal_lm(edit_config(folder, tmp_path / f"edge-{value}", routed_scaling_factor=value))
        assert lm.config.experts.routed_scaling_factor == value
        assert np.isfinite(lm(np.array([[1, 2, 3]]))).all()


def test_a_derived_softmax_scale_outside_the_range_names_where_it_comes_from():
    base = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 8,
            "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "moe_intermediate_size": 8, "first_k_dense_replace": 1}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0}
    with pytest.raises(ValueError, match=r"deepseek_v3 config: the softmax scale, .* mscale_all_dim, is inf; it must "
                                         r"be in \[2\*\*-14, 65504\]"):
        decoder_config_from_hf({**base, "rope_scaling": dict(yarn, mscale_all_dim=1e308)})
    decoder_config_from_hf({**base, "rope_scaling": dict(yarn, mscale_all_dim=1.0)})  # DeepSeek's own


# -- sizes meet the checkpoint before anything is allocated ----------------------------------------------------
def _peak(fn):
    tracemalloc.start()
    try:
        try:
            fn()
        except ValueError as exc:
            return str(exc), tracemalloc.get_traced_memory()[1]
        return None, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name, key", [
    ("gemma4_text", "head_dim"),  # the case found: 3.7 GB of rotary frequencies before the shape check
    ("llama_yarn", "head_dim"),
    ("gpt_oss", "head_dim"),  # YaRN by default
    ("llama_gqa", "intermediate_size"),
    ("gemma2", "vocab_size"),
])
def test_a_claimed_size_is_refused_by_the_tensor_it_contradicts_before_anything_is_allocated(tmp_path, name, key):
    folder = _edited(tmp_path, name, **{key: 10**9})
    message, peak = _peak(lambda: load_causal_lm(folder))
    assert message is not None and "has shape" in message and "but the config implies" in message, message
    assert peak < 5e6, peak  # 0.4: 4.0 GB for gemma4_text's head_dim (500,000,000 float64 frequencies)


@pytest.mark.parametrize("name, key", [
    ("mistral_window", "num_hidden_layers"),  # 0.4 built a tuple of 10**9 layer types first (8 GB)
    ("qwen3_next", "num_hidden_layers"),  # and looped over 10**9 layers for the sparse ones
    ("qwen3_next", "num_experts"),  # 0.4 built 3 * 10**9 tensor maps before comparing any shape
    ("deepseek_v3", "n_routed_experts"),
])
def test_a_claimed_count_costs_nothing_before_the_checkpoint_refuses_it(tmp_path, name, key):
    folder = _edited(tmp_path, name, **{key: 10**9})
    message, peak = _peak(lambda: load_causal_lm(folder))
    assert message is not None and (f"'{key}' must be a positive integer up to 1048576" in message
                                    or "cannot match a checkpoint of" in message), message
    assert peak < 5e6, peak


def test_every_size_of_every_family_is_checked_before_it_costs_memory(tmp_path):
    """Every integer of every family's tiny config.json (token ids aside) set to 10**9: each load is refused
    by a ValueError or, where no tensor depends on the number (the context, a window), loads; never above
    5 MB traced."""
    from hf_models import FAMILY_MODELS

    seen = set()
    for name in FAMILY_MODELS:
        folder, _ = saved_model(name, tmp_path)
        config = json.loads((folder / "config.json").read_text())
        if config["model_type"] in seen:
            continue
        seen.add(config["model_type"])
        for key, value in config.items():
            if isinstance(value, bool) or not isinstance(value, int) or key.endswith("_token_id"):
                continue
            edited = edit_config(folder, tmp_path / f"{name}-{key}", **{key: 10**9})
            message, peak = _peak(lambda folder=edited: load_causal_lm(folder))
            assert peak < 5e6, (name, key, peak, message)
    assert seen == set(supported_model_types())  # every family
