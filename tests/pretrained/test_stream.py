"""``CausalLM.stream``: one prompt's continuation as text pieces, the text generate decodes, never half of a
character."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.pretrained import load  # noqa: E402


def test_stream_yields_the_text_generate_decodes_piece_by_piece(chat_folder):
    model, tok = load(chat_folder)
    prompt = "Caf\u00e9 cr\u00e8me and \u65e5\u672c"
    ids = tok.encode(prompt)
    out = model.generate(np.array([ids]), max_new_tokens=12, do_sample=False, eos_token_id=[])
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    pieces = list(model.stream(prompt, tok, max_new_tokens=12, do_sample=False, eos_token_id=[]))
    assert "".join(pieces) == expected and len(pieces) > 1
    assert all("\ufffd" not in piece or "\ufffd" in expected for piece in pieces)
    assert "".join(model.stream(np.array(ids), tok, max_new_tokens=12, eos_token_id=[])) == expected
    with pytest.raises(ValueError, match="stream takes one prompt"):
        next(model.stream(np.array([ids, ids]), tok))
    with pytest.raises(ValueError, match="stream cannot run beam search"):
        next(model.stream(prompt, tok, num_beams=2))
