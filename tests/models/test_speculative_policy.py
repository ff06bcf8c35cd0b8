"""When speculative decoding drafts, and how much: by a cost model in decoding steps, never slower than plain
decoding by more than a few percent when drafts are rarely kept, drafting at full length when they always are.

Every cost here is counted, not timed: the rows of each forward of the model (a forward of r rows costs
``verify_cost(r)`` steps) and the tokens drafted (``draft_cost`` steps each).
"""
import numpy as np
import pytest

from attnkit.decoding.sampling import _proposer
from attnkit.decoding.speculative import (
    VERIFY_COST,
    DraftModel,
    PromptLookup,
    Proposer,
    draft_step_cost,
    expected_tokens,
    verify_cost,
)
from attnkit.models import CausalLM, DecoderConfig

NEW = 96


class Scripted(Proposer):
    """Drafts the tokens plain greedy decoding will produce, each right with chance ``right`` (seeded), else
    a token the model does not choose; what one drafted token costs is ``draft_cost``."""

    def __init__(self, truth: np.ndarray, num_tokens: int, draft_cost: float, right: float, seed: int = 0):
        super().__init__(num_tokens, draft_cost)
        self.truth, self.right = truth, right
        self.rng = np.random.default_rng(seed)
        self.drafted = 0

    def _draft(self, sequences, mask, length):
        at = sequences.shape[1]
        want = self.truth[at:at + length]  # (K,)
        wrong = (want + 1) % 32
        drafts = np.where(self.rng.random(len(want)) < self.right, want, wrong)[None]  # (1, K)
        self.drafted += drafts.shape[1]
        return drafts if drafts.shape[1] else None


@pytest.fixture(scope="module")
def lm():
    return CausalLM(DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=4, num_heads=2,
                                  num_kv_heads=1, head_dim=8, intermediate_size=24), rng=0)


@pytest.fixture(scope="module")
def prompt_and_truth(lm):
    ids = np.random.default_rng(1).integers(0, 32, size=(1, 12))
    plain = lm.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=[])
    return ids, plain[0]


def _decode_steps(lm, monkeypatch, ids, proposer) -> tuple[np.ndarray, list[int]]:
    """Greedy output with ``proposer`` and the rows of every forward of the model (the first: the prompt's, and
    the first round's drafts)."""
    rows: list[int] = []
    forward = CausalLM.forward

    def counting(self, input_ids, *args, **kwargs):
        rows.append(np.shape(input_ids)[1])
        return forward(self, input_ids, *args, **kwargs)
    monkeypatch.setattr(CausalLM, "forward", counting)
    out = lm.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=[], assistant_model=proposer)
    monkeypatch.undo()
    return out[0], rows


def _steps(rows: list[int], proposer: Scripted) -> float:
    """Steps the forwards and the drafts cost, less what plain decoding's cost (the prompt's forward, then a step
    per token after the first)."""
    return sum(verify_cost(r) for r in rows) + proposer.drafted * proposer.draft_cost - verify_cost(12) - (NEW - 1)


@pytest.mark.parametrize("draft_cost", [0.0, 0.4, 1.0])
def test_a_draft_never_kept_costs_at_most_three_percent_over_plain_decoding(lm, monkeypatch, prompt_and_truth,
                                                                             draft_cost):
    ids, truth = prompt_and_truth
    never = Scripted(truth, 10, draft_cost, right=0.0)
    out, rows = _decode_steps(lm, monkeypatch, ids, never)
    np.testing.assert_array_equal(out, truth)
    assert never.kept == 0
    # a free draft is only checked against the tokens that came; a costly one probes once, in the first round
    assert never.rounds == (0 if draft_cost == 0 else 1)
    assert rows[0] == 12 + never.proposed and rows[1:] == [1] * (NEW - 1)  # the probe rides on the prompt's
    assert _steps(rows, never) <= 0.03 * (NEW - 1)


@pytest.mark.parametrize("draft_cost", [0.0, 0.4])
@pytest.mark.parametrize("right", [0.1, 0.15, 0.2])
def test_a_draft_rarely_kept_falls_back_to_plain_decoding(lm, monkeypatch, prompt_and_truth, draft_cost, right):
    ids, truth = prompt_and_truth
    rarely = Scripted(truth, 10, draft_cost, right, seed=int(right * 100))
    out, rows = _decode_steps(lm, monkeypatch, ids, rarely)
    np.testing.assert_array_equal(out, truth)
    assert _steps(rows, rarely) <= 0.03 * (NEW - 1)
    assert rarely.rounds <= 1


@pytest.mark.parametrize("draft_cost", [0.0, 0.05])
def test_a_draft_always_kept_drafts_at_full_length(lm, monkeypatch, prompt_and_truth, draft_cost):
    ids, truth = prompt_and_truth
    always = Scripted(truth, 10, draft_cost, right=1.0)
    out, rows = _decode_steps(lm, monkeypatch, ids, always)
    np.testing.assert_array_equal(out, truth)
    # the first round learns (a free draft is checked against the token that came, a costly one probes with 3
    # drafts beside the prompt), then the model runs rounds of 10 drafts and its own token, but the last
    assert rows[0] == 12 + (0 if draft_cost == 0 else 3) and rows[1] > 1
    assert len(rows) > 6 and rows[2:-1] == [11] * (len(rows) - 3)
    assert always.kept == always.proposed
    assert _steps(rows, always) < -0.6 * (NEW - 1)  # 11 tokens for about 3.4 steps a round


