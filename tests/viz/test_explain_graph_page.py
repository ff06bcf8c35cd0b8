"""The explain page's attribution graph in Chromium: one shape per kept node, one line per kept edge carrying its
weight, and no request or script error."""
from __future__ import annotations

import json
import re

import numpy as np

from attnkit.explain import SAE, explain_html
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

IDS = [1, 5, 7, 2, 9, 3]


def _written(tmp_path):
    cfg = DecoderConfig(family="llama", vocab_size=23, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=4, mlp=MLPConfig(24))
    lm = CausalLM(cfg, rng=3).astype(np.float64)
    rng = np.random.default_rng(0)
    tcs = [SAE(rng.normal(size=(16, 24)) / 4, rng.normal(size=24) * 0.5, rng.normal(size=(24, 16)) * 0.3,
               np.zeros(16), hook_name=f"blocks.{i}.ln2.hook_normalized", hook_name_out=f"blocks.{i}.hook_mlp_out",
               architecture="transcoder", apply_b_dec_to_input=False) for i in range(2)]
    page = tmp_path / "graph.html"
    explain_html(lm, IDS, page, candidates=2, transcoders=tcs, progress=False)
    data = json.loads(re.search(r'id="attnkit-data" type="application/json">(.*?)</script>',
                                page.read_text(encoding="utf-8"), flags=re.DOTALL).group(1))
    return page, data["graph"]


def test_in_chromium_the_graph_has_a_shape_per_node_and_a_line_per_edge(tmp_path, watched_page):
    page_file, graph = _written(tmp_path)
    page = watched_page.page
    page.goto(page_file.as_uri())
    page.wait_for_selector("body[data-ready='true']", timeout=10_000)
    assert page.locator("#graph-panel").is_visible()
    shapes = page.locator("[data-testid=graph] [data-kind]")
    assert shapes.count() == len(graph["nodes"])
    kinds = [shapes.nth(i).get_attribute("data-kind") for i in range(shapes.count())]
    assert kinds == [node["kind"] for node in graph["nodes"]]
    lines = page.locator("[data-testid=graph] line")
    assert lines.count() == len(graph["edges"]) > 0
    weights = [float(lines.nth(i).get_attribute("data-weight")) for i in range(lines.count())]
    assert weights == [edge[2] for edge in graph["edges"]]
    assert watched_page.blocked == [] and watched_page.errors == []
