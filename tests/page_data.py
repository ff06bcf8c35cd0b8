"""What the HTML pages (attention explorer, explain page) hold: their embedded JSON and the attention weights
decoded from it as the page's script decodes them, with the documented quantisation bound."""
from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np


def embedded(path) -> dict:
    """The JSON a page embeds (what its script parses)."""
    text = path.read_text(encoding="utf-8")
    match = re.search(r'<script[^>]*id="attnkit-data"[^>]*>(.*?)</script>', text, flags=re.DOTALL)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def decoded(encoding: dict) -> np.ndarray:
    """The weights of an ``attention`` entry: codes x row maximum / (2**bits - 1), shape ``encoding["shape"]``."""
    shape = tuple(encoding["shape"])
    q = np.frombuffer(zlib.decompress(base64.b64decode(encoding["q"])), np.uint8).reshape(shape)
    scale = np.frombuffer(base64.b64decode(encoding["scale"]), "<f4").reshape(shape[:-1])
    return q * scale[..., None].astype(np.float64) / ((1 << encoding["bits"]) - 1)


def bound(weights, bits: int) -> np.ndarray:
    """The documented bound on each weight's error: its row's maximum / (2 (2**bits - 1)), plus the float32
    rounding of that maximum."""
    top = np.asarray(weights, dtype=np.float64).max(-1, keepdims=True)
    return top / (2 * ((1 << bits) - 1)) + top * 2.0**-23


def assert_page_weights(encoding: dict, want) -> np.ndarray:
    """Decode ``encoding``, check it against ``want`` within the bound, and return it."""
    got = decoded(encoding)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want)
    assert (err <= bound(want, encoding["bits"])).all(), f"max error {err.max():.3g} at {encoding['bits']} bits"
    return got
