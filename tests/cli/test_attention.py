"""``attnkit attention`` on a saved demo model: the pictures, and one line and exit 2 for every bad model
folder (missing, truncated, tampered JSON, absurd sizes, unreadable), never a traceback."""
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the demo draws with the viz extra: pip install 'attnkit[viz]'")

from attnkit.cli import main  # noqa: E402
from attnkit.viz import attention_figsize  # noqa: E402
from cli_helpers import assert_image, assert_one_line_error, run_attnkit  # noqa: E402


def test_attention_command_draws_a_saved_model(small_demo, tmp_path, capsys):
    target = tmp_path / "all.png"
    assert main(["attention", "--model", str(small_demo), "--input", "3 1 4 1 5 9 2 6 5 3", "-o", str(target)]) == 0
    assert_image(target, attention_figsize(2, 4, 10, 10))
    out = capsys.readouterr().out
    assert "input  3 1 4 1 5 9 2 6 5 3" in out and f"wrote {target}" in out
    one = tmp_path / "one.png"
    assert main(["attention", "--model", str(small_demo / "model.npz"), "31415", "--layer", "1", "--head", "2",
                 "-o", str(one)]) == 0
    assert_image(one, attention_figsize(1, 1, 5, 5))


# -- tampered model folders ------------------------------------------------------------------------------
def _copy(small_demo, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(small_demo, folder)
    return folder


def _edit_json(folder, edit):
    meta = json.loads((folder / "model.json").read_text())
    edit(meta)
    (folder / "model.json").write_text(json.dumps(meta))


def _truncate(folder):
    data = (folder / "model.npz").read_bytes()
    (folder / "model.npz").write_bytes(data[: len(data) // 2])


def _tamper(**fields):
    return lambda folder: _edit_json(folder, lambda meta: meta["model"].update(fields))


def _delete(key):
    return lambda folder: _edit_json(folder, lambda meta: meta.pop(key))


TAMPERED = {
    "truncated weights": (_truncate, "not a complete .npz archive"),
    "empty weights": (lambda f: (f / "model.npz").write_bytes(b""), "not a complete .npz archive"),
    "weights that are text": (lambda f: (f / "model.npz").write_text("hello"), "not a complete .npz archive"),
    "model.json not JSON": (lambda f: (f / "model.json").write_text("{nope"), "not valid JSON"),
    "model.json not UTF-8": (lambda f: (f / "model.json").write_bytes(b"\xff\xfe{"), "not valid JSON"),
    "model.json a list": (lambda f: (f / "model.json").write_text("[1, 2]"), "does not describe an attnkit"),
    "missing model field": (lambda f: _edit_json(f, lambda m: m["model"].pop("vocab_size")), "lacks ['vocab_size']"),
    "missing architecture": (_delete("model"), "\"model\" must be an object"),
    "missing tokens": (_delete("tokens"), "\"tokens\" must be a list"),
    "missing seq_len": (_delete("seq_len"), "\"seq_len\" must be an integer"),
    "string size": (_tamper(d_model="64"), "model.d_model must be an integer, got str '64'"),
    "float size": (_tamper(num_heads=4.0), "model.num_heads must be an integer, got float 4.0"),
    "bool size": (_tamper(num_layers=True), "model.num_layers must be an integer, got bool True"),
    "negative size": (_tamper(d_ff=-1), "model.d_ff must be positive, got -1"),
    "unknown field": (_tamper(evil="rm -rf"), "unknown keys ['evil']"),
    "absurd width": (_tamper(d_model=10**9, num_heads=1), "parameters, but"),
    "absurd depth": (_tamper(num_layers=10**12), "parameters, but"),
    "absurd length": (_tamper(max_length=10**12), "is above"),
    "30-digit vocabulary": (_tamper(vocab_size=10**30), "tokens for vocab_size"),
    "30-digit head width": (_tamper(d_ff=10**30), "parameters, but"),
    "heads not dividing width": (_tamper(num_heads=3), "not divisible by model.num_heads"),
    "wrong shapes": (_tamper(d_ff=64), "does not match"),
    "too few tokens": (lambda f: _edit_json(f, lambda m: m.update(tokens=["0", "1"])), "2 tokens for vocab_size"),
    "tokens not strings": (lambda f: _edit_json(f, lambda m: m.update(tokens=list(range(10)))), "non-empty strings"),
    "accuracy a string": (lambda f: _edit_json(f, lambda m: m.update(heldout_token_accuracy="high")),
                          "must be a number"),
    "unknown dtype": (lambda f: _edit_json(f, lambda m: m.update(dtype="int8")), "'float32' or 'float64'"),
    "model.json a folder": (lambda f: ((f / "model.json").unlink(), (f / "model.json").mkdir()), "no such file"),
    "model.npz a folder": (lambda f: ((f / "model.npz").unlink(), (f / "model.npz").mkdir()), "no such file"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_model_folder_is_one_line_and_exit_2(case, small_demo, tmp_path, capsys):
    tamper, message = TAMPERED[case]
    folder = _copy(small_demo, tmp_path)
    tamper(folder)
    assert main(["attention", "--model", str(folder), "--input", "1 2 3", "-o", str(tmp_path / "a.png")]) == 2
    out, err = capsys.readouterr()
    assert_one_line_error(err, "attnkit attention: error: cannot load the model", message)
    assert out == "" and not (tmp_path / "a.png").exists()


def test_tampered_folders_in_a_real_process(small_demo, tmp_path):
    """Truncated weights and an absurd size through ``python -m attnkit``: exit 2, one line, no traceback."""
    for name, tamper in (("truncated", _truncate), ("absurd", _tamper(d_model=10**9, num_heads=1))):
        folder = tmp_path / name
        shutil.copytree(small_demo, folder)
        tamper(folder)
        proc = run_attnkit(["attention", "--model", str(folder), "--input", "1 2", "-o", "a.png"], cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert_one_line_error(proc.stderr, "cannot load the model")


def test_control_characters_in_tokens_are_escaped(small_demo, tmp_path, capsys):
    folder = _copy(small_demo, tmp_path)
    evil = ["\x1b[2J", "\x9b31m", "\u202eevil", "\x07"] + [str(i) for i in range(4, 10)]
    _edit_json(folder, lambda meta: meta.update(tokens=evil, task="sort\x1b]0;title\x07"))
    assert main(["attention", "--model", str(folder), "--input", "4 5 6", "-o", str(tmp_path / "a.png")]) == 0
    out, err = capsys.readouterr()
    text = out + err
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f or c == "\u202e" for c in text), repr(text)
    assert "sort\\x1b]0;title\\x07" in out and "output " in out
    # unknown tokens are quoted back escaped too
    assert main(["attention", "--model", str(folder), "--input", "4 \x1b[31m", "-o", str(tmp_path / "b.png")]) == 2
    assert_one_line_error(capsys.readouterr().err, "unknown tokens", "\\x1b")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_model_file_is_one_line(small_demo, tmp_path, capsys):
    folder = _copy(small_demo, tmp_path)
    (folder / "model.json").chmod(0)
    try:
        assert main(["attention", "--model", str(folder), "--input", "1 2", "-o", str(tmp_path / "a.png")]) == 2
    finally:
        (folder / "model.json").chmod(0o600)
    assert_one_line_error(capsys.readouterr().err, "cannot load the model", "ermission denied")


def test_unreadable_paths_are_one_line(small_demo, tmp_path, capsys, monkeypatch):
    """Paths the OS refuses (a name too long, a read refused with EACCES) give one line and exit 2."""
    long_name = str(tmp_path / ("x" * 5000))
    assert main(["attention", "--model", long_name, "--input", "1 2", "-o", str(tmp_path / "a.png")]) == 2
    assert_one_line_error(capsys.readouterr().err, "cannot load the model")
    folder = _copy(small_demo, tmp_path)
    real_read_bytes = type(folder).read_bytes

    def refuse(self, *args, **kwargs):
        if self.name == "model.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self, *args, **kwargs)

    monkeypatch.setattr(type(folder), "read_bytes", refuse)
    assert main(["attention", "--model", str(folder), "--input", "1 2", "-o", str(tmp_path / "a.png")]) == 2
    assert_one_line_error(capsys.readouterr().err, "cannot load the model", "Permission denied")


def test_a_loaded_model_predicts_as_the_trained_one(small_demo):
    from attnkit.demos import encoder as demo

    model, meta = demo.load_model(small_demo)
    ids = np.array([[1, 2, 3]])
    assert model.predict(ids).shape == (1, 3) and meta["format"] == "attnkit-demo-model"


def _header_only_archive(path, shapes, dtype="<f4"):
    """An .npz whose members are .npy headers declaring ``shapes`` and holding no data (deflated)."""
    import zipfile

    from numpy.lib import format as npy_format

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, shape in shapes.items():
            with archive.open(f"{name}.npy", "w") as member:
                npy_format.write_array_header_1_0(member, {"descr": dtype, "fortran_order": False, "shape": shape})


def test_a_tiny_tampered_folder_is_refused_before_the_model_is_built(small_demo, tmp_path):
    """model.json widened to d_model 512 and a header-only model.npz claiming the matching shapes: about
    6 KB on disk. The headers are claims the archive cannot back, refused before any model is built."""
    import tracemalloc

    from attnkit.demos import encoder as demo
    from attnkit.models import TokenTagger, TokenTaggerConfig

    folder = _copy(small_demo, tmp_path)
    _edit_json(folder, lambda meta: meta["model"].update(d_model=512, num_heads=4))
    arch = json.loads((folder / "model.json").read_text())["model"]
    shapes = {name: value.shape for name, value in TokenTagger(TokenTaggerConfig(**arch), rng=0).state_dict().items()}
    _header_only_archive(folder / "model.npz", shapes)
    assert (folder / "model.npz").stat().st_size < 8192
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="not a complete .npz archive|does not match"):
            demo.load_model(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak  # on 0.2's code: 20 MB traced (the claimed model was built before the error)


def test_stored_entries_are_checked_against_the_configuration(small_demo, tmp_path):
    from attnkit.demos import encoder as demo

    folder = _copy(small_demo, tmp_path)
    with np.load(folder / "model.npz") as stored:
        arrays = dict(stored)
    name = next(iter(arrays))
    np.savez(folder / "model.npz", **{**arrays, name: arrays[name].astype(np.int32)})
    with pytest.raises(ValueError, match=f"entry '{name}' is .* int32, the model needs"):
        demo.load_model(folder)
    np.savez(folder / "model.npz", **{k: v for k, v in arrays.items() if k != name})
    with pytest.raises(ValueError, match=f"missing entries \\['{name}'\\]"):
        demo.load_model(folder)
    _edit_json(folder, lambda meta: meta["model"].update(num_layers=10**6))
    with pytest.raises(ValueError, match="parameters, but"):
        demo.load_model(folder)