def test_the_draft_length_follows_the_acceptance_by_tokens_per_step():
    lookup, costly = PromptLookup(10), DraftModel(None, 10, draft_cost=0.4)
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 5) == 1.0
    assert costly.round_cost(3) == pytest.approx(VERIFY_COST[3] + 3 * 0.4)
    assert verify_cost(len(VERIFY_COST) + 2) == pytest.approx(VERIFY_COST[-1] + 2 * (VERIFY_COST[-1] - VERIFY_COST[-2]))
    for proposer in (lookup, costly):
        lengths = [proposer.best_length(rate)[0] for rate in np.linspace(0.0, 0.99, 34)]
        assert lengths == sorted(lengths) and lengths[0] == 1 and lengths[-1] == 10
        for rate in (0.0, 0.1, 0.15, 0.2, 0.5):  # drafting does not pay: the rate per step stays below plain's
            assert proposer.best_length(rate)[1] < 1.0
    # a free draft pays at 80% (all 10); one costing 0.4 steps a token does not, and needs about 93%
    assert lookup.best_length(0.8) == (10, pytest.approx(expected_tokens(0.8, 10) / VERIFY_COST[10]))
    assert lookup.best_length(0.8)[1] > 1.1 and costly.best_length(0.8)[1] < 1.0
    assert costly.best_length(0.95)[1] > 1.1
    # where a few rows cost what one does, every draft pays
    assert PromptLookup(10, verify_costs=[1.0]).best_length(0.2) == (10, pytest.approx(1.25, abs=1e-6))


def test_a_free_draft_resumes_as_soon_as_the_tokens_that_came_follow_it():
    lookup = PromptLookup(4)
    text = np.array([[7, 8, 9, 10, 11, 12, 13, 3, 4, 7, 8]])
    assert lookup.propose(text, np.ones(text.shape, bool)) is None  # no evidence yet: checked, not sent
    text = np.append(text, [[9]], axis=1)  # the model wrote what the free draft said
    assert lookup.propose(text, np.ones(text.shape, bool)) is None  # one token: 3 of 4 expected would not pay
    text = np.append(text, [[10]], axis=1)
    drafts = lookup.propose(text, np.ones(text.shape, bool))
    assert drafts is not None and drafts.tolist() == [[11, 12, 13, 3]]
    lookup.accepted(0, 4)  # rejected: sent again only once the text follows it
    text = np.append(text, [[5]], axis=1)
    assert lookup.propose(text, np.ones(text.shape, bool)) is None and lookup.acceptance < 0.7
    assert lookup.rounds == 1 and lookup.loss == pytest.approx(VERIFY_COST[4] - 1)


def test_a_probe_waits_until_the_losses_fit_the_budget():
    costly = DraftModel(None, 10, draft_cost=0.4)
    costly._draft = lambda sequences, mask, length: np.zeros((1, length), np.int64)
    mask = np.ones((1, 400), bool)
    first = costly.propose(np.zeros((1, 10), np.int64), mask[:, :10])
    assert first is not None  # the first round may probe
    costly.accepted(0, first.shape[1])
    lost = costly.loss
    assert lost == pytest.approx(costly.round_cost(first.shape[1]) - 1)
    size = costly.best_length()[0]
    expected = costly.round_cost(size) - expected_tokens(costly.acceptance, size)  # a probe's expected loss
    sent = [length for length in range(11, 400) if costly.propose(np.zeros((1, length), np.int64),
                                                                  mask[:, :length]) is not None]
    # the next probe: once 3% of the tokens decoded cover what was lost and what a probe is expected to lose
    assert sent and 0.03 * (sent[0] - 10) >= lost + expected > 0.03 * (sent[0] - 11)
    assert sent[0] - 10 > 100


def test_generate_gives_a_draft_model_its_share_of_a_step(lm):
    options = dict(prompt_lookup_num_tokens=None, assistant_early_exit=1, num_assistant_tokens=5,
                   max_matching_ngram_size=None)
    early = _proposer(lm, options, None)
    assert isinstance(early, DraftModel) and early.num_tokens == 5
    assert early.draft_cost == pytest.approx(draft_step_cost(lm.early_exit(1), lm))
    layer = sum(p.nbytes for p in lm.layers[0].parameters())
    head = lm.embed.weight.nbytes  # tied: the table is the head
    assert early.draft_cost == pytest.approx((layer + head) / (4 * layer + head))
    assert _proposer(lm, dict(options, assistant_early_exit=None), lm).draft_cost == 1.0  # the model itself
    lookup = _proposer(lm, dict(options, assistant_early_exit=None, prompt_lookup_num_tokens=3), None)
    assert isinstance(lookup, PromptLookup) and lookup.draft_cost == 0.0


def test_bad_costs_are_refused():
    with pytest.raises(ValueError, match="draft_cost must be a number of decoding steps >= 0, got -1"):
        DraftModel(None, 4, draft_cost=-1)
    with pytest.raises(ValueError, match="verify_costs must be the positive costs of 1, 2, ... rows"):
        PromptLookup(4, verify_costs=[])
    with pytest.raises(ValueError, match="verify_costs"):
        PromptLookup(4, verify_costs=[1.0, float("nan")])
