"""The named chat templates (``attnkit chat --chat-template NAME``) render every conversation exactly as the
template their family ships renders it through ``transformers``: system messages, several turns, the generation
prompt on and off, contents with spaces and line breaks around them. The real templates are test data in
``chat_templates/`` (their sources in ``chat_templates/SOURCES.md``)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
from attnkit.pretrained.chat_template import compile_chat_template, render_chat_template  # noqa: E402
from attnkit.pretrained.named_chat_templates import NAMED_CHAT_TEMPLATES, named_chat_template  # noqa: E402

REAL = Path(__file__).parent / "chat_templates"
SYSTEM = {"role": "system", "content": "You are a terse assistant.\nAnswer in one line."}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello!"}],
    "system and one turn": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    "system and three turns": [SYSTEM, {"role": "user", "content": "  Hi there \n"},
                               {"role": "assistant", "content": " Hello. How can I help?\n"},
                               {"role": "user", "content": "Name a colour."},
                               {"role": "assistant", "content": "Blue."},
                               {"role": "user", "content": "Another one, in\ntwo lines."}],
    "ends with the assistant": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}],
    "system and ends with the assistant": [SYSTEM, {"role": "user", "content": "Say no."},
                                           {"role": "assistant", "content": "No."}],
}
NO_SYSTEM = ("one turn", "ends with the assistant")
TOKENS = {  # each family's special tokens, as its tokenizer names them
    "chatml": {"eos_token": "<|im_end|>"}, "qwen": {"eos_token": "<|im_end|>"},
    "llama2": {"bos_token": "<s>", "eos_token": "</s>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"}, "gemma": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "phi3": {"bos_token": "<s>", "eos_token": "<|endoftext|>"}, "zephyr": {"bos_token": "<s>", "eos_token": "</s>"},
}
# name -> (the real template's file, the special tokens, the conversations it accepts, more variables)
CASES = [
    ("chatml", "transformers-default-chatml.jinja", "chatml", tuple(CONVERSATIONS), {}),
    ("qwen2", "Qwen2-0.5B-Instruct.jinja", "qwen", tuple(CONVERSATIONS), {}),
    ("qwen2.5", "Qwen2.5-0.5B-Instruct.jinja", "qwen", tuple(CONVERSATIONS), {}),
    ("qwen3", "Qwen3-0.6B.jinja", "qwen", tuple(CONVERSATIONS), {}),
    ("qwen3", "Qwen3-0.6B.jinja", "qwen", tuple(CONVERSATIONS), {"enable_thinking": False}),
    ("llama2", "Llama-2-7b-chat.jinja", "llama2", tuple(CONVERSATIONS), {}),
    ("llama3", "Meta-Llama-3-8B-Instruct.jinja", "llama3", tuple(CONVERSATIONS), {}),
    ("llama3.1", "Llama-3.1-8B-Instruct.jinja", "llama3", tuple(CONVERSATIONS), {}),
    ("llama3.1", "Llama-3.2-3B-Instruct.jinja", "llama3", tuple(CONVERSATIONS), {"date_string": "26 Jul 2024"}),
    ("mistral", "Mistral-7B-Instruct-v0.3.jinja", "mistral", tuple(CONVERSATIONS), {}),
    ("gemma", "gemma-3-270m-it.jinja", "gemma", tuple(CONVERSATIONS), {}),
    ("gemma", "gemma-2-2b-it.jinja", "gemma", NO_SYSTEM, {}),  # Gemma 2 refuses system messages
    ("phi3", "Phi-3.5-mini-instruct.jinja", "phi3", tuple(CONVERSATIONS), {}),
    ("phi3", "Phi-3-mini-4k-instruct.jinja", "phi3", tuple(CONVERSATIONS), {}),
    ("zephyr", "TinyLlama-1.1B-Chat-v1.0.jinja", "zephyr", tuple(CONVERSATIONS), {}),
]


def transformers_render(source: str, messages: list[dict], **variables) -> str:
    rendered, _ = chat_template_utils.render_jinja_template(conversations=[messages], chat_template=source,
                                                             **variables)
    return rendered[0]


@pytest.mark.parametrize("name, real, tokens, conversations, extra", CASES,
                         ids=[f"{c[0]}-{c[1].removesuffix('.jinja')}" for c in CASES])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_named_template_renders_what_its_familys_template_renders(name, real, tokens, conversations, extra,
                                                                     add_generation_prompt):
    ours = compile_chat_template(NAMED_CHAT_TEMPLATES[name])
    source = (REAL / real).read_text(encoding="utf-8")
    variables = {**TOKENS[tokens], **extra, "add_generation_prompt": add_generation_prompt}
    for key in conversations:
        messages = CONVERSATIONS[key]
        expected = transformers_render(source, messages, **variables)
        assert render_chat_template(ours, messages=messages, **variables) == expected, key


def test_qwen3_keeps_only_the_reasoning_after_the_last_user_message():
    """Qwen3's own rule, on a conversation whose assistant turns think."""
    messages = [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                {"role": "user", "content": "and 3 + 3?"},
                {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}]
    source = (REAL / "Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    expected = transformers_render(source, messages, add_generation_prompt=False)
    ours = render_chat_template(compile_chat_template(NAMED_CHAT_TEMPLATES["qwen3"]), messages=messages,
                                add_generation_prompt=False)
    assert ours == expected
    assert "add them" not in ours and "<think>\nagain\n</think>\n\n6" in ours


def test_families_refuse_what_their_templates_refuse():
    """Turns that do not alternate are refused by the formats that refuse them, with the family's message."""
    from attnkit.pretrained.chat_template import ChatTemplateError

    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for name in ("llama2", "mistral", "gemma"):
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            render_chat_template(compile_chat_template(NAMED_CHAT_TEMPLATES[name]), messages=twice,
                                 add_generation_prompt=True, bos_token="<s>", eos_token="</s>")


def test_names_are_case_insensitive_and_other_spellings_lead_to_the_same_template():
    assert named_chat_template(" Llama3 ") == NAMED_CHAT_TEMPLATES["llama3"]
    assert named_chat_template("gemma2") == named_chat_template("gemma3") == NAMED_CHAT_TEMPLATES["gemma"]
    assert named_chat_template("llama3.2") == NAMED_CHAT_TEMPLATES["llama3.1"]
    assert named_chat_template("vicuna") is None and named_chat_template("my_template.jinja") is None


def test_the_tokenizer_takes_a_formats_name_after_its_own_templates_names():
    from attnkit.pretrained import Tokenizer

    tok = Tokenizer(None, {}, {"default": "{{ 'own' }}", "gemma": "{{ 'the folder s gemma' }}"})
    assert tok.get_chat_template("llama3") == NAMED_CHAT_TEMPLATES["llama3"]
    assert tok.get_chat_template("gemma") == "{{ 'the folder s gemma' }}"  # the folder's own name comes first
    assert tok.get_chat_template("{{ 'a source' }}") == "{{ 'a source' }}"
    bare = Tokenizer(None, {}, {})
    with pytest.raises(ValueError, match="pass chat_template= a jinja template or the name of a family's format "
                                         r"\(chatml, qwen2"):
        bare.get_chat_template()


@pytest.mark.parametrize("real", sorted(p.name for p in REAL.glob("*.jinja")))
def test_attnkit_renders_each_real_template_as_transformers_does(real):
    """The budgets and the sandbox without constant folding change nothing a real template renders."""
    source = (REAL / real).read_text(encoding="utf-8")
    template = compile_chat_template(source)
    variables = {"bos_token": "<s>", "eos_token": "</s>", "date_string": "26 Jul 2024"}
    for key, messages in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            try:
                expected = transformers_render(source, messages, add_generation_prompt=add_generation_prompt,
                                               **variables)
            except Exception as exc:  # noqa: BLE001 - a template that refuses this conversation: so must ours
                with pytest.raises(ValueError, match=re.escape(str(exc)[:40])):
                    render_chat_template(template, messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
                continue
            assert render_chat_template(template, messages=messages, add_generation_prompt=add_generation_prompt,
                                        **variables) == expected, (key, add_generation_prompt)
