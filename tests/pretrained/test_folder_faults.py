"""Model folders with faults a user meets, each refused when the folder loads, naming the file and what is
wrong: generation defaults generate would refuse, a tokenizer that writes ids past the model's vocabulary, a
chat template that is not UTF-8, weights that are a folder or a FIFO; and what must load: valid stop_strings.
Also a ragged prompt (named as input_ids) and ``Tokenizer.id_to_token``."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.pretrained import load, load_causal_lm, load_tokenizer  # noqa: E402


def copy_with(folder, target, file, **changes):
    """``folder`` copied to ``target`` with keys of the JSON ``file`` changed (``...`` deletes a key)."""
    shutil.copytree(folder, target)
    path = target / file
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return target


@pytest.mark.parametrize("key, value, message", [
    ("temperature", -1, "temperature must be a finite positive number, got -1"),
    ("top_p", 1.5, "top_p must be"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite positive number, got 0"),
    ("max_new_tokens", -3, "max_new_tokens"),
    ("stop_strings", [""], "stop_strings must be a non-empty string or a list of them"),
    ("eos_token_id", 10**6, "eos_token_id must be a token id in [0, "),
    ("num_beams", 0, "num_beams"),
])
def test_generation_defaults_generate_would_refuse_are_refused_on_load(chat_folder, tmp_path, key, value, message):
    bad = copy_with(chat_folder, tmp_path / "bad", "generation_config.json", **{key: value})
    with pytest.raises(ValueError) as info:
        load_causal_lm(bad)
    assert "generation_config.json: " in str(info.value) and message in str(info.value)


def test_valid_stop_strings_in_the_folder_stop_generation_with_its_tokenizer(chat_folder, tmp_path):
    model, tok = load(chat_folder)
    prompt = np.array([tok.encode("Hello world, how")])
    plain = model.generate(prompt, max_new_tokens=12, eos_token_id=[])
    text = tok.decode(plain[0, prompt.shape[1]:])
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha())
    folder = copy_with(chat_folder, tmp_path / "stops", "generation_config.json", stop_strings=[stop])
    model, tok = load(folder)
    out = model.generate(prompt, max_new_tokens=12, eos_token_id=[], tokenizer=tok)
    assert out.shape[1] < plain.shape[1] and tok.decode(out[0, prompt.shape[1]:]).count(stop) == 1


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_the_weights_are_read(chat_folder, tmp_path):
    vocab = load_tokenizer(chat_folder).vocab_size
    folder = copy_with(chat_folder, tmp_path / "small", "config.json", vocab_size=vocab - 10)
    (folder / "model.safetensors").write_bytes(b"not read")  # the tokenizer is refused before the weights
    with pytest.raises(ValueError, match=f"tokenizer.json has {vocab} tokens, more than the model's vocabulary of "
                                         f"{vocab - 10}"):
        load(folder)


def test_special_ids_past_the_vocabulary_are_refused(chat_folder, tmp_path):
    vocab = load_tokenizer(chat_folder).vocab_size
    folder = copy_with(chat_folder, tmp_path / "eos", "generation_config.json", eos_token_id=[vocab + 5])
    with pytest.raises(ValueError, match=f"eos_token_id {vocab + 5} is past the model's vocabulary of {vocab}"):
        load(folder)
    with pytest.raises(ValueError, match="eos_token_id must be a token id in"):  # the model alone, too
        load_causal_lm(folder)


@pytest.mark.parametrize("file, key", [("config.json", "pad_token_id"), ("config.json", "bos_token_id"),
                                       ("config.json", "eos_token_id"), ("generation_config.json", "bos_token_id")])
def test_every_special_id_past_the_vocabulary_is_refused_naming_the_key(chat_folder, tmp_path, file, key):
    """A pad_token_id past the vocabulary loaded, then every generate failed with an internal error."""
    vocab = json.loads((chat_folder / "config.json").read_text())["vocab_size"]
    folder = copy_with(chat_folder, tmp_path / "ids", file, **{key: vocab + 3})
    expected = (f"'{key}' = {vocab + 3} is past the vocabulary (vocab_size = {vocab})" if file == "config.json"
                else f"generation_config.json: {key} must be a token id in [0, {vocab}), got {vocab + 3}")
    for loader in (load, load_causal_lm):
        with pytest.raises(ValueError) as info:
            loader(folder)
        assert expected in str(info.value)


def test_a_class_default_id_past_a_small_vocabulary_reads_as_none():
    from attnkit.pretrained.hf_config import decoder_config_from_hf

    # GPT-2's defaults are 50256; a config that states no ids and has 64 tokens has no such token
    config = decoder_config_from_hf({"model_type": "gpt2", "vocab_size": 64, "n_embd": 8, "n_layer": 1, "n_head": 2})
    assert (config.tokens.bos, config.tokens.eos, config.tokens.pad) == (None, None, None)


def test_a_chat_template_that_is_not_utf8_is_refused_naming_the_file(chat_folder, tmp_path):
    folder = shutil.copytree(chat_folder, tmp_path / "latin1")
    (folder / "chat_template.jinja").write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match=r"chat_template.jinja is not UTF-8 text: invalid continuation byte"):
        load_tokenizer(folder)


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_weights_that_are_a_folder_or_a_fifo_are_named(chat_folder, tmp_path, kind):
    folder = shutil.copytree(chat_folder, tmp_path / kind)
    weights = folder / "model.safetensors"
    weights.unlink()
    if kind == "folder":
        weights.mkdir()
        expected = "model.safetensors is a folder"
    else:
        os.mkfifo(weights)
        expected = "model.safetensors is not a regular file"
    with pytest.raises(ValueError, match=expected):
        load_causal_lm(folder)


def test_a_ragged_prompt_is_named_as_input_ids(chat_folder):
    model = load_causal_lm(chat_folder)
    for call in (lambda: model([[1, 2, 3], [4]]), lambda: model.generate([[1, 2, 3], [4]], max_new_tokens=2)):
        with pytest.raises(ValueError, match=r"input_ids must be a rectangular array: its rows have different "
                                             r"lengths \[1, 3\]"):
            call()


def test_id_to_token_is_the_inverse_of_token_to_id(chat_folder):
    tok = load_tokenizer(chat_folder)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert [tok.token_to_id(tok.id_to_token(i)) for i in ids] == ids
    assert tok.convert_ids_to_tokens(np.array(ids)) == [tok.id_to_token(i) for i in ids]
    assert tok.id_to_token(tok.vocab_size + 3) is None and tok.id_to_token(-1) is None
    with pytest.raises(TypeError, match="id must be an int"):
        tok.id_to_token("3")

