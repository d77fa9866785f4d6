"""Token trees: one target pass reads every branch as if it were the only continuation; the
accepted path is the one the target itself takes; the cache keeps that path and nothing else;
under sampling the tree's rule keeps the target's distribution. And the FeatureHead (EAGLE)
proposing chains and trees through the same loop."""
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv.engine import verify
from minikv.engine.eagle import FeatureHead, FeatureProposer, feature_generate, tree_size
from minikv.engine.speculative import Proposal, speculate
from minikv.engine.tree import children, depths, tree_attention, tree_mask, tree_positions

from conftest import varied_model
from test_speculative import V, chi_square_p_value, small_model

TARGET = varied_model("tiny", seed=0).double()
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trees(draw, max_nodes=10, vocab=512):
    """parents (each an earlier node or -1) and tokens (siblings distinct, as proposers give)."""
    n = draw(st.integers(1, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = []
    for i, p in enumerate(parents):
        used = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(draw(st.integers(0, vocab - 1).filter(lambda t: t not in used)))
    return parents, tokens


# --- the shape: positions and mask ----------------------------------------------------------------

def test_the_docstring_tree():
    parents = [-1, -1, 0, 0]  # " the", " a", " the cat", " the dog"
    assert depths(parents) == [1, 1, 2, 2]
    assert tree_positions(parents, 9) == [10, 10, 11, 11]
    assert children(parents) == {-1: [0, 1], 0: [2, 3], 1: [], 2: [], 3: []}
    mask = tree_mask(parents, prefix=2)  # two committed rows, the second the root
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],   # " the"
                             [1, 1, 0, 1, 0, 0],   # " a": not its sibling
                             [1, 1, 1, 0, 1, 0],   # " cat": its parent " the", itself
                             [1, 1, 1, 0, 0, 1]]   # " dog": not " cat"


def test_a_chain_is_the_causal_tree():
    parents = [-1, 0, 1, 2]
    assert tree_mask(parents, prefix=3).equal(torch.ones(7, 7, dtype=torch.bool).tril())
    assert tree_positions(parents, 4) == [5, 6, 7, 8]


