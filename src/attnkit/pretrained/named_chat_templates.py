"""The chat formats of common model families, by name, for models that arrive without a chat template.

Some GGUF files (Gemma 3's, older conversions) and some folders carry no chat template; ``attnkit chat
--chat-template NAME`` (and :meth:`Tokenizer.apply_chat_template`'s ``chat_template=NAME``) then use one of
these. Each renders a conversation of ``system``, ``user`` and ``assistant`` messages exactly as the template
its family ships renders it (``tests/pretrained/test_named_chat_templates.py`` compares them with the real ones
through ``transformers``); tool calls and images are left to the model's own template.

========== =================================================== ===============================================
name       family (the template it renders like)               system message
========== =================================================== ===============================================
chatml     ChatML (OpenHermes, SmolLM, transformers' former     its own turn
           default template)
qwen2      Qwen2-Instruct: ChatML, a default system message     its own turn ("You are a helpful assistant.")
qwen2.5    Qwen2.5-Instruct: ChatML, Qwen's default message     its own turn ("You are Qwen, created by ...")
qwen3      Qwen3: ChatML with ``<think>`` blocks; earlier       its own turn
           reasoning dropped, ``enable_thinking=False`` works
llama2     Llama-2-chat: ``<s>[INST] ... [/INST]``              ``<<SYS>>`` inside the first user turn
llama3     Meta-Llama-3-Instruct: header tokens                 its own turn
llama3.1   Llama-3.1/3.2/3.3-Instruct: Llama 3, a dated         the dated system turn (``date_string``, default
           system turn                                          "26 Jul 2024")
mistral    Mistral-7B-Instruct-v0.3: ``[INST] ... [/INST]``     before the last user message, if that is last
gemma      Gemma 2 and 3: ``<start_of_turn>user/model``         prefixed to the first user turn
phi3       Phi-3 and Phi-3.5: ``<|user|> ... <|end|>``          its own turn (left out when empty)
zephyr     Zephyr, TinyLlama-Chat: ``<|user|>`` ... eos         its own turn
========== =================================================== ===============================================

The templates use the tokenizer's ``bos_token`` and ``eos_token`` where their family does, so the tokens come
from the model being chatted with.
"""
from __future__ import annotations

__all__ = ["NAMED_CHAT_TEMPLATES", "named_chat_template"]

_CHATML_TURNS = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _chatml_with_default_system(default: str) -> str:
    return (
        "{%- if messages[0]['role'] != 'system' %}\n"
        f"    {{{{- '<|im_start|>system\\n{default}<|im_end|>\\n' }}}}\n"
        "{%- endif %}\n" + _CHATML_TURNS)


_QWEN3 = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{#- Reasoning is kept only for the assistant turns after the last user message. #}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages %}
    {%- if message['role'] == 'user' and not (message['content'].startswith('<tool_response>')
            and message['content'].endswith('</tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = message['content'] %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

_LLAMA2 = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set content = message['content'] %}
    {%- if loop.first and system_message is defined %}
        {%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + content %}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + content.strip() + ' ' + eos_token }}
    {%- endif %}
{%- endfor %}
"""

_LLAMA3_TURNS = """\
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim
        + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_LLAMA3 = "{%- if messages %}\n    {{- bos_token }}\n{%- endif %}\n" + _LLAMA3_TURNS

_LLAMA3_1 = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- if date_string is not defined %}
    {%- set date_string = '26 Jul 2024' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' + system_message + '<|eot_id|>' }}
""" + _LLAMA3_TURNS

_MISTRAL = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate '
                            'user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' and loop.last and system_message is defined %}
        {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial '
                            'optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

_GEMMA = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'
        + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

_PHI3 = """\
{%- for message in messages %}
    {%- if message['role'] in ('user', 'assistant') or (message['role'] == 'system' and message['content']) %}
        {{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- else %}
    {{- eos_token }}
{%- endif %}
"""

_ZEPHYR = """\
{%- for message in messages %}
    {%- if message['role'] in ('user', 'system', 'assistant') %}
        {{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}
    {%- endif %}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|assistant|>\\n' }}
    {%- endif %}
{%- endfor %}
"""

NAMED_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML_TURNS,
    "qwen2": _chatml_with_default_system("You are a helpful assistant."),
    "qwen2.5": _chatml_with_default_system("You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": _QWEN3,
    "llama2": _LLAMA2,
    "llama3": _LLAMA3,
    "llama3.1": _LLAMA3_1,
    "mistral": _MISTRAL,
    "gemma": _GEMMA,
    "phi3": _PHI3,
    "zephyr": _ZEPHYR,
}

# Other spellings people type for the same formats.
_ALIASES = {"gemma2": "gemma", "gemma3": "gemma", "phi3.5": "phi3", "qwen": "qwen2", "qwen2.5-coder": "qwen2.5",
            "llama3.2": "llama3.1", "llama3.3": "llama3.1", "tinyllama": "zephyr"}


def named_chat_template(name: str) -> str | None:
    """The template of a format's name (``"chatml"``, ``"llama3"``, ... or one of their other spellings such
    as ``"gemma3"``, case-insensitive), or None when it names none.

    Examples
    --------
    >>> named_chat_template("ChatML") == NAMED_CHAT_TEMPLATES["chatml"]
    True
    >>> named_chat_template("gemma3") == NAMED_CHAT_TEMPLATES["gemma"], named_chat_template("template.jinja")
    (True, None)
    """
    key = name.strip().lower()
    return NAMED_CHAT_TEMPLATES.get(_ALIASES.get(key, key))
