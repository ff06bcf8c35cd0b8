"""The packed-weights benchmark writes a file with gguf's writer and measures both loads of it in child
processes: the same greedy tokens, the packed weights smaller."""
import pytest

pytest.importorskip("gguf")
from attnkit.benchmarks import packed  # noqa: E402


def test_a_round_measures_both_loads_of_a_written_file(tmp_path, capsys):
    path = packed.make_gguf(tmp_path / "tiny.gguf", "Q8_0", dict(hidden=64, intermediate=128, layers=2, heads=4,
                                                                 kv_heads=2, vocab=256, context=64))
    figures = packed.run(packed.parse_args([str(path), "--rounds", "1", "--prefill", "8", "--new", "3"]))
    assert figures["greedy_tokens_equal"]
    assert figures["packed"]["weights_MiB"] * 3 < figures["dequantized"]["weights_MiB"]
    assert figures["packed"]["decode_tps"] > 0 and len(figures["ratios"]["prefill_s"]) == 1
    assert "packed / dequantized decode_tps" in capsys.readouterr().out


def test_command_line_needs_a_file_or_make(capsys):
    with pytest.raises(SystemExit) as exc:
        packed.parse_args([])
    assert exc.value.code == 2 and "give a FILE or --make PATH" in capsys.readouterr().err


def test_the_decoder_timing_names_every_own_decoder(capsys):
    speeds = packed.decoder_speeds(rounds=1, rows=8, columns=512)
    assert set(speeds) == {"Q8_0", "Q4_0", "Q4_K", "Q6_K"}
    assert all(v["attnkit"] > 0 and v["gguf"] > 0 for v in speeds.values())
    assert "Q4_K: attnkit" in capsys.readouterr().out
