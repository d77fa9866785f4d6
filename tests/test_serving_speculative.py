"""Speculation inside continuous batching: every row proposes, one packed pass verifies all
of them, each row keeps what it earned and its block table is cropped behind it. A request's
tokens are the ones it gets served alone, whoever shares its steps, whatever the pool does."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv import Request, Speculation, serve
from minikv.engine.eagle import FeatureHead, FeatureProposer
from minikv.engine.serving import Engine

from conftest import varied_model

MODEL = varied_model("tiny", seed=0).double()  # float64: no near-tie flips between pass shapes
torch.manual_seed(1)
DRAFT = minikv.GPT(minikv.GPTConfig.preset("tiny", n_layer=1, n_head=2, n_embd=32)).double().eval()
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def requests(draw):
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        motif = draw(st.lists(st.integers(0, 511), min_size=1, max_size=4))
        prompt = (motif * 6)[:draw(st.integers(1, 20))]  # repeats: lookup finds proposals
        out.append(Request(prompt, draw(st.integers(1, 24)),
                           temperature=draw(st.sampled_from([0.0, 0.0, 1.0])), seed=i,
                           deterministic=draw(st.booleans()) and i == 0,
                           arrival=draw(st.integers(0, 4))))
    return out


HEAD = FeatureHead(FeatureHead.config_for(MODEL)).double().eval()  # random: often wrong


def speculation(kind: str, gamma: int) -> Speculation:
    """Each proposer the server takes: prompt lookup, a draft model, the feature head's chains
    and its token trees."""
    proposer = {"head": lambda: FeatureProposer(MODEL, HEAD),
                "tree": lambda: FeatureProposer(MODEL, HEAD, tree=(2, 2))}.get(kind)
    return Speculation(gamma=gamma, draft=DRAFT if kind == "draft" else None,
                       proposer=proposer() if proposer else None)


@SETTINGS
@given(reqs=requests(), gamma=st.integers(1, 5),
       kind=st.sampled_from(["lookup", "draft", "head", "tree"]),
       tight=st.booleans(), page_size=st.sampled_from([1, 4, 16]))
def test_a_speculating_server_gives_every_request_its_tokens_alone(reqs, gamma, kind, tight,
                                                                   page_size):
    """Greedy and seeded-sampled requests, a deterministic one among them, arriving at different
    steps, each proposer the server takes (trees included); with a pool so small that requests
    are preempted (tight), or not."""
    spec = speculation(kind, gamma)
    written = spec.proposer.max_tokens(gamma) if spec.proposer else gamma
    ahead = max(4, written + 1)  # serve's replay window (4), or a round's pass
    need = max(-(-(len(r.prompt) + r.max_new_tokens + ahead) // page_size) + 1
               for r in reqs)
    outs = serve(MODEL, reqs, speculative=spec, page_size=page_size,
                 num_blocks=need if tight else None)
    for r, out in zip(reqs, outs):
        alone = serve(MODEL, [r], page_size=page_size)[0]
        assert out.tokens == alone.tokens
    assert outs.pool.n_free == outs.pool.num_blocks  # every block back


def test_a_served_tree_is_verified_whole_in_the_batch_pass():
    """The feature head's trees in the server: each step's verify pass holds every row's whole
    tree (2 children of the root, then 2 growing nodes with 2 children each), its rows in one
    pass, and every request still gets its plain tokens."""
    reqs = [Request([5, 6, 7, 8] * 4, 20), Request([9, 10, 11] * 5, 20)]
    spec = Speculation(gamma=3, proposer=FeatureProposer(MODEL, HEAD, tree=(2, 2)))
    outs = serve(MODEL, reqs, speculative=spec, trace=True)
    assert [o.tokens for o in outs] == [serve(MODEL, [r])[0].tokens for r in reqs]
    verifies = [e for o in outs for e in o.trace if e.kind == "verify"]
    full = [e for e in verifies if len(e.input_ids) == 2 + 2 * (2 * 2)]  # γ = 3 deep, whole
    assert full and any(e.batch == 2 for e in full)
    assert all(len(set(e.positions)) < len(e.positions) for e in full)  # siblings share one


def close_draft(noise: float) -> minikv.GPT:
    """The target with its weights nudged: it agrees with the target often, not always."""
    draft = varied_model("tiny", seed=0).double()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7),
                               dtype=p.dtype) * noise)
    return draft


def test_rows_keep_what_they_earned_ragged():
    """Two requests verified in the same passes keep different numbers of proposals in some of
    them, and after every step each one's cache holds exactly its committed tokens but the last."""
    reqs = [Request([7, 8, 9, 10, 11], 24), Request(list(range(100, 112)), 24)]
    outs = serve(MODEL, reqs, speculative=Speculation(3, draft=close_draft(0.05)), trace=True)
    assert [o.tokens for o in outs] == [serve(MODEL, [r])[0].tokens for r in reqs]
    verifies = [{e.step: e for e in o.trace if e.kind == "verify"} for o in outs]
    shared = sorted(set(verifies[0]) & set(verifies[1]))
    assert shared and all(verifies[0][t].batch == 2 for t in shared)
    assert any(len(verifies[0][t].accepted) != len(verifies[1][t].accepted) for t in shared)
    for o in outs:
        commits = [e for e in o.trace if e.kind == "commit"]
        assert all(e.cache_len_after == e.sequence_len - 1 for e in commits)


