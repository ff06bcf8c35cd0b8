"""The busy-core benchmark times every case in a fresh process and prints the default against one thread."""
import re

from attnkit.benchmarks import busy_core


def test_every_case_is_timed_and_the_ratio_printed(chat_folder, capsys):
    figures = busy_core.run(busy_core.parse_args([str(chat_folder), "--tasks", "greedy", "--loads", "idle",
                                                  "--rounds", "1", "--new", "2", "--prompt", "4"]))
    assert sorted(figures) == ["idle|greedy|this|1", "idle|greedy|this|default"]
    assert all(0 < seconds < 60 for seconds in figures.values())
    out = capsys.readouterr().out
    assert out.startswith("# machine: ")
    assert re.search(r"^idle\s+greedy\s+this\s+[\d.]+ s\s+[\d.]+ s\s+[\d.]+x$", out, re.MULTILINE), out
