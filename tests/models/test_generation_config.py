"""GenerationConfig: generate's options in one object, validated once when made, read from a folder's
generation_config.json when it loads, and replaced option by option by a call's arguments."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from attnkit.decoding import GenerationConfig
from attnkit.decoding.sampling import generate, generate_stream
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

LM = DecoderConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=4, mlp=MLPConfig(12))


def test_the_options_are_written_once_as_the_fields_and_every_entry_point_takes_them():
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    for function in (generate, generate_stream, CausalLM.generate):
        parameters = inspect.signature(function).parameters
        assert not fields & set(parameters), function.__qualname__
        assert parameters["options"].kind is inspect.Parameter.VAR_KEYWORD
    lm = CausalLM(LM, rng=0)
    every = dict(max_new_tokens=2, min_new_tokens=1, top_k=3, repetition_penalty=1.1, no_repeat_ngram_size=2,
                 eos_token_id=[], prompt_lookup_num_tokens=2, max_matching_ngram_size=1)
    assert set(every) <= fields
    assert lm.generate([[1, 2, 1]], **every).shape == (1, 5)
    for function in (lambda **o: generate(lm, [[1, 2]], **o), lambda **o: list(generate_stream(lm, [[1, 2]], **o)),
                     lambda **o: lm.generate([[1, 2]], **o)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'.*GenerationConfig's fields"):
            function(max_tokens=3)


@pytest.mark.parametrize("options, match", [
    (dict(temperature=-1.0), "temperature must be a finite positive number"),
    (dict(top_p=1.5), "top_p"),
    (dict(num_beams=2, do_sample=True), "beam sampling"),
    (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences \(3\) must be at most num_beams \(2\)"),
    (dict(num_beams=2, stop_strings="x"), "stop_strings is not supported with num_beams > 1"),
    (dict(num_return_sequences=2), "needs do_sample=True"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
    (dict(max_new_tokens=2**31), "max_new_tokens must be at most"),
    (dict(stop_strings=[""]), "stop_strings must be a non-empty string"),
])
def test_a_combination_generate_cannot_run_is_refused_when_made(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GenerationConfig(**options)


def test_from_dict_ignores_what_generate_does_not_read_and_updated_replaces_given_options():
    config = GenerationConfig.from_dict({"temperature": 0.5, "do_sample": True, "top_k": None,
                                         "transformers_version": "5.24.0", "_from_model_config": True})
    assert (config.temperature, config.do_sample, config.top_k) == (0.5, True, None)
    assert config.updated(temperature=None, top_k=3) == dataclasses.replace(config, top_k=3)
    assert config.stop_strings is None and GenerationConfig(stop_strings="ab").stop_strings == ("ab",)
    with pytest.raises(TypeError, match="unknown generation options \\['temprature'\\]"):
        config.updated(temprature=0.1)
    assert GenerationConfig.from_dict(config.to_dict()) == config


def test_a_config_object_gives_what_its_options_as_arguments_give():
    lm = CausalLM(LM, rng=0)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    config = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=4, temperature=0.8)
    by_object = generate(lm, ids, generation_config=config, seed=3)
    by_arguments = generate(lm, ids, max_new_tokens=5, do_sample=True, top_k=4, temperature=0.8, seed=3)
    np.testing.assert_array_equal(by_object, by_arguments)
    lm.generation_config = config  # the model's defaults, and an argument over them
    np.testing.assert_array_equal(lm.generate(ids, seed=3), by_object)
    np.testing.assert_array_equal(lm.generate(ids, seed=3, max_new_tokens=2), by_object[:, :5])
    lm.generation_config = GenerationConfig()
    beams = GenerationConfig(max_new_tokens=4, num_beams=3)
    np.testing.assert_array_equal(lm.generate(ids, generation_config=beams),
                                  generate(lm, ids, max_new_tokens=4, num_beams=3))
    with pytest.raises(TypeError, match="generation_config must be a GenerationConfig, got str"):
        generate(lm, ids, generation_config="greedy")
