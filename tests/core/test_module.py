"""Module's container checks: load_state_dict says what is wrong with what it was given."""
import numpy as np
import pytest


@pytest.mark.parametrize("state,match", [
    ([("W", np.zeros((2, 2)))], "state must be a mapping of parameter name to array .*got list"),
    ({0: np.zeros((2, 2))}, r"state's keys must be parameter names \(str\), got int 0"),
])
def test_load_state_dict_names_what_is_wrong_with_the_container(state, match):
    from attnkit.layers import Projection

    with pytest.raises(TypeError, match=match):
        Projection(2, 2, rng=0).load_state_dict(state)
