"""STATE_DICT_RENAMES: checkpoints written with an earlier parameter layout load into the current one.

The layouts here are small Module subclasses defined in the test: a block whose two LayerNorm parameters
used to be its own (``gamma1``/``beta1``) and now live in a child ``norm1``, a child module renamed as a
whole, and a parent that moved a child whose own parameters were renamed too.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.core import Module, ModuleList
from attnkit.layers import LayerNorm, Projection


class Block(Module):
    """Current layout: ``norm1.gamma``, ``norm1.beta``, ``ffn.W``, ``ffn.b``."""

    STATE_DICT_RENAMES = {"gamma1": "norm1.gamma", "beta1": "norm1.beta", "W1": "ffn.W", "b1": "ffn.b"}

    def __init__(self, d: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.norm1 = LayerNorm(d)
        self.ffn = Projection(d, d, rng=seed)


class Stack(Module):
    """A ModuleList of blocks under ``blocks``, formerly called ``layers``."""

    STATE_DICT_RENAMES = {"layers": "blocks"}

    def __init__(self, n: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.blocks = ModuleList([Block(seed=seed + i) for i in range(n)])


def earlier_block_state(seed: int) -> dict[str, np.ndarray]:
    """A checkpoint of the earlier flat block layout, with distinctive values."""
    rng = np.random.default_rng(seed)
    return {"gamma1": rng.normal(size=3), "beta1": rng.normal(size=3), "W1": rng.normal(size=(3, 3)),
            "b1": rng.normal(size=3)}


def test_earlier_layout_loads_into_the_renamed_parameters():
    block = Block()
    earlier = earlier_block_state(1)
    block.load_state_dict(earlier)
    assert np.array_equal(block.norm1.gamma, earlier["gamma1"]) and np.array_equal(block.norm1.beta, earlier["beta1"])
    assert np.array_equal(block.ffn.W, earlier["W1"]) and np.array_equal(block.ffn.b, earlier["b1"])


def test_current_layout_still_loads():
    a, b = Block(seed=0), Block(seed=5)
    b.load_state_dict(a.state_dict())
    assert np.array_equal(a.ffn.W, b.ffn.W)


def test_renames_are_prefixed_by_the_submodule_path_and_chain_parent_then_child():
    # The earlier stack called its list "layers" and each block stored flat names: both tables apply.
    stack = Stack()
    earlier = {f"layers.{i}.{k}": v for i in range(2) for k, v in earlier_block_state(10 + i).items()}
    stack.load_state_dict(earlier)
    for i in range(2):
        expected = earlier_block_state(10 + i)
        assert np.array_equal(stack.blocks[i].norm1.gamma, expected["gamma1"])
        assert np.array_equal(stack.blocks[i].ffn.W, expected["W1"])
    # a table only renames names under its own module: a top-level "gamma1" is not the block's
    with pytest.raises(KeyError, match=r"unknown keys \['gamma1'\]"):
        stack.load_state_dict({**stack.state_dict(), "gamma1": np.zeros(3)})


def test_renames_apply_to_files_too(tmp_path):
    path = tmp_path / "earlier.npz"
    earlier = earlier_block_state(2)
    np.savez(path, **earlier)
    block = Block()
    block.load(path)
    assert np.array_equal(block.ffn.W, earlier["W1"])


def test_renamed_and_current_name_of_the_same_parameter_together_are_refused():
    block = Block()
    before = block.state_dict()
    state = {**before, "gamma1": np.ones(3)}
    with pytest.raises(ValueError, match=r"'norm1.gamma' and 'gamma1' both name parameter 'norm1.gamma'"):
        block.load_state_dict(state)
    assert all(np.array_equal(v, block.state_dict()[k]) for k, v in before.items())


def test_unknown_names_still_fail_and_say_how_to_convert():
    block = Block()
    state = earlier_block_state(3)
    state["gamma2"] = state.pop("gamma1")  # a name no table knows
    with pytest.raises(KeyError) as info:
        block.load_state_dict(state)
    message = str(info.value)
    assert "unknown keys ['gamma2']" in message and "missing keys ['norm1.gamma']" in message
    assert "state[current] = state.pop(earlier)" in message and "STATE_DICT_RENAMES" in message
    assert "'gamma2' -> 'norm1.gamma'?" in message  # the closest current name


def test_renamed_key_that_is_still_unknown_is_reported_with_both_names():
    class Renamed(Module):
        STATE_DICT_RENAMES = {"w": "weight"}  # points at a name the module does not have

        def __init__(self):
            super().__init__()
            self.register_parameter("W", np.zeros(2))

    with pytest.raises(KeyError, match=r"unknown keys \['w \(renamed weight\)'\]"):
        Renamed().load_state_dict({"w": np.zeros(2)})


def test_renames_respect_strict_false():
    block = Block()
    before_beta = block.norm1.beta.copy()
    block.load_state_dict({"gamma1": np.full(3, 7.0)}, strict=False)
    assert np.all(block.norm1.gamma == 7.0) and np.array_equal(block.norm1.beta, before_beta)


def test_a_malformed_rename_table_is_a_type_error():
    class Broken(Module):
        STATE_DICT_RENAMES = {"a": 3}

        def __init__(self):
            super().__init__()
            self.register_parameter("W", np.zeros(2))

    with pytest.raises(TypeError, match="Broken.STATE_DICT_RENAMES must map str to str"):
        Broken().load_state_dict({"W": np.zeros(2)})