@pytest.mark.parametrize("gamma, n", [(1, 9), (3, 17), (4, 30)])
def test_a_draft_that_is_always_right_commits_gamma_plus_one_tokens_a_step(gamma, n):
    """The target as its own draft: every proposal accepted, so after the prefill's token each
    step commits γ + 1 (the last step what the budget leaves)."""
    out = serve(MODEL, [Request([5, 6, 7], n)], speculative=Speculation(gamma, draft=MODEL))[0]
    assert out.tokens == minikv.generate(MODEL, [5, 6, 7], n).tokens
    assert out.stats.rounds == -(-(n - 1) // (gamma + 1))
    assert out.stats.rejected_rounds == 0 and out.stats.alpha == 1.0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(speculative=4), TypeError, "Speculation"),
    (dict(speculative=Speculation(),
          policy=minikv.engine.FirstComeFirstServed(64, chunked_prefill=True)), ValueError,
     "chunked prefill"),
])
def test_bad_speculation_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        serve(MODEL, [Request([1, 2], 4)], **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0), "gamma"), (dict(gamma=2.0), "gamma"), (dict(ngram=0), "ngram")])
def test_speculation_checks_its_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Speculation(**kwargs)


def test_a_draft_of_another_vocabulary_is_refused():
    other = minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=600)).double()
    with pytest.raises(ValueError, match="the target's tokenizer"):
        serve(MODEL, [Request([1, 2], 4)], speculative=Speculation(draft=other))
    with pytest.raises(ValueError, match="the target's tokenizer"):  # before any request
        Engine(MODEL, 8, speculative=Speculation(draft=other))


def test_a_draft_with_a_shorter_context_is_refused_where_the_parts_meet():
    """Issue 51: a request that fits the target but not the draft's context is refused when it
    is added, naming the draft, not halfway through a run with a message about max_len."""
    short = minikv.GPT(minikv.GPTConfig.preset("tiny", n_layer=1, n_head=2, n_embd=32,
                                               block_size=24)).double().eval()
    prompt = list(range(10))
    for run in (lambda n: serve(MODEL, [Request(prompt, n)], speculative=Speculation(2, short)),
                lambda n: minikv.speculative_generate(MODEL, short, prompt, n)):
        with pytest.raises(ValueError, match="the draft cache's max_len=24"):
            run(20)
        run(8)  # within both contexts: served
    engine = Engine(MODEL, 64, speculative=Speculation(2, short))
    with pytest.raises(ValueError, match="draft"):
        engine.add(Request(prompt, 20))
    assert not engine.has_work() and engine.pool.n_free == 64  # nothing queued, nothing taken
