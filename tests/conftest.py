"""pytest configuration: the deterministic hypothesis profile, the ``rng`` and ``chat_folder`` fixtures and the
end-of-run table of the largest differences to PyTorch. Helpers live in ``helpers.py`` (``from helpers import ...``)."""
from __future__ import annotations

import os

# The kernels' tuned choices (attnkit tune's cache) must not reach the tests: tile sizes and thread counts change
# results' last bits. Set before attnkit is imported, and inherited by the commands the tests start.
os.environ["ATTNKIT_TUNE"] = "0"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import attnkit  # noqa: E402
import torch  # noqa: E402

from helpers import DISCREPANCIES  # noqa: E402

torch.set_num_threads(1)
# The kernels run on the cores other processes leave free; the tests must not follow the machine's load (a test
# of two workers would get one on a busy machine). tests/kernels/test_adaptive_threads.py turns it on, with a
# simulated load.
attnkit.set_adaptive_threads(False)

settings.register_profile(
    "attnkit",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("attnkit")


@pytest.fixture(scope="session")
def chat_folder(tmp_path_factory):
    """A tiny chat model folder, written once per session by :func:`text_models.write_chat_model` (a random
    Llama with a byte-level BPE tokenizer and a ChatML template). Tests that change it work on a copy."""
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from text_models import write_chat_model

    folder = tmp_path_factory.mktemp("chat")
    write_chat_model(folder)
    return folder


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh seeded generator per test, so every test is deterministic and independent of order."""
    return np.random.default_rng(20240611)



def pytest_terminal_summary(terminalreporter):
    """Print the largest PyTorch discrepancy measured per component and dtype (relative to the reference scale)."""
    if not DISCREPANCIES:
        return
    terminalreporter.section("largest PyTorch discrepancy (max |ours - torch| / reference scale)")
    for (label, dt), rel in sorted(DISCREPANCIES.items()):
        terminalreporter.write_line(f"{label:22s} {dt:8s} {rel:.3e}")
