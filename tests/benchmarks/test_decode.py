"""The decode benchmark runs end to end (on tiny shapes here) and reports every figure it promises."""
import pytest

pytest.importorskip("transformers")
from attnkit.benchmarks import decode  # noqa: E402


def test_tiny_run_reports_decode_prefill_and_bandwidth(monkeypatch, capsys):
    monkeypatch.setattr(decode, "FAMILIES", {"llama": ("LlamaConfig", dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=False, max_position_embeddings=64))})
    monkeypatch.setattr(decode, "gemv_bandwidth", lambda **_: 1e10)
    figures = decode.run(decode.parse_args(["--families", "llama", "--new", "3", "--prefill", "8", "--repeats",
                                            "1", "--threads", "1"]))
    row = figures["llama"]
    assert set(row) == {"decode_b1_attnkit", "decode_b1_hf", "decode_b8_attnkit", "decode_b8_hf", "gemv_fraction",
                        "prefill_attnkit_s", "prefill_hf_s"}
    assert all(v > 0 for v in row.values())
    out = capsys.readouterr().out
    assert "greedy tokens equal: 100%" in out and "of the GEMV bandwidth" in out


def test_gemv_bandwidth_is_bytes_per_second():
    assert 1e8 < decode.gemv_bandwidth(megabytes=8, repeats=2) < 1e13


def test_a_run_must_leave_at_least_one_decoding_step(capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--new", "1"])
    assert "must be at least 2, got 1" in capsys.readouterr().err


def test_gemv_bandwidth_sustained_for_a_time_keeps_multiplying_that_long():
    start = decode.time.perf_counter()
    assert 1e8 < decode.gemv_bandwidth(megabytes=8, seconds=0.05) < 1e13
    assert decode.time.perf_counter() - start >= 0.05


@pytest.mark.parametrize("family", sorted(decode.FAMILIES))
def test_every_familys_benchmark_shape_is_a_complete_transformers_config(family):
    import transformers

    config_class, kwargs = decode.FAMILIES[family]
    config = getattr(transformers, config_class)(**kwargs)
    # an attention that reads head_dim builds from it (MinistralConfig leaves it None unless told)
    head_dim = config.to_dict().get("head_dim", "not read")
    assert head_dim == "not read" or isinstance(head_dim, int), (family, head_dim)
    assert config.num_hidden_layers == kwargs.get("num_hidden_layers", config.num_hidden_layers)
