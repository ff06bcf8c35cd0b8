"""Speculative decoding and reused caches: greedy output token for token the same as plain greedy decoding on
every family (batch 1 and a left-padded batch, hybrids included), sampled output with the model's own
distribution, and a cache reused across calls equal to a fresh start."""
import numpy as np
import pytest
from scipy import stats

pytest.importorskip("transformers")
from attnkit.decoding.sampling import generate, generate_stream, speculative_sample  # noqa: E402
from attnkit.decoding.speculative import DraftModel, PromptLookup  # noqa: E402
from attnkit.models import CausalLM, DecoderConfig, MLPConfig  # noqa: E402
from attnkit.pretrained import load_causal_lm  # noqa: E402
from hf_models import FAMILY_MODELS, saved_model  # noqa: E402

LENGTH_DEPENDENT = ("phi3_longrope",)  # refused: a draft could cross the change of its rotary tables
SPECULATIVE = [name for name in FAMILY_MODELS if name not in LENGTH_DEPENDENT]
FREE = [1.0]  # verification costs what a step does: the proposers draft every round they expect to gain in


def _repetitive_prompt(vocab: int, rows: int, seed: int):
    """Prompts that repeat a phrase, so prompt lookup finds drafts; left-padded to a common length."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(1, vocab, size=5)
    ids = np.tile(np.concatenate([phrase, rng.integers(1, vocab, size=3), phrase]), (rows, 1))  # (B, 13)
    ids[1:] = (ids[1:] + np.arange(1, rows)[:, None]) % vocab
    mask = np.ones(ids.shape, bool)
    if rows > 1:
        mask[1, :2] = False
        ids[1, :2] = 0
    return ids, mask


@pytest.mark.parametrize("name", SPECULATIVE)
@pytest.mark.parametrize("rows", [1, 3])
def test_every_speculative_method_keeps_greedy_output_token_for_token(tmp_path, name, rows):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=np.float64)
    draft = load_causal_lm(folder, dtype=np.float64)  # a draft with the same ids: here the model itself
    ids, mask = _repetitive_prompt(lm.config.vocab_size, rows, seed=rows)
    new = dict(max_new_tokens=14, min_new_tokens=14, eos_token_id=[])
    plain = lm.generate(ids, mask, **new)
    methods = {"lookup": lambda: PromptLookup(4, verify_costs=FREE),
               "one-token lookup": lambda: PromptLookup(3, max_ngram=1, verify_costs=FREE),
               "early exit": lambda: DraftModel(lm.early_exit(1), 3, draft_cost=0.0, verify_costs=FREE),
               "draft model": lambda: DraftModel(draft, 5, draft_cost=0.0, verify_costs=FREE)}
    for method, make in methods.items():
        proposer = make()
        np.testing.assert_array_equal(lm.generate(ids, mask, **new, assistant_model=proposer), plain, err_msg=method)
        assert proposer.rounds >= 1, method  # drafts were checked, not only compared with the tokens that came
    np.testing.assert_array_equal(lm.generate(ids, mask, **new, assistant_early_exit=1), plain)  # as generate builds


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_5_text", "mistral_window", "gemma4_text"])
def test_greedy_stays_the_same_with_stops_eos_and_processors(tmp_path, name):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=np.float64)
    ids, mask = _repetitive_prompt(lm.config.vocab_size, 2, seed=5)
    plain = lm.generate(ids, mask, max_new_tokens=16, eos_token_id=[])
    eos = int(plain[0, ids.shape[1] + 5])  # a token the first row produces: it ends that row early
    for options in (dict(eos_token_id=[eos]), dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=3),
                    dict(min_new_tokens=8, eos_token_id=[eos])):
        want = lm.generate(ids, mask, max_new_tokens=16, **options)
        got = lm.generate(ids, mask, max_new_tokens=16, assistant_model=PromptLookup(5, verify_costs=FREE),
                          **options)
        np.testing.assert_array_equal(got, want, err_msg=str(options))


def test_prompt_lookup_drafts_what_followed_the_last_match():
    lookup = PromptLookup(3, max_ngram=2, verify_costs=FREE)
    mask = np.ones((2, 8), bool)
    seqs = np.array([[1, 2, 9, 4, 5, 6, 2, 9], [5, 6, 7, 5, 6, 7, 8, 6]])
    # row 0: "2 9" last seen at 1 -> 4 5 6; row 1: "8 6" unseen, and a one-token match is not used -> no draft
    # (a row without one is padded with its last token, which the model rejects there)
    assert lookup.propose(seqs, mask).tolist() == [[4, 5, 6], [6, 6, 6]]
    # a one-token match only when asked for: "6" last seen at 4 -> 7 8 6
    assert PromptLookup(3, max_ngram=1, verify_costs=FREE).propose(seqs[1:], mask[1:]).tolist() == [[7, 8, 6]]
    mask[1, :3] = False  # padding is not text
    assert lookup.propose(np.array([[1, 2, 3, 4, 5, 6, 7, 8]]), mask[:1]) is None


def test_speculative_sampling_keeps_the_models_distribution():
    """The accept rule draws from p whatever the draft: the frequencies of 40,000 draws match p (chi-square)."""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    for draft in (0, 3):  # a likely and an unlikely draft
        tokens = np.concatenate([speculative_sample(np.repeat(logits, 4000, axis=0), np.full(4000, draft), rng)
                                 for _ in range(10)])
        counts = np.bincount(tokens, minlength=5)
        assert stats.chisquare(counts, 40000 * np.exp(logits[0])).pvalue > 1e-3


def test_sampled_speculative_decoding_has_the_frequencies_of_plain_sampling():
    """On a tiny model, the second new token's frequencies under prompt lookup match plain sampling's."""
    lm = CausalLM(DecoderConfig(family="llama", vocab_size=6, hidden_size=8, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=4, mlp=MLPConfig(12)), rng=1)
    prompt = np.tile([[1, 2, 3, 1, 2, 3, 1, 2]], (2000, 1))
    options = dict(max_new_tokens=3, do_sample=True, temperature=2.0, eos_token_id=[])
    plain = lm.generate(prompt, seed=1, **options)[:, -2]
    lookup = PromptLookup(2, verify_costs=FREE)
    spec = lm.generate(prompt, seed=2, assistant_model=lookup, **options)[:, -2]
    assert lookup.rounds >= 1  # the first round drafted: its second token went through the accept rule
    table = np.stack([np.bincount(plain, minlength=6), np.bincount(spec, minlength=6)])
    table = table[:, table.sum(axis=0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_5_text", "mistral_window", "deepseek_v3", "gemma4_text"])
def test_a_reused_cache_prefills_only_the_new_tokens_and_changes_nothing(tmp_path, monkeypatch, name):
    folder, _ = saved_model(name, tmp_path)
    lm = load_causal_lm(folder, dtype=np.float64)
    rng = np.random.default_rng(2)
    turn1 = rng.integers(1, lm.config.vocab_size, size=(1, 9))
    cache = lm.new_cache(1)
    first = lm.generate(turn1, max_new_tokens=6, eos_token_id=[], past_key_values=cache)
    turn2 = np.concatenate([first, rng.integers(1, lm.config.vocab_size, size=(1, 4))], axis=1)  # (1, 19)
    fed = []
    forward = type(lm).forward

    def counting(self, input_ids, *args, **kwargs):
        fed.append(np.shape(input_ids)[1])
        return forward(self, input_ids, *args, **kwargs)
    monkeypatch.setattr(type(lm), "forward", counting)
    second = lm.generate(turn2, max_new_tokens=6, eos_token_id=[], past_key_values=cache)
    monkeypatch.undo()
    np.testing.assert_array_equal(second, lm.generate(turn2, max_new_tokens=6, eos_token_id=[]))
    # the prompt's ids the cache lacked (all but the last of turn 1's were kept), then five decoding steps
    assert sum(fed) == turn2.shape[1] - (first.shape[1] - 1) + 5
    # a prompt that differs inside the cached part: cropped back to the shared prefix
    turn3 = turn2.copy()
    turn3[0, 4] = (turn3[0, 4] + 1) % lm.config.vocab_size
    third = lm.generate(turn3, max_new_tokens=4, eos_token_id=[], past_key_values=cache)
    np.testing.assert_array_equal(third, lm.generate(turn3, max_new_tokens=4, eos_token_id=[]))


def test_bad_speculative_requests_are_refused(tmp_path):
    folder, _ = saved_model("llama_gqa", tmp_path)
    lm = load_causal_lm(folder)
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="two ways of drafting"):
        lm.generate(ids, prompt_lookup_num_tokens=2, assistant_early_exit=1)
    with pytest.raises(ValueError, match="not beam search"):
        lm.generate(ids, prompt_lookup_num_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="assistant_early_exit must be at most 64"):
        lm.generate(ids, assistant_early_exit=65)
    with pytest.raises(ValueError, match=r"num_layers must be at most 2"):
        lm.generate(ids, assistant_early_exit=3)
    with pytest.raises(TypeError, match="assistant_model must be a causal LM"):
        lm.generate(ids, assistant_model="small.gguf")
    with pytest.raises(ValueError, match="past_key_values holds 2 rows but the prompt has 1"):
        lm.generate(ids, past_key_values=lm.new_cache(2))
    longrope, _ = saved_model("phi3_longrope", tmp_path)
    with pytest.raises(ValueError, match="rotary tables change with the sequence's length"):
        load_causal_lm(longrope).generate(ids, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="cannot run beam search"):
        list(generate_stream(lm, ids, num_beams=2))
    assert generate(lm, ids, max_new_tokens=2, prompt_lookup_num_tokens=2).shape == (1, 5)
