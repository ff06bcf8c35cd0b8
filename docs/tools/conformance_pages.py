"""Write the conformance pages docs/conformance/{torch-sdpa,flex-attention,transformers}.md: each referee run
through ``attnkit.testing.check_attention`` on every case in every dtype, its tables and what they show.

Run with ``make conformance-pages`` (needs torch and transformers; about half a minute, most of it eager
flex_attention). The pages are checked in; tests/testing/test_attention_adapters.py checks their findings on
the installed versions.
"""
from __future__ import annotations

import platform
import sys
import warnings
from pathlib import Path

from attnkit.testing import check_attention
from attnkit.testing.attention_adapters import sdpa_backends, torch_flex_attention, torch_sdpa, transformers_attention
from attnkit.testing.conformance import TOLERANCE

# What each finding means for someone porting code between the referee and attnkit.
EXPLAIN = {
    "causal corner at the top left (query i sees keys j <= i)":
        "With fewer queries than keys (a decoding step or a chunk after a cache), the causal mask is aligned at "
        "the top left: query i sees keys 0..i, so the last queries do not see the newest keys. attnkit (and "
        "transformers' models, which build their masks from the cache positions) align it at the bottom right: "
        "query i sits at position i + Lk - Lq. With Lq = Lk the two agree.",
    "fully masked rows are NaN":
        "A query whose mask allows no key gets NaN (a softmax over nothing but -inf). attnkit returns a zero "
        "row and zero gradients.",
    "fully masked rows average every value (uniform weights)":
        "A query whose mask allows no key gets the plain average of all the values, masked ones included: the "
        "mask is the dtype's most negative finite number added to every score, so the row's softmax is uniform. "
        "attnkit returns a zero row. Such rows are padding in practice, and nothing downstream should read them, "
        "but a loss or a statistic over all positions will.",
    "soft-cap ignored":
        "The `softcap` keyword argument is accepted and silently ignored by this generic function: Gemma 2's "
        "soft-capping lives in its own eager function (modeling_gemma2.eager_attention_forward).",
    "sinks ignored":
        "The `s_aux` keyword argument (gpt-oss's attention sinks) is accepted and silently ignored by this "
        "generic function: gpt-oss uses its own eager function.",
    "float64 inputs computed at float32 precision":
        "Given float64 tensors, the result is only as accurate as float32: the softmax is taken in float32 "
        "(`softmax(..., dtype=torch.float32)`) and cast back, and in float64 the dtype's most negative "
        "number used as the mask becomes -inf in float32, which is where the NaN rows come from.",
}
NOTES = {
    "torch-sdpa": (
        "torch's `scaled_dot_product_attention` on each backend that runs on this CPU, chosen with "
        "`torch.nn.attention.sdpa_kernel`. The adapter passes `is_causal`, a boolean `attn_mask` (True = "
        "take part, attnkit's convention too), `scale` and `enable_gqa`; SDPA has no argument for a window, "
        "a soft-cap, sinks or ALiBi (they can be folded into a float `attn_mask`, which is the caller's "
        "arithmetic, not SDPA's), and it refuses `is_causal` together with a mask."),
    "flex-attention": (
        "torch's `flex_attention` in eager mode (on CPU it runs unfused and has no backward, so gradients are "
        "not checked). The masks are written as its documentation writes them: causal as "
        "`q_idx >= kv_idx`, the window as `q_idx - kv_idx < window`, padding and dense masks by indexing a "
        "tensor; soft-cap and ALiBi are `score_mod` functions. It has no sinks argument. With the documented "
        "causal `mask_mod` the corner is at the top left; writing `q_idx + (Lk - Lq) >= kv_idx` moves it."),
    "transformers": (
        "transformers' attention-interface functions, `eager_attention_forward` (modeling_llama, the one most "
        "models copy) and `sdpa_attention_forward` (integrations/sdpa_attention.py), called as its models "
        "call them: the mask built by `masking_utils` (`eager_mask`: 0 or the dtype's minimum; "
        "`sdpa_mask`: boolean, or None where `is_causal` suffices) with the queries at the last positions "
        "as a cache puts them; `softcap`, `s_aux` (sinks) and `sliding_window` passed as the keyword "
        "arguments the models pass. The models that use ALiBi (Bloom, Falcon) add it to the mask themselves, "
        "so there is no argument for it here. Called alone without a mask, `sdpa_attention_forward` uses "
        "`is_causal` and crops the keys to the first Lq (a top-left corner); its models never call it so."),
}


def _versions() -> str:
    import transformers

    import torch
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, Python "
            f"{platform.python_version()}, {platform.machine()} CPU")


def _section(fn, title: str) -> tuple[str, dict[str, list[str]]]:
    report = check_attention(fn)
    found = report.findings()
    lines = [f"## {title}", "", report.table(), ""]
    if found:
        lines += ["What differs from attnkit, case by case:", ""]
        for name, where in found.items():
            by_case: dict[str, list[str]] = {}
            for item in where:  # "case (dtype)"
                case, _, dtype = item.rpartition(" (")
                by_case.setdefault(case, []).append(dtype.rstrip(")"))
            lines.append(f"- **{name}**: " + "; ".join(f"{case} ({', '.join(d)})" for case, d in by_case.items()))
    else:
        lines.append("Every case it runs agrees with attnkit within the dtype's tolerance.")
    return "\n".join(lines) + "\n", found


def _page(slug: str, title: str, sections: list[tuple[object, str]]) -> str:
    body, found = [], {}
    for fn, heading in sections:
        text, section_found = _section(fn, heading)
        body.append(text)
        found.update(section_found)
    tolerances = ", ".join(f"{d} {t:.0e}" for d, t in TOLERANCE.items())
    meanings = [f"- **{name}**: {EXPLAIN.get(name, 'the function raises this error: it refuses the case.')}"
                for name in found]
    head = [
        f"# Conformance: {title}", "",
        "<!-- written by docs/tools/conformance_pages.py (make conformance-pages); do not edit by hand -->", "",
        NOTES[slug], "",
        f"Measured with {_versions()}. Each cell is the error of the output, then of the gradients (dq, dk, dv, "
        "the largest), relative to the scale of attnkit's float64 result on the same inputs rounded to the "
        f"cell's dtype; ✓ within the dtype's tolerance ({tolerances}), ✗ beyond it. \"unsupported\": the "
        "function has no argument for the case; the finding column names the semantics the output has instead "
        "(see [the conformance suite](index.md) for the cases and how a finding is named).", "",
        "## What it shows", "", *(meanings or ["Nothing differs from attnkit."]), "",
    ]
    return "\n".join(head + body)


def main(out: str = "docs/conformance") -> int:
    warnings.simplefilter("ignore")  # eager flex_attention's "not compiled" notice, once per call
    folder = Path(out)
    pages = {
        "torch-sdpa": ("torch SDPA", [(torch_sdpa(b), f"Backend: {b}") for b in sdpa_backends()]),
        "flex-attention": ("torch flex_attention", [(torch_flex_attention(), "flex_attention (eager)")]),
        "transformers": ("transformers' attention functions",
                         [(transformers_attention("eager"), "eager_attention_forward"),
                          (transformers_attention("sdpa"), "sdpa_attention_forward")]),
    }
    for slug, (title, sections) in pages.items():
        path = folder / f"{slug}.md"
        path.write_text(_page(slug, title, sections), encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
