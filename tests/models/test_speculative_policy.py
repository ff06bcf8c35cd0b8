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
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

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
                                  num_kv_heads=1, head_dim=8, mlp=MLPConfig(24)), rng=0)


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


PLAIN = verify_cost(12) + NEW - 1  # plain decoding: the prompt's forward, then a step per token after the first


@pytest.mark.parametrize("draft_cost", [0.0, 0.4, 1.0])
def test_a_draft_never_kept_costs_at_most_three_percent_over_plain_decoding(lm, monkeypatch, prompt_and_truth,
                                                                             draft_cost):
    ids, truth = prompt_and_truth
    never = Scripted(truth, 10, draft_cost, right=0.0)
    out, rows = _decode_steps(lm, monkeypatch, ids, never)
    np.testing.assert_array_equal(out, truth)
    assert never.kept == 0
    # a free draft is only checked against the tokens that came; a costly one probes once its loss would fit
    assert never.rounds == (0 if draft_cost == 0 else 1)
    assert sum(r > 1 for r in rows[1:]) == never.rounds and rows[0] == 12
    assert never.loss == pytest.approx(_steps(rows, never)) and 0 <= never.loss <= 0.03 * PLAIN


@pytest.mark.parametrize("draft_cost", [0.0, 0.4])
@pytest.mark.parametrize("right", [0.1, 0.15, 0.2])
def test_a_draft_rarely_kept_falls_back_to_plain_decoding(lm, monkeypatch, prompt_and_truth, draft_cost, right):
    ids, truth = prompt_and_truth
    rarely = Scripted(truth, 10, draft_cost, right, seed=int(right * 100))
    out, rows = _decode_steps(lm, monkeypatch, ids, rarely)
    np.testing.assert_array_equal(out, truth)
    assert _steps(rows, rarely) <= 0.03 * PLAIN
    assert rarely.rounds <= 1


@pytest.mark.parametrize("draft_cost", [0.0, 0.05])
def test_a_draft_always_kept_drafts_at_full_length(lm, monkeypatch, prompt_and_truth, draft_cost):
    ids, truth = prompt_and_truth
    always = Scripted(truth, 10, draft_cost, right=1.0)
    out, rows = _decode_steps(lm, monkeypatch, ids, always)
    np.testing.assert_array_equal(out, truth)
    # the first drafting round learns (a free draft after one token came as it said; a costly one is a probe of
    # 3, once its loss would fit), then the model runs rounds of 10 drafts and its own token, but the last
    drafting = [r for r in rows[1:] if r > 1]
    assert drafting[0] == 1 + (7 if draft_cost == 0 else 3)
    assert len(drafting) > 3 and drafting[1:-1] == [11] * (len(drafting) - 2)
    assert always.kept == always.proposed
    if draft_cost == 0:
        assert rows[1] > 1 and _steps(rows, always) < -0.6 * PLAIN  # 11 tokens for about 3.4 steps a round
    else:
        assert _steps(rows, always) < 0


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


def test_a_probe_is_sent_only_when_its_loss_would_fit_the_budget():
    costly = Scripted(np.zeros(600, np.int64) + 1, 10, draft_cost=0.4, right=0.0)  # drafts 2s where 1s come
    mask = np.ones((1, 600), bool)
    sent = []
    for length in range(10, 600):
        drafts = costly.propose(np.ones((1, length), np.int64), mask[:, :length])
        if drafts is not None:
            sent.append(length)
            costly.accepted(0, drafts.shape[1])
            # nothing kept: the loss is still within 3% of what plain decoding has cost (its prompt and the tokens)
            assert costly.loss <= 0.03 * (verify_cost(10) + length - 10)
    # with nothing kept a probe is one draft, about 2.1 steps lost: one every 70 tokens or so
    assert len(sent) == pytest.approx(0.03 * (verify_cost(10) + 590) / (VERIFY_COST[1] + 0.4 - 1), abs=1)
    assert sent[0] > 60 and costly.rounds == len(sent) and costly.kept == 0
    # a new sequence has a budget of its own
    assert costly.propose(np.ones((1, 10), np.int64), mask[:, :10]) is None and costly._loss_here == 0.0


def test_a_draft_model_counts_reading_what_it_has_not_seen(lm):
    early = DraftModel(lm.early_exit(1), 4, draft_cost=0.05)
    prompt = np.arange(130)[None] % 32
    mask = np.ones((1, 200), bool)
    reading = 0.05 * (VERIFY_COST[129] - 1)  # the whole prompt, at first
    assert early._catch_up_cost(prompt) == pytest.approx(reading)
    # a first round rides on the prompt's forward: 3 rows more, 3 drafts and the reading exceed 3% of that forward
    assert early.best_length()[0] == 3
    assert verify_cost(133) - verify_cost(130) + 3 * 0.05 + reading > 0.03 * verify_cost(130)
    assert early.propose(prompt, mask[:, :130]) is None
    drafts = early._draft(prompt, mask[:, :130], 2)  # the cache reads the prompt and the first draft
    assert early._catch_up_cost(np.append(prompt, drafts[:, :1] + 1, axis=1)) == 0.0  # one token to read
    assert early._catch_up_cost(np.append(prompt, np.zeros((1, 6), np.int64), axis=1)) == \
        pytest.approx(0.05 * (VERIFY_COST[4] - 1))  # 5 tokens past what it holds


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


def _counted_generate(lm, monkeypatch, ids, **options) -> tuple[np.ndarray, float]:
    """``generate``'s output and the steps its forwards cost beyond plain decoding's, by the cost model: the
    model's forwards of r rows, and the early-exit draft's at its share of a step."""
    spent = []
    share = draft_step_cost(lm.early_exit(1), lm)
    forward, early = CausalLM.forward, type(lm.early_exit(1)).forward

    def counting(self, input_ids, *args, **kwargs):
        spent.append(verify_cost(np.shape(input_ids)[1]))
        return forward(self, input_ids, *args, **kwargs)

    def counting_draft(self, input_ids, *args, **kwargs):
        spent.append(share * verify_cost(np.shape(input_ids)[1]))
        return early(self, input_ids, *args, **kwargs)
    monkeypatch.setattr(CausalLM, "forward", counting)
    monkeypatch.setattr(type(lm.early_exit(1)), "forward", counting_draft)
    out = lm.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=[], **options)
    monkeypatch.undo()
    plain = verify_cost(ids.shape[1]) + NEW - 1
    return out, sum(spent) - plain


def test_one_token_lookup_whose_every_draft_is_banned_costs_nothing(lm, monkeypatch, prompt_and_truth):
    """With no bigram repeated, a draft from a one-token match (the token that followed the last token before)
    would repeat a bigram: its first token is never kept."""
    ids, _ = prompt_and_truth
    options = dict(no_repeat_ngram_size=2)
    plain = lm.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=[], **options)
    out, extra = _counted_generate(lm, monkeypatch, ids, prompt_lookup_num_tokens=10, max_matching_ngram_size=1,
                                   **options)
    np.testing.assert_array_equal(out, plain)
    assert extra == 0.0  # no draft was sent: every one was checked against the token that came


def test_the_models_first_layer_as_a_draft_costs_at_most_three_percent(lm, monkeypatch, prompt_and_truth):
    ids, truth = prompt_and_truth
    out, extra = _counted_generate(lm, monkeypatch, ids, assistant_early_exit=1)
    np.testing.assert_array_equal(out[0], truth)
    assert extra <= 0.03 * (verify_cost(ids.shape[1]) + NEW - 1)
