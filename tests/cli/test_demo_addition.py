"""``attnkit demo --task addition``: a decoder-only language model trained from scratch, decoded with the cache."""
import json

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the demo draws with the viz extra: pip install 'attnkit[viz]'")

from attnkit.cli import main  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig  # noqa: E402


def test_addition_demo_prints_its_accuracy_and_writes_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--task", "addition", "--steps", "3", "--batch-size", "8", "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "decoder-only language model" in printed and "held-out exact match (500 new sums" in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "loss.png", "model.npz"]
    config = DecoderConfig.from_dict(json.loads((out / "config.json").read_text()))
    model = CausalLM(config, rng=1).astype(np.float32)
    model.load(out / "model.npz")
    assert model.config == config and np.isfinite(model(np.array([[1, 2, 10, 3, 4, 11]]))).all()


def test_addition_is_listed_with_the_other_tasks(capsys):
    assert main(["demo", "--help"]) == 0
    assert "addition" in capsys.readouterr().out
