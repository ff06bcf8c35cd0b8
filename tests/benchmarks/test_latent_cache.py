"""The latent-cache benchmark measures what the shapes imply, for attnkit's caches and transformers'."""
import pytest

from attnkit.benchmarks.latent_cache import SHAPE, main, measure


def test_the_measured_bytes_are_the_shapes():
    found = measure(tokens=16)
    expected = {"latent": 4 * (SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]),
                "gqa": 4 * 2 * SHAPE["gqa_kv_heads"] * SHAPE["gqa_head_dim"]}
    assert found["attnkit"] == expected
    if "transformers" in found:
        assert found["transformers"] == expected


def test_the_printout_names_the_ratio(capsys):
    pytest.importorskip("transformers")
    assert main(["--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and out.count("GQA / MLA: 3.56x") == 2
