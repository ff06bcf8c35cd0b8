"""docs/names.md lists every alias attnkit accepts, and each alias resolves to its canonical name."""
import pathlib

import numpy as np
import pytest

from attnkit._aliases import ALIASES, resolve
from attnkit.attention import Attention, MultiHeadAttention

NAMES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "names.md"


def _alias_rows() -> list[tuple[str, str]]:
    """(canonical, alias) of each row of the "Accepted aliases" table."""
    text = NAMES.read_text(encoding="utf-8")
    section = text.split("## Accepted aliases", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`"):
            rows.append((cells[1].strip("`"), cells[2].strip("`")))
    return rows


def test_every_registered_alias_is_in_the_table_and_nothing_else():
    assert sorted(_alias_rows()) == sorted((canonical, alias) for (_, alias), canonical in ALIASES.items())


def test_multi_head_attention_aliases_read_and_write_the_canonical_attribute():
    mha = MultiHeadAttention(d_model=8, num_heads=2, rng=0)
    assert (mha.embed_dim, mha.d_model, mha.d_k, mha.head_dim) == (8, 8, 4, 4)
    x = np.random.default_rng(0).normal(size=(1, 3, 8))
    mask = np.tril(np.ones((3, 3), bool))
    out_mask, _ = mha(x, x, x, mask=mask)
    out_attn_mask, _ = mha(x, x, x, attn_mask=mask)
    np.testing.assert_array_equal(out_mask, out_attn_mask)
    with pytest.raises(ValueError, match=r"attn_mask or its alias mask"):
        mha(x, x, x, attn_mask=mask, mask=~mask)
    with pytest.raises(ValueError, match=r"embed_dim or its alias d_model"):
        MultiHeadAttention(8, 2, d_model=4)


def test_attention_future_mask_is_is_causal():
    attn = Attention(future_mask=True)
    assert attn.future_mask is True and attn.is_causal is True
    attn.future_mask = False
    assert attn.is_causal is False


def test_resolve_refuses_unregistered_aliases():
    with pytest.raises(KeyError, match="not a registered alias"):
        resolve("MultiHeadAttention", "embed_dim", 8, "width", 8)
