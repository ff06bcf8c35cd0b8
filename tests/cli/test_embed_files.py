"""``attnkit embed`` reading sentences from a file or stdin and writing ``--output x.npy``: the array equals
sentence-transformers' embeddings of the same sentences."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from attnkit.pretrained import default_model_dir
from cli_helpers import SRC, run_attnkit

SENTENCES = ["A man is eating food.", "Someone is having a meal.", "The sky is blue today.", "Caf\u00e9 cr\u00e8me"]


@pytest.fixture(scope="module")
def reference():
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(default_model_dir()), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True)


def test_file_input_to_npy_equals_sentence_transformers(tmp_path, reference):
    source = tmp_path / "sentences.txt"
    source.write_text("\n".join(SENTENCES[:2]) + "\n\n" + "\n".join(SENTENCES[2:]) + "\n", encoding="utf-8")
    proc = run_attnkit(["embed", "--input", source, "--output", tmp_path / "x.npy"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    emb = np.load(tmp_path / "x.npy")
    assert emb.shape == (4, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(emb, reference, atol=2e-6)
    assert "wrote 4 embeddings of 384 dims" in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["sentences.txt", "x.npy"]  # no temporary file left


def test_stdin_input(tmp_path, reference):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "attnkit", "embed", "-o", str(tmp_path / "y.npy")],
                          input="\n".join(SENTENCES).encode(), capture_output=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), reference, atol=2e-6)
