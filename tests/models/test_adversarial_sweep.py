"""Property tests: every public argument of ``generate``, every number of a model folder's ``config.json`` and
every numeric option of ``attnkit generate``, given hostile values (huge, tiny, NaN, inf, negative, wrong type,
empty). Each call either gives a correct result or a ValueError/TypeError naming the argument (the CLI: one
line and exit 2), never another exception, and never a memory spike before the answer."""
from __future__ import annotations

import json
import shutil
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit.models import CausalLM, DecoderConfig, MLPConfig

HOSTILE = [10**400, 10**30, 2**63, 2**31, -1, 0, 1e-300, 5e-324, 1e308, float("nan"), float("inf"), float("-inf"), -0.0,
           "3", "", [], [1, 2], (), np.array([]), np.array([[1, 2]]), True, 3.5, {}, None, object()]
MEMORY_LIMIT = 64 * 2**20  # bytes traced at the peak of one call: a 16-wide two-layer model needs far less

GENERATE_ARGUMENTS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
                      "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "num_return_sequences",
                      "seed", "eos_token_id", "pad_token_id", "num_beams", "length_penalty", "early_stopping")

VOCAB = 32


@pytest.fixture(scope="module")
def lm():
    config = DecoderConfig(family="llama", vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=4, mlp=MLPConfig(24), max_position_embeddings=64)
    return CausalLM(config, rng=3)


def _traced(fn):
    """``(result or the exception raised, peak bytes traced)``."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the test classifies it
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _value_shown(value) -> str:
    return f"{type(value).__name__} {value!r}"[:60]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(GENERATE_ARGUMENTS), value=st.sampled_from(HOSTILE))
def test_generate_answers_every_hostile_argument_correctly_or_by_name(lm, name, value):
    ids = np.array([[1, 5, 9], [3, 3, 7]])
    options = {"max_new_tokens": 3, name: value}
    if name in ("temperature", "top_k", "top_p", "min_p"):
        options["do_sample"] = True  # so the warpers act
    result, peak = _traced(lambda: lm.generate(ids, **options))
    assert peak < MEMORY_LIMIT, (name, _value_shown(value), peak)
    if isinstance(result, Exception):
        assert isinstance(result, (ValueError, TypeError)), (name, _value_shown(value), repr(result))
        assert name in str(result), (name, _value_shown(value), str(result))
        return
    assert result.dtype == np.int64 and result.ndim == 2 and result.shape[0] % 2 == 0, (name, value)
    assert np.array_equal(result[:, :3], np.repeat(ids, result.shape[0] // 2, axis=0))
    assert result.shape[1] <= 3 + (options["max_new_tokens"] if name != "max_new_tokens" else 64)
    assert np.all((result >= 0) & (result < VOCAB)), (name, value, result)


CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import saved_model

    return saved_model("llama_gqa", tmp_path_factory.mktemp("sweep"))[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(CONFIG_KEYS), value=st.sampled_from(HOSTILE[:-1]))  # JSON cannot hold object()
def test_a_hostile_config_value_is_refused_by_name_before_memory_is_spent(llama_folder, tmp_path_factory, key,
                                                                           value):
    from attnkit.pretrained import load_causal_lm

    folder = tmp_path_factory.mktemp("edited")
    for file in llama_folder.iterdir():
        shutil.copy(file, folder / file.name)
    config = json.loads((llama_folder / "config.json").read_text())
    config[key] = value.tolist() if isinstance(value, np.ndarray) else value
    try:
        text = json.dumps(config)  # NaN and inf are written as JSON's NaN / Infinity extensions
    except TypeError:
        return
    (folder / "config.json").write_text(text)
    result, peak = _traced(lambda: load_causal_lm(folder))
    assert peak < MEMORY_LIMIT, (key, _value_shown(value), peak)
    if isinstance(result, Exception):
        assert isinstance(result, (ValueError, TypeError)), (key, _value_shown(value), repr(result))
        # a legal value that disagrees with the checkpoint (num_key_value_heads null = one per query head) is
        # refused by the tensor whose shape it contradicts
        assert key in str(result) or "but the config implies" in str(result), (key, _value_shown(value), str(result))
    else:  # a value that is legal here (e.g. a bool for tie_word_embeddings) gives a working model
        assert result(np.array([[1, 2, 3]])).shape[:2] == (1, 3)


CLI_OPTIONS = ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--num-beams",
               "--length-penalty", "--early-stopping")
CLI_VALUES = ("0", "-1", "1e400", "nan", "inf", "-inf", "99999999999999999999999999999999", "", "x", "3.5",
              "1e-320", "2147483648", " 7", "0x10", "\u0663")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(CLI_OPTIONS), value=st.sampled_from(CLI_VALUES))
def test_cli_generate_answers_hostile_options_with_one_line(llama_folder, capsys, option, value):
    from attnkit.cli import main

    argv = ["generate", str(llama_folder), "--ids", "1,2,3", "--max-new-tokens", "2", option, value]
    result, peak = _traced(lambda: main(argv))
    out, err = capsys.readouterr()
    assert peak < MEMORY_LIMIT, (option, value, peak)
    assert result in (0, 2), (option, value, result, err)
    if result == 2:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert option in err or option.lstrip("-") in err or "argument" in err, err
    else:
        assert err == "" and out.split()[:3] == ["1", "2", "3"]
