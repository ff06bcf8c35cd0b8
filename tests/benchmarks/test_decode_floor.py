"""The decode-floor benchmark: the weights a step reads, counted once each (fused groups as one array, k of E
experts, the head, no token table), and a tiny end-to-end run printing its table."""
import numpy as np
import pytest

pytest.importorskip("transformers")
from attnkit.benchmarks import decode, decode_floor  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, ExpertsConfig, MLPConfig  # noqa: E402


def _config(**extra):
    return DecoderConfig(**{**dict(family="llama", vocab_size=64, hidden_size=16, num_layers=2, num_heads=4,
                                   num_kv_heads=2, head_dim=4, mlp=MLPConfig(24)), **extra})


def test_the_step_weights_are_what_one_token_reads():
    lm = CausalLM(_config(), rng=0)
    weights = decode_floor.step_weights(lm)
    shapes = [w.shape for w in weights]
    # per layer the fused q/k/v, W_O, the fused gate/up, W_down; then the head (D, V), never the token table
    assert shapes == [(16, 32), (16, 16), (16, 48), (24, 16)] * 2 + [(16, 64)]
    matrices = sum(p.nbytes for p in lm.parameters() if p.ndim == 2)
    assert sum(w.nbytes for w in weights) == matrices - lm.embed.weight.nbytes
    moe = CausalLM(_config(experts=ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                                 layers=(1,))), rng=0)
    expert_shapes = [w.shape for w in decode_floor.step_weights(moe)][4:-1]
    # layer 1: q/k/v, W_O, 2 of the 4 experts' gate, up and down, then the router
    assert expert_shapes == [(16, 32), (16, 16), (16, 8), (16, 8), (16, 8), (16, 8), (8, 16), (8, 16), (16, 4)]


def test_layout_times_cover_every_shape_both_ways():
    weights = [np.ones((8, 4), np.float32), np.ones((8, 4), np.float32), np.ones((4, 8), np.float32, order="F")]
    times = decode_floor.layout_times(weights)
    assert set(times) == {(8, 4), (4, 8)} and all(a > 0 and b > 0 for a, b in times.values())


def test_tiny_run_prints_step_floor_and_best_layouts(monkeypatch, capsys):
    monkeypatch.setattr(decode_floor, "FAMILIES", {"llama": ("LlamaConfig", dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=False, max_position_embeddings=64))})
    monkeypatch.setattr(decode, "FAMILIES", decode_floor.FAMILIES)
    figures = decode_floor.run(decode_floor.parse_args(["--families", "llama", "--new", "3", "--rounds", "1",
                                                        "--threads", "1"]))
    row = figures["llama"]
    assert set(row) == {"step_s", "products_s", "best_layout_s", "weights_mib"}
    assert row["step_s"] > 0 and 0 < row["best_layout_s"] <= row["products_s"]
    assert "| llama |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        decode_floor.parse_args(["--new", "1"])
