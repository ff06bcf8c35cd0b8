"""Tokenizer folders for the text tests: a byte-level BPE tokenizer with chat special tokens, saved by
``transformers`` (so its files are exactly what ``save_pretrained`` writes), and chat templates to render."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = ["Hello world, how are you today?", "The quick brown fox jumps over the lazy dog.",
          "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve co\u00f6perate \u00fcber.",
          "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002",
          "Emoji \U0001f600\U0001f680 and symbols \u20ac\u00a3\u00a5.", "You are a helpful assistant."] * 4

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# Llama-2 style: system folded into the first user turn, bos/eos from the special tokens, raise_exception.
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
# Whitespace control, namespace, tojson and loop controls, as modern templates use them.
TOOLS = """{%- set ns = namespace(count=0) -%}
{%- if tools %}
<tools>{{ tools | tojson }}</tools>
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
<sys>{{ message.content }}</sys>
        {%- continue %}
    {%- endif %}
    {%- set ns.count = ns.count + 1 %}
<{{ message.role }} n="{{ ns.count }}">{{ message.content | trim }}</{{ message.role }}>
{%- endfor %}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]


def write_chat_tokenizer(folder: Path, chat_template: str = CHATML, *, template_file: bool = True,
                         bos: bool = False):
    """A byte-level BPE tokenizer in ``folder`` written by ``transformers``' ``save_pretrained``; returns the
    ``transformers`` tokenizer. ``bos=True`` makes the post-processor prepend ``<s>``."""
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                                special_tokens=[("<s>", backend.token_to_id("<s>"))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    if not template_file:  # the older layout: the template inside tokenizer_config.json
        import json
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "chat_template.jinja").unlink()
    return tok


def write_chat_model(folder: Path, seed: int = 0):
    """A tiny random Llama whose vocabulary is :func:`write_chat_tokenizer`'s, saved with its tokenizer and a
    ChatML template in ``folder``; returns (hf_model, hf_tokenizer)."""
    import transformers

    import torch

    tok = write_chat_tokenizer(folder)
    config = transformers.LlamaConfig(vocab_size=tok.backend_tokenizer.get_vocab_size(), hidden_size=32,
                                      intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=3,
                                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so the logits differ clearly between tokens
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model, tok