def path_of(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@FAST
@given(tree=trees(), prompt=st.lists(st.integers(0, 511), min_size=2, max_size=8))
def test_one_tree_pass_scores_every_branch_as_its_own_chain(tree, prompt):
    """Node i's logits in the tree pass = the last logits of a plain pass over prompt + i's path."""
    parents, tokens = tree
    cache = minikv.KVCache.for_model(TARGET, max_len=32)
    with torch.no_grad():
        TARGET(torch.tensor([prompt[:-1]]), cache=cache)
        rows = [prompt[-1]] + tokens
        mask = tree_mask(parents, prefix=1)
        positions = [len(prompt) - 1] + tree_positions(parents, len(prompt) - 1)
        out = TARGET(torch.tensor([rows]), cache=cache, positions=torch.tensor(positions),
                     attention=tree_attention(mask))[0]
        for i in range(len(tokens)):
            alone = TARGET(torch.tensor([prompt + [tokens[j] for j in path_of(i, parents)]]))
            torch.testing.assert_close(out[1 + i], alone[0, -1], atol=1e-9, rtol=0)


# --- the core: the accepted path, committed, and the cache compacted -----------------------------

def target_scores(rows, cache, positions=None, attention=minikv.engine.causal_attention):
    ids = torch.tensor([rows])
    if positions is None:
        return TARGET(ids, cache=cache)[0]
    return TARGET(ids, cache=cache, positions=torch.tensor(positions), attention=attention)[0]


@FAST
@given(tree=trees(), prompt=st.lists(st.integers(0, 511), min_size=2, max_size=8),
       plant=st.integers(0, 9), deep=st.integers(0, 4))
def test_greedy_tree_commits_the_targets_own_path_and_compacts_the_cache(tree, prompt, plant,
                                                                         deep):
    """A node, made to hold the target's greedy continuation along its path (so some path is
    accepted, `deep` nodes long at most), is followed exactly as the target goes; the cache then
    equals a fresh prefill of the committed tokens."""
    parents, tokens = tree
    truth = minikv.generate(TARGET, prompt, 12).tokens
    node = min(plant, len(tokens) - 1)
    path = path_of(node, parents)[:deep]
    for d, j in enumerate(path):  # the target's own tokens down this path (siblings stay apart)
        for s in children(parents)[parents[j]]:
            if s != j and tokens[s] == truth[d]:
                tokens[s] = (truth[d] + 1) % 512
        tokens[j] = truth[d]
    seq = list(prompt)
    cache = minikv.KVCache.for_model(TARGET, max_len=32)
    with torch.no_grad():
        TARGET(torch.tensor([seq[:-1]]), cache=cache)
        accept = partial(verify.accept_matching, sampling=minikv.SamplingParams(),
                         first_position=len(seq), parents=parents)
        rnd = verify.verify_and_commit(seq, tokens, cache, target_scores, accept, parents=parents)
    n_ok = rnd.verdict.accepted
    assert seq == prompt + truth[:n_ok + 1] and n_ok >= len(path)
    assert [tokens[i] for i in rnd.verdict.nodes] == truth[:n_ok]
    assert cache.get_seq_length() == len(seq) - 1
    fresh = minikv.KVCache.for_model(TARGET, max_len=32)
    with torch.no_grad():
        TARGET(torch.tensor([seq[:-1]]), cache=fresh)
    for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        torch.testing.assert_close(a[:, :, :len(seq) - 1], b[:, :, :len(seq) - 1], atol=1e-9,
                                   rtol=0)


def test_compact_moves_the_path_into_place_and_refuses_bad_slots():
    cache = minikv.KVCache.for_model(TARGET, max_len=16)
    with torch.no_grad():
        TARGET(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
    before = cache.keys[0][:, :, :7].clone()
    cache.compact([4, 6], 3)
    assert cache.get_seq_length() == 5
    assert cache.keys[0][:, :, 3].equal(before[:, :, 4])
    assert cache.keys[0][:, :, 4].equal(before[:, :, 6])
    assert cache.keys[0][:, :, :3].equal(before[:, :, :3])
    for slots, start in [([4, 3], 3), ([2], 3), ([5], 3), ([3, 3], 2), ([1.0], 0)]:
        with pytest.raises(ValueError, match="slots must be|compact start"):
            cache.compact(slots, start)
    assert cache.get_seq_length() == 5


# --- the loop: trees from any proposer ------------------------------------------------------------

def oracle_tree(prompt, n):
    """A tree whose first branch is the target's greedy continuation and second a wrong one."""
    truth = list(prompt) + minikv.generate(TARGET, prompt, n).tokens

    def propose(seq, k):
        right = truth[len(seq):len(seq) + k]
        if not right:
            return Proposal([])
        wrong = (right[0] + 1) % 512
        return Proposal(right + [wrong], parents=list(range(-1, len(right) - 1)) + [-1])
    return propose


@pytest.mark.parametrize("gamma, n", [(1, 9), (3, 20), (4, 17)])
def test_a_tree_proposer_plugs_into_the_round_loop(gamma, n):
    prompt = [5, 6, 7]
    out = speculate(TARGET, prompt, n, minikv.SamplingParams(), oracle_tree(prompt, n),
                    gamma=gamma, tree_size=gamma + 1, trace=True)
    assert out.tokens == minikv.generate(TARGET, prompt, n).tokens
    s = out.stats
    assert s.rounds == -(-(n - 1) // (gamma + 1))
    assert s.rejected_rounds == 0 and s.alpha == 1.0  # every path reached its leaf
    verifies = [e for e in out.trace if e.kind == "verify"]
    assert all(len(e.positions) == len(e.input_ids) for e in verifies)


def test_bad_trees_are_refused():
    prompt = [5, 6, 7]
    with pytest.raises(ValueError, match="tree_size"):
        speculate(TARGET, prompt, 5, minikv.SamplingParams(),
                  lambda s, k: Proposal([1, 2], parents=[-1, -1]))
    with pytest.raises(ValueError, match="parents\\[1\\]"):
        speculate(TARGET, prompt, 5, minikv.SamplingParams(),
                  lambda s, k: Proposal([1, 2], parents=[-1, 1]), tree_size=4)
    with pytest.raises(ValueError, match="k deep"):
        speculate(TARGET, prompt, 9, minikv.SamplingParams(),
                  lambda s, k: Proposal([1, 2, 3], parents=[-1, 0, 1]), gamma=2, tree_size=4)


# --- sampling: the tree's rule keeps the target's distribution -----------------------------------

def exact_pair_after_one(target, prompt) -> torch.Tensor:
    """p(t2, t3 | prompt), t1 summed out: the law of the first round's first two tokens."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
        out = torch.zeros(V, V, dtype=torch.float64)
        for t1 in range(V):
            p2 = torch.softmax(target(torch.tensor([prompt + [t1]]))[0, -1], -1)
            rows = torch.tensor([prompt + [t1, t2] for t2 in range(V)])
            p3 = torch.softmax(target(rows)[:, -1], -1)
            out += p1[t1] * p2[:, None] * p3
    return out


class IidTree:
    """Two children of the root drawn independently from the draft's q, and two of each of them:
    six tokens, two deep."""

    def __init__(self, draft, generator):
        self.draft, self.generator = draft, generator

    def q(self, seq):
        with torch.no_grad():
            return torch.softmax(self.draft(torch.tensor([seq]))[0, -1], -1)

    def __call__(self, seq, k):
        if k == 0:
            return Proposal([])
        q0 = self.q(seq)
        first = torch.multinomial(q0, 2, replacement=True, generator=self.generator).tolist()
        tokens, parents, probs = list(first), [-1, -1], [q0, q0]
        if k >= 2:
            for i, t in enumerate(first):
                q1 = self.q(seq + [t])
                tokens += torch.multinomial(q1, 2, replacement=True,
                                            generator=self.generator).tolist()
                parents += [i, i]
                probs += [q1, q1]
        return Proposal(tokens, torch.stack(probs), parents=parents)


def sampled_pairs(target, draft, prompt, n) -> torch.Tensor:
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seed in range(n):
        sp = minikv.SamplingParams(temperature=1.0, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        out = speculate(target, prompt, 4, sp, IidTree(draft, gen), gamma=2, tree_size=6,
                        generator=gen)
        counts[out.tokens[1], out.tokens[2]] += 1
    return counts


N_SAMPLES, ALPHA = 3000, 1e-3


def test_tree_speculative_sampling_matches_the_target_distribution():
    target, draft, prompt = small_model(1), small_model(2), [0, 3]
    probs = exact_pair_after_one(target, prompt)
    assert chi_square_p_value(sampled_pairs(target, draft, prompt, N_SAMPLES), probs) > ALPHA


def test_the_tree_test_catches_siblings_judged_against_p_alone(monkeypatch):
    """Trying the next sibling (and the final draw) against p instead of what the target still
    wants after a refusal biases the tokens toward the draft; the same test rejects it."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    target, draft, prompt = small_model(1), small_model(2), [0, 3]
    probs = exact_pair_after_one(target, prompt)
    assert chi_square_p_value(sampled_pairs(target, draft, prompt, N_SAMPLES), probs) < ALPHA


# --- the feature head (EAGLE) ---------------------------------------------------------------------

def random_head(target, seed=0):
    torch.manual_seed(seed)
    return FeatureHead(FeatureHead.config_for(target)).to(target.dtype).eval()


@FAST
@given(prompt=st.lists(st.integers(0, 511), min_size=1, max_size=10), gamma=st.integers(1, 5),
       tree=st.sampled_from([None, (1, 1), (2, 2), (3, 2), (1, 3)]), n=st.integers(1, 30))
def test_greedy_feature_speculation_equals_target_greedy(prompt, gamma, tree, n):
    head = random_head(TARGET)
    out = feature_generate(TARGET, head, prompt, n, gamma=gamma, tree=tree)
    assert out.tokens == minikv.generate(TARGET, prompt, n).tokens


def test_the_head_sees_the_targets_true_features_of_committed_tokens():
    """After every round, the proposer's stored features of the committed positions equal the
    target's own features of the committed sequence (chain and tree alike)."""
    head = random_head(TARGET)
    for tree in (None, (2, 2)):
        sp = minikv.SamplingParams()
        gen = torch.Generator().manual_seed(0)
        propose = FeatureProposer(TARGET, head, sp, gen, tree)
        seen = []

        def spy(seq, k, propose=propose):
            out = propose(seq, k)
            seen.append((list(seq), propose.features[:len(seq) - 1].clone()))
            return out
        speculate(TARGET, [3, 1, 4, 1, 5], 20, sp, spy, gamma=3, verifier=propose.verify,
                  tree_size=tree_size(3, 2, 2))
        for seq, feats in seen:
            with torch.no_grad():
                truth = TARGET.features(torch.tensor([seq[:-1]]))[0]
            torch.testing.assert_close(feats, truth, atol=1e-9, rtol=0)


def feature_pairs(target, head, prompt, n, tree) -> torch.Tensor:
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seed in range(n):
        out = feature_generate(target, head, prompt, 4, gamma=2, temperature=1.0, seed=seed,
                               tree=tree)
        counts[out.tokens[1], out.tokens[2]] += 1
    return counts


@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_sampled_feature_speculation_keeps_the_target_distribution(tree):
    target, prompt = small_model(1), [0, 3]
    head = random_head(target, seed=5)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.6)
    probs = exact_pair_after_one(target, prompt)
    assert chi_square_p_value(feature_pairs(target, head, prompt, 2000, tree), probs) > ALPHA


def test_a_head_for_another_model_is_refused():
    other = minikv.GPT(minikv.GPTConfig.preset("tiny", n_embd=32, n_head=2)).double().eval()
    with pytest.raises(ValueError, match="FeatureHead made for this target"):
        feature_generate(TARGET, random_head(other), [1, 2], 4)
    with pytest.raises(ValueError, match="tree must be"):
        feature_generate(TARGET, random_head(TARGET), [1, 2], 4, tree=2)
    with pytest.raises(ValueError, match="tree width"):
        feature_generate(TARGET, random_head(TARGET), [1, 2], 4, tree=(0, 2))


def test_the_tree_stepper_draws_every_step_of_a_round():
    """Proposed, one step per judged depth, committed; the numbers line gives the cache: every
    node's K/V until the commit keeps the accepted path."""
    from minikv.viz.tree import TreeStepper, round_steps
    prompt = [5, 6, 7]
    truth = minikv.generate(TARGET, prompt, 4).tokens
    parents = [-1, -1, 1, 1, 0]  # node 1 holds the target's token; its children do not
    tokens = [(truth[0] + 1) % 512, truth[0], (truth[1] + 1) % 512, (truth[1] + 2) % 512, 9]
    seq, cache = list(prompt), minikv.KVCache.for_model(TARGET, max_len=32)
    with torch.no_grad():
        TARGET(torch.tensor([seq[:-1]]), cache=cache)
        accept = partial(verify.accept_matching, sampling=minikv.SamplingParams(),
                         first_position=len(seq), parents=parents)
        rnd = verify.verify_and_commit(seq, tokens, cache, target_scores, accept, parents=parents)
    assert rnd.verdict.path == (1,) and seq == prompt + truth[:2]
    steps = round_steps(rnd)
    assert [s["kind"] for s in steps] == ["proposed", "judge", "judge", "commit"]
    assert (steps[1]["state"][0], steps[1]["state"][1]) == ("rejected", "accepted")
    stepper = TreeStepper(rnd, str, "root")
    assert stepper.n_steps == 4
    assert stepper.info(0).startswith("KV cache: 8 positions")   # 2 cached, the root, 5 nodes
    assert stepper.info(3).startswith("KV cache: 4 positions")   # prompt + 1 accepted
    assert "none of" in stepper.describe(2) and "the target's" in stepper.describe(3)
