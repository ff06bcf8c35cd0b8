"""The loading-memory benchmark measures a real load in a child process and refuses a missing folder."""
import pytest

from attnkit.benchmarks import load_memory
from hf_models import saved_model


def test_measure_reports_the_memory_of_a_real_load(tmp_path):
    folder, _ = saved_model("llama_gqa", tmp_path)
    figures = load_memory.measure("attnkit", folder)
    assert set(figures) == {"imports_mb", "peak_mb", "after_load_mb", "after_generate_mb", "load_s"}
    assert 0 < figures["imports_mb"] <= figures["peak_mb"]
    assert figures["after_load_mb"] > 0 and figures["load_s"] > 0


def test_command_line_needs_a_folder(capsys):
    with pytest.raises(SystemExit) as exc:
        load_memory.parse_args([])
    assert exc.value.code == 2 and "give a FOLDER or --make-llama DIR" in capsys.readouterr().err
