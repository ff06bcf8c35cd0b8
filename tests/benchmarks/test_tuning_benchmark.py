"""The tuned-against-default benchmark: where it ran, both sets of choices, one row per workload with real ratios."""
from __future__ import annotations

from attnkit.benchmarks import tuning as bench
from attnkit.kernels import tuning
from attnkit.kernels.tuning import Choices


def test_the_benchmark_times_both_sets_of_choices_alternating(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tuned = Choices(tile_l2_forward=256 << 10, split_rows=1 << 20, single_blas_rows=8)
    tuning.save_choices(tuning.cache_path(), tuned)
    seen = []
    real = bench._best

    def spy(fn, repeats):
        seen.append(tuning.current_choices())
        return real(fn, repeats)

    monkeypatch.setattr(bench, "_best", spy)
    report = bench.run(bench.parse_args(["--length", "64", "--rounds", "2", "--repeats", "1",
                                         "--json", str(tmp_path / "r.json")]))
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "# tuning: " in out and "# tuned:   tiles for 256 KiB" in out
    assert len(report["results"]) == 6 and all(r["ratio"] > 0 and r["tuned_ms"] > 0 for r in report["results"])
    # round 1 default then tuned, round 2 tuned then default: six workloads each
    assert seen == [tuning.DEFAULT_CHOICES] * 6 + [tuned] * 12 + [tuning.DEFAULT_CHOICES] * 6
    assert (tmp_path / "r.json").is_file() and tuning.current_choices() == tuning.DEFAULT_CHOICES
