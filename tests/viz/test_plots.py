"""attnkit.viz: figures with the right panels, labels and one shared colour scale; a clear message without
matplotlib."""
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="attnkit.viz needs the viz extra: pip install 'attnkit[viz]'")
import matplotlib.pyplot as plt  # noqa: E402

from attnkit.viz import attention_figsize, plot_attention, plot_training_curve  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(*shape, seed=0):
    w = np.random.default_rng(seed).random(shape)
    return w / w.sum(-1, keepdims=True)


def _panels(fig):
    """The heatmap axes (those holding an image), without the colour bar."""
    return [a for a in fig.axes if a.get_images() and a.get_label() != "<colorbar>"]


def _colorbars(fig):
    return [a for a in fig.axes if a.get_label() == "<colorbar>"]


def _ticks(labels):
    return [t.get_text() for t in labels]


@pytest.mark.parametrize("shape, n_panels", [((5, 5), 1), ((3, 5, 5), 3), ((2, 4, 5, 5), 8)])
def test_one_panel_per_head_and_layer_and_one_colorbar(shape, n_panels):
    fig = plot_attention(_weights(*shape))
    assert len(_panels(fig)) == n_panels
    assert len(_colorbars(fig)) == 1
    assert len(fig.axes) == n_panels + 1
    assert _colorbars(fig)[0].get_ylabel() == "attention weight"


def test_tokens_label_the_axes_and_titles_name_layer_and_head():
    tokens = ["the", "cat", "sat", "on", "mat"]
    fig = plot_attention(_weights(2, 3, 5, 5), tokens, title="a title")
    panels = _panels(fig)
    for a in panels:
        assert _ticks(a.get_xticklabels()) == tokens  # keys default to the query tokens
        assert _ticks(a.get_yticklabels()) == tokens
    assert [a.get_title() for a in panels[:4]] == ["layer 0, head 0", "layer 0, head 1", "layer 0, head 2",
                                                   "layer 1, head 0"]
    assert panels[0].get_ylabel() == "query" and panels[-1].get_xlabel() == "key"
    assert fig._suptitle.get_text() == "a title"


def test_custom_names_and_cross_attention_tokens():
    fig = plot_attention(_weights(2, 3, 4), ["a", "b", "c"], ["w", "x", "y", "z"], head_names=["h0", "h1"])
    panels = _panels(fig)
    assert [a.get_title() for a in panels] == ["h0", "h1"]
    assert _ticks(panels[0].get_xticklabels()) == ["w", "x", "y", "z"]
    assert _ticks(panels[0].get_yticklabels()) == ["a", "b", "c"]


def test_one_colour_scale_for_the_whole_figure():
    w = _weights(2, 4, 6, 6)
    w[1, 3, 0] = [0.9, 0.1, 0, 0, 0, 0]
    fig = plot_attention(w)
    limits = {im.get_clim() for a in _panels(fig) for im in a.get_images()}
    assert limits == {(0.0, 0.9)}
    fig = plot_attention(w, vmin=0, vmax=1)
    assert {im.get_clim() for a in _panels(fig) for im in a.get_images()} == {(0.0, 1.0)}


def test_figure_size_is_attention_figsize():
    fig = plot_attention(_weights(2, 4, 10, 10))
    assert tuple(fig.get_size_inches()) == pytest.approx(attention_figsize(2, 4, 10, 10))


def test_long_sequences_thin_the_tick_labels():
    fig = plot_attention(_weights(100, 100))
    assert 0 < len(_panels(fig)[0].get_xticks()) <= 40


def test_draws_into_a_given_axes():
    fig, ax = plt.subplots()
    out = plot_attention(_weights(3, 3), list("abc"), ax=ax)
    assert out is fig
    assert ax.get_images() and _ticks(ax.get_xticklabels()) == list("abc")
    with pytest.raises(ValueError, match="one heatmap"):
        plot_attention(_weights(2, 3, 3), ax=ax)


@pytest.mark.parametrize("weights, kwargs, error, match", [
    (np.ones(4), {}, ValueError, "weights must be"),
    (np.ones((1, 2, 3, 4, 4)), {}, ValueError, "weights must be"),
    (np.ones((3, 3)), {"query_tokens": ["a", "b"]}, ValueError, "query_tokens has 2 tokens"),
    (np.ones((2, 3)), {"query_tokens": ["a", "b"], "key_tokens": ["x"]}, ValueError, "key_tokens has 1"),
    (np.ones((3, 3)), {"query_tokens": "abc"}, TypeError, "not a string"),
    (np.ones((2, 3, 3)), {"head_names": ["only one"]}, ValueError, "head_names has 1"),
    (np.array([["a"]]), {}, TypeError, "numeric"),
])
def test_bad_input_is_refused_with_a_message(weights, kwargs, error, match):
    with pytest.raises(error, match=match):
        plot_attention(weights, **kwargs)


def test_training_curve_has_loss_and_accuracy_panels():
    steps = np.arange(1, 201)
    fig = plot_training_curve(np.exp(-steps / 50), 1 - np.exp(-steps / 30), eval_steps=[100, 200],
                              eval_accuracy=[0.9, 0.99], title="t")
    assert [a.get_ylabel() for a in fig.axes] == ["loss", "accuracy"]
    assert fig.axes[0].get_yscale() == "log"
    assert len(plot_training_curve([3.0, 2.0, 1.0]).axes) == 1
    with pytest.raises(ValueError, match="accuracy has 2 values"):
        plot_training_curve([1.0, 2.0, 3.0], [0.1, 0.2])
    with pytest.raises(ValueError, match="together"):
        plot_training_curve([1.0], [0.5], eval_steps=[1])


def test_missing_matplotlib_names_the_install_command(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[viz\]'"):
        plot_attention(np.ones((2, 2)) / 2)
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[viz\]'"):
        plot_training_curve([1.0, 0.5])


@pytest.mark.parametrize("heads, rows", [(8, 2), (10, 3), (12, 3)])
def test_the_heads_of_one_layer_wrap_into_rows_of_four(heads, rows):
    fig = plot_attention(_weights(heads, 5, 5), list("abcde"))
    panels = _panels(fig)
    assert len(panels) == heads and len(fig.axes) == heads + 1  # unused grid cells are removed
    assert {a.get_subplotspec().get_geometry()[:2] for a in panels} == {(rows, 4)}
    assert tuple(fig.get_size_inches()) == pytest.approx(attention_figsize(1, heads, 5, 5))
    assert [a.get_ylabel() for a in panels].count("query") == rows
    assert panels[-1].get_xlabel() == "key"
