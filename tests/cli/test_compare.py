"""``attnkit compare``: the table, --json and the exit statuses (0 equal, 1 a divergence, 2 bad input in one line)
on each kind of side: attnkit, transformers, a PyTorch module from a .py file with a name map, recordings."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.cli import main  # noqa: E402
from attnkit.testing import transformers_side  # noqa: E402
from cli_helpers import assert_one_line_error, run_attnkit  # noqa: E402
from hf_models import saved_model, write_word_tokenizer  # noqa: E402

TORCH_LLAMA = Path(__file__).resolve().parents[1] / "torch_llama.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama folder with a word tokenizer (token i is ``w{i}``), its transformers model and the name map
    of tests/torch_llama.py as a JSON file."""
    root = tmp_path_factory.mktemp("cli_compare")
    shared, hf = saved_model("llama_sharded", root)
    folder = shutil.copytree(shared, root / "llama_words")  # a copy: other tests share the saved folder as it is
    write_word_tokenizer(folder)
    from torch_llama import name_map

    names = folder.parent / "names.json"
    names.write_text(json.dumps(name_map(json.loads((folder / "config.json").read_text()))))
    return folder, hf, names


def test_equal_sides_print_the_table_and_exit_0(model, capsys):
    folder, _, _ = model
    assert main(["compare", f"transformers:{folder}", str(folder), "--prompt", "w5 w6 w7 w8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"A: transformers float32 ({folder})"
    assert lines[1] == f"B: attnkit float32 ({folder})"
    assert lines[2].split() == ["layer", "op", "max", "abs", "max", "rel", "A", "vs", "f64", "B", "vs", "f64"]
    assert [line.split()[0] for line in lines[3:-1]] == ["embed", "0", "1", "logits"]  # the residual streams
    assert lines[-1] == "no divergence"


def test_a_broken_pytorch_llama_is_found_and_exits_1(model, capsys):
    folder, _, names = model
    code = main(["compare", f"torch:{folder}", f"attnkit64:{folder}", "--prompt-ids", "5 6 7 8 9",
                 "--torch", f"{TORCH_LLAMA}:build_broken", "--name-map", str(names)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[-1] == "first divergence: layer 1, scores"
    marked = [line.split() for line in out if line.endswith("<-")]
    assert [row[:2] for row in marked] == [["1", "scores"]]
    # inside layer 1 every op is shown, in forward order
    assert [line.split()[1] for line in out if line.split()[:1] == ["1"]] == [
        "norm", "q", "k", "v", "rotary_q", "rotary_k", "scores", "probs", "mlp", "resid"]
    # the same module without the bug: no divergence
    assert main(["compare", f"torch:{folder}", str(folder), "--prompt-ids", "5 6 7 8 9",
                 "--torch", f"{TORCH_LLAMA}:build", "--name-map", str(names)]) == 0


def test_json_holds_every_row_and_the_first_divergence(model, capsys, tmp_path):
    folder, hf, _ = model
    ids = [5, 6, 7, 8, 9, 10]
    trace = transformers_side(hf).trace(np.array(ids))
    trace["layers.0.rotary_k"] = trace["layers.0.rotary_k"] * 1.01
    path = tmp_path / "run.npz"
    np.savez(path, **trace)
    code = main(["compare", str(path), f"attnkit:{folder}", "--prompt-ids", "5,6,7,8,9,10", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 1
    assert record["first_divergence"] == {"layer": 0, "op": "rotary_k"}
    assert record["verdict"] == "first divergence: layer 0, rotary_k"
    assert record["input_ids"] == [ids]
    row = next(r for r in record["rows"] if r["name"] == "layers.0.rotary_k")
    assert row["diverges"] and row["error_a"] > row["limit_a"] and row["error_b"] < row["limit_b"]
    assert len(record["rows"]) == 1 + 2 * 12 + 1  # embed, two layers' 12 ops (no router), logits
    # two recordings need --reference: the model they come from
    assert main(["compare", str(path), str(path), "--prompt-ids", "5 6 7 8 9 10", "--reference", str(folder),
                 "--all"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 + 26 + 1  # the sides, the header, every row, the verdict
    assert out[-1] == "first divergence: layer 0, rotary_k"


@pytest.mark.parametrize("args, fragments", [
    (["npz:{tmp}/a.npz", "npz:{tmp}/b.npz", "--prompt-ids", "5"], ["give --reference"]),
    (["{folder}", "{folder}", "--prompt-ids", "5 x"], ["--prompt-ids must be non-negative integers"]),
    (["{folder}", "{folder}", "--prompt-ids", "5 96"], ["token id 96 is not below the vocabulary size 96"]),
    (["spam:{folder}", "{folder}", "--prompt-ids", "5"], ["a side is attnkit:PATH"]),
    (["torch:{folder}", "{folder}", "--prompt-ids", "5"], ["needs --torch MODULE:FACTORY"]),
    (["torch:{folder}", "{folder}", "--prompt-ids", "5", "--torch", "no_such_module_here:build"],
     ["no_such_module_here"]),
    (["{tmp}/missing", "{folder}", "--prompt-ids", "5"], ["is not a model folder nor a .gguf file"]),
    (["{tmp}/bad.npz", "{folder}", "--prompt-ids", "5"], ["cannot read"]),
])
def test_bad_input_is_one_line_and_exit_2(model, tmp_path, args, fragments):
    folder, _, _ = model
    (tmp_path / "bad.npz").write_bytes(b"no zip")
    args = [a.format(folder=folder, tmp=tmp_path) for a in args]
    proc = run_attnkit(["compare", *args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert_one_line_error(proc.stderr, "attnkit compare", *fragments)


def test_compare_is_listed_in_the_help(capsys):
    assert main(["--help"]) == 0
    assert "compare" in capsys.readouterr().out
