"""attnkit.pretrained.load_tokenizer against transformers' AutoTokenizer on folders written by save_pretrained:
encode/decode, left-padded batches, special tokens, chat templates and streaming."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attnkit.pretrained import load_tokenizer
from text_models import CHATML, CORPUS, LLAMA2, TOOLS, write_chat_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Caf\u00e9?"},
     {"role": "assistant", "content": "  Yes \U0001f600  "}, {"role": "user", "content": "\u65e5\u672c\u8a9e"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": None},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
]
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "tools": TOOLS}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def folders(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_chat_tokenizer(folder, TEMPLATES[request.param], template_file=request.param != "llama2",
                              bos=request.param == "llama2")
    return transformers.AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_renders_as_transformers(folders, conversation, add_generation_prompt):
    hf, tok = folders
    chat = CONVERSATIONS[conversation]
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "<b>&'x'</b> m\u00e9t\u00e9o",
                                                "parameters": {"type": "object", "properties": {}}}}]
    text = hf.apply_chat_template(chat, tokenize=False, tools=tools, **kwargs)
    assert tok.apply_chat_template(chat, tokenize=False, tools=tools, **kwargs) == text
    expected = hf.apply_chat_template(chat, tools=tools, **kwargs)
    got = tok.apply_chat_template(chat, tools=tools, **kwargs)
    assert got["input_ids"] == list(expected["input_ids"])
    assert got["attention_mask"] == list(expected["attention_mask"])
    assert tok.apply_chat_template(chat, tools=tools, return_dict=False, **kwargs) == \
        hf.apply_chat_template(chat, tools=tools, return_dict=False, **kwargs)


def test_batched_conversations_render_each(folders):
    hf, tok = folders
    chats = CONVERSATIONS[:2]
    assert tok.apply_chat_template(chats, tokenize=False) == hf.apply_chat_template(chats, tokenize=False)


def test_raise_exception_in_a_template_is_a_chat_template_error_with_its_message(tmp_path):
    from attnkit.pretrained import ChatTemplateError

    write_chat_tokenizer(tmp_path, LLAMA2)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ChatTemplateError, match="refused the conversation: Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)


def test_the_sandbox_refuses_python_internals(tmp_path):
    from attnkit.pretrained import ChatTemplateError

    write_chat_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ChatTemplateError, match="attribute '__class__' of 'list' object is unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                chat_template="{{ messages.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="underscore-prefixed attributes"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                chat_template="{% set ns = namespace(_x=1) %}")


def test_encode_decode_and_special_tokens_match_transformers(folders):
    hf, tok = folders
    for text in CORPUS[:6]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True) == text
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(tok, name) == getattr(hf, name), name
    assert tok.special_tokens == {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}


def test_batch_is_left_padded_as_transformers_pads_left(folders):
    hf, tok = folders
    texts = CORPUS[:4]
    expected = hf(texts, padding=True, padding_side="left", return_tensors="np")
    got = tok(texts)
    assert got["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(got["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(got["attention_mask"], expected["attention_mask"])
    assert got["attention_mask"][:, -1].all() and not got["attention_mask"].all()


def test_stream_decode_joins_to_the_whole_and_never_splits_a_character(folders):
    _, tok = folders
    text = " ".join(CORPUS[:6])
    ids = tok.encode(text, add_special_tokens=False)
    pieces = list(tok.stream_decode(iter(ids)))
    assert "".join(pieces) == tok.decode(ids) == text
    assert len(pieces) > 10  # it streams, rather than emitting everything at the end
    assert not any("\ufffd" in p for p in pieces)
    multi_byte = [i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i])]
    assert multi_byte  # the corpus does split characters across tokens: the case above is exercised


def test_generation_config_supplies_the_eos_list(tmp_path):
    write_chat_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (2, 0)


def test_bad_folders_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    write_chat_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_load_returns_the_model_and_its_tokenizer(tmp_path):
    from attnkit.pretrained import load
    from text_models import write_chat_model

    folder = tmp_path / "chat"
    write_chat_model(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], "temperature": 0.7}))
    model, tok = load(folder)
    assert list(model.generation_config.eos_token_id) == [1, 2] and model.generation_config.temperature == 0.7
    assert tok.eos_token_ids == (1, 2) and tok.vocab_size == 300
