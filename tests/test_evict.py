"""Caches that evict by attention score (engine/evict.py): with room for the whole text each is
the plain cache; with less, each keeps what its rule says, checked three ways: by hand on planted
scores, against scores a plain masked pass computes independently, and as a full model that masks
exactly the positions the cache dropped. The cache never holds more than its budget."""
import math

import pytest
import torch

import minikv
from minikv.engine.config import LLAMA
from minikv.engine.evict import H2OCache, SnapKVCache

from conftest import varied_model

MODEL = varied_model().double()
MODELS = {"gpt2": MODEL, "gqa": varied_model(n_kv_head=2).double(),
          "rope": varied_model(n_kv_head=2, n_inner=176, **LLAMA).double()}


def ids_of(batch: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (batch, T), generator=torch.Generator().manual_seed(seed))


def run(model, ids: torch.Tensor, cache, prompt: int) -> torch.Tensor:
    """Logits (B, T, vocab): the first `prompt` tokens in one pass, then one token per pass."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], cache=cache, attention=cache.attention)]
        out += [model(ids[:, t:t + 1], cache=cache, attention=cache.attention)
                for t in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1)


def masked_pass(model, ids: torch.Tensor, sees) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The plain full pass, no cache, where in layer l query t sees key j iff sees(l)[t, j]
    ((T, T) or (B, T, T) booleans): its logits and each layer's weights (B, nh, T, T), computed
    here, not by the cache."""
    weights = []

    def attention(q, k, v):
        k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
        mask = sees(len(weights))
        mask = mask[:, None] if mask.dim() == 3 else mask
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~mask, -math.inf)
        weights.append(w.softmax(-1))
        return weights[-1] @ v
    with torch.no_grad():
        return model(ids, attention=attention), weights


def causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


# --- room for everything: the plain cache -------------------------------------------------------
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("make", [lambda m, B: H2OCache.for_model(m, 20, 10, batch_size=B),
                                  lambda m, B: SnapKVCache.for_model(m, 24, 6, batch_size=B)],
                         ids=["h2o", "snapkv"])
@pytest.mark.parametrize("batch", [1, 2])
def test_with_room_for_the_text_each_policy_is_the_plain_cache(kind, make, batch):
    model, ids = MODELS[kind], ids_of(batch, 30)
    cache = make(model, batch)
    plain = minikv.KVCache.for_model(model, batch_size=batch, max_len=30)
    with torch.no_grad():
        want = torch.cat([model(ids[:, :18], cache=plain)]
                         + [model(ids[:, t:t + 1], cache=plain) for t in range(18, 30)], dim=1)
    torch.testing.assert_close(run(model, ids, cache, 18), want)
    assert cache.get_seq_length() == 30
    assert [p.tolist() for p in cache.positions] == [[list(range(30))] * batch] * 2


# --- by hand: planted scores in a one-layer, one-head cache of 1-wide keys ----------------------
def planted(cache, weights: list[float], at: int = 0):
    """One pass of len(weights) queries of 1 whose keys are log(w): a query's weights are the w
    it sees, normalized."""
    T = len(weights)
    key = torch.tensor(weights, dtype=torch.float64).log().view(1, 1, T, 1)
    k, v = cache.update(key, torch.zeros_like(key), 0)
    cache.attention(torch.ones(1, 1, T, 1, dtype=torch.float64), k, v)


def hand_made(cls, *policy):
    return cls(1, 1, 1, *policy, block_size=16, dtype=torch.float64)


def test_h2o_by_hand():
    """w = 1, 8, 4, 2 in one pass. Received: position 0: 1 + 1/9 + 1/13 + 1/15 ≈ 1.26; 1: 8/9 +
    8/13 + 8/15 ≈ 2.04; 2: 4/13 + 4/15 ≈ 0.57; 3: 2/15. One heavy hitter and one recent: 1 and
    3. Then w = 16 reads 1 and 3 (8, 2, 16 of 26): 1 has ≈ 2.34, 3 ≈ 0.21; 4 is the recent one."""
    cache = hand_made(H2OCache, 1, 1)
    planted(cache, [1, 8, 4, 2])
    assert cache.kept() == [[1, 3]]
    torch.testing.assert_close(cache.scores[0][0], torch.tensor(
        [8 / 9 + 8 / 13 + 8 / 15, 2 / 15], dtype=torch.float64))
    planted(cache, [16])
    assert cache.kept() == [[1, 4]] and cache.get_seq_length() == 5


def test_snapkv_by_hand():
    """w = 1, 4, 1, 3, 3 | 1, 1: the last two queries vote for 0..4 in proportion to w. Alone,
    1 (w = 4) wins; pooled over 3 neighbours (zeros past the ends) 2 wins, (4 + 1 + 3) / 3,
    sitting between heavy neighbours; the window 5, 6 is always kept."""
    w = [1, 4, 1, 3, 3, 1, 1]
    for kernel, kept in ((1, [1, 5, 6]), (3, [2, 5, 6])):
        cache = hand_made(SnapKVCache, 1, 2, kernel)
        planted(cache, w)
        assert cache.kept() == [kept]
        planted(cache, [7])  # decode tokens are all kept
        assert cache.kept() == [kept + [7]]


# --- against scores computed independently ------------------------------------------------------
@pytest.mark.parametrize("heavy, recent", [(3, 4), (5, 0), (0, 3), (6, 2)])
def test_h2o_streamed_keeps_its_rule_and_is_a_full_model_masking_what_it_dropped(heavy, recent):
    """One token per pass, a batch of 2 (each row its own positions): after every pass, each
    layer holds its last `recent` positions and the `heavy` others that received the most
    attention; the logits are the plain pass's where each layer's query t sees what that layer
    held before t, and t."""
    B, T, budget = 2, 24, heavy + recent
    ids, cache = ids_of(B, T, seed=heavy), H2OCache.for_model(MODEL, heavy, recent, batch_size=B)
    held = []  # after each pass: (n_layer, B, T) booleans, what each layer holds
    logits = []
    for t in range(T):
        logits.append(run(MODEL, ids[:, t:t + 1], cache, 1))
        now = torch.zeros(MODEL.config.n_layer, B, T, dtype=torch.bool)
        for layer, p in enumerate(cache.positions):
            assert p.shape == (B, min(t + 1, budget)) and cache.keys[layer].shape[2] <= budget
            now[layer].scatter_(1, p, True)
        held.append(now)

    def sees(layer):  # query t: what was held after pass t - 1, and itself
        before = torch.stack([torch.zeros(B, T, dtype=torch.bool)]
                             + [h[layer] for h in held[:-1]], dim=1)   # (B, T, T)
        return (before | torch.eye(T, dtype=torch.bool)) & causal(T)
    want, weights = masked_pass(MODEL, ids, sees)
    torch.testing.assert_close(torch.cat(logits, dim=1), want)
    for layer, w in enumerate(weights):
        received = w.sum(dim=1).cumsum(dim=1)  # (B, T, T): after pass t, what key j received
        for t in range(budget, T):
            for row in range(B):
                have = (held[t - 1][layer, row].nonzero()[:, 0].tolist()) + [t]
                older, recent_ones = have[:len(have) - recent], have[len(have) - recent:]
                heavy_ones = sorted(older, key=lambda j: -received[row, t, j])[:heavy]
                assert cache_held(held[t], layer, row) == sorted(heavy_ones + recent_ones)


def cache_held(h: torch.Tensor, layer: int, row: int) -> list[int]:
    return h[layer, row].nonzero()[:, 0].tolist()


@pytest.mark.parametrize("pool", ["avg", "max"])
@pytest.mark.parametrize("kind", ["gpt2", "gqa"])
def test_snapkv_keeps_the_window_and_its_pooled_vote_then_every_decode_token(pool, kind):
    model, B, P, top, window, kernel = MODELS[kind], 2, 30, 6, 5, 3
    ids = ids_of(B, P + 4, seed=7)
    cache = SnapKVCache.for_model(model, top, window, kernel, pool, batch_size=B)
    logits = run(model, ids, cache, P)
    _, weights = masked_pass(model, ids[:, :P], lambda layer: causal(P))
    kept = []
    for layer, w in enumerate(weights):
        votes = w[:, :, P - window:, :P - window].sum(dim=(1, 2))  # (B, P - window)
        half = kernel // 2
        near = [votes[:, max(0, j - half):j + half + 1] for j in range(P - window)]
        pooled = torch.stack([n.sum(1) / kernel if pool == "avg" else n.amax(1) for n in near], 1)
        top_ones = pooled.topk(top, dim=1).indices.sort(dim=1).values.tolist()
        kept.append([sorted(r) + list(range(P - window, P + 4)) for r in top_ones])
        assert [cache.kept(row)[layer] for row in range(B)] == kept[-1]
    assert cache.keys[0].shape[2] == top + window + 4  # the budget, then every decode token

    def sees(layer):  # the prompt causal; a decode token sees what the layer kept, and itself
        mask = causal(P + 4).repeat(B, 1, 1)
        for row in range(B):
            mask[row, P:] = False
            mask[row, P:, kept[layer][row]] = True
        return mask & causal(P + 4)
    want, _ = masked_pass(model, ids, sees)
    torch.testing.assert_close(logits, want)


# --- what the caches refuse --------------------------------------------------------------------
@pytest.mark.parametrize("make, error, match", [
    (lambda: H2OCache.for_model(MODEL, -1, 4), ValueError, "heavy must be an int >= 0"),
    (lambda: H2OCache.for_model(MODEL, 2, True), ValueError, "recent must be an int >= 0"),
    (lambda: H2OCache.for_model(MODEL, 0, 0), ValueError, "budget must be a positive int"),
    (lambda: H2OCache.for_model(MODEL, 2, 2, batch_size=0), ValueError, "batch_size"),
    (lambda: SnapKVCache.for_model(MODEL, 4, 0), ValueError, "window must be a positive int"),
    (lambda: SnapKVCache.for_model(MODEL, 4, 2, kernel=4), ValueError, "kernel must be odd"),
    (lambda: SnapKVCache.for_model(MODEL, 4, 2, kernel=0), ValueError, "kernel must be a pos"),
    (lambda: SnapKVCache.for_model(MODEL, 4, 2, pool="mean"), ValueError, "pool must be one of"),
    (lambda: SnapKVCache.for_model(MODEL, 4.0, 2), ValueError, "top must be an int"),
    (lambda: H2OCache(2, 4, 16, 2, 2, block_size=16, dtype="float"), TypeError, "dtype"),
])
def test_bad_settings_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("cls", [H2OCache, SnapKVCache])
def test_misuse_is_refused_and_changes_nothing(cls):
    cache = cls.for_model(MODEL, 3, 3)
    ids = ids_of(1, 12)
    run(MODEL, ids, cache, 10)
    before = (cache.get_seq_length(), cache.kept(), [k.clone() for k in cache.keys])
    with pytest.raises(ValueError, match="attention=cache.attention"):  # the policy sees nothing
        MODEL(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match="cache=cache, attention=cache.attention"):
        MODEL(ids[:, :1], attention=cache.attention)
    with pytest.raises(ValueError, match="batch"):
        MODEL(ids.repeat(2, 1)[:, :1], cache=cache, attention=cache.attention)
    with pytest.raises(ValueError, match="block_size"):
        MODEL(ids_of(1, 250), cache=cache, attention=cache.attention)
    with pytest.raises(ValueError, match="row must be an int in"):
        cache.kept(1)
    assert (cache.get_seq_length(), cache.kept()) == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(cache.keys, before[2]))
    run(MODEL, ids[:, :1], cache, 1)  # and it goes on as if nothing had happened
    assert cache.get_seq_length() == 13


def test_a_failed_block_puts_the_cache_back_and_a_fork_goes_its_own_way():
    cache = H2OCache.for_model(MODEL, 2, 2)
    run(MODEL, ids_of(1, 8), cache, 8)
    twin, kept = cache.fork(), cache.kept()
    with pytest.raises(KeyboardInterrupt), cache.restored_on_error():
        run(MODEL, ids_of(1, 2, seed=1), cache, 1)
        raise KeyboardInterrupt
    assert cache.kept() == kept and cache.get_seq_length() == 8
    run(MODEL, ids_of(1, 3, seed=2), twin, 1)
    assert twin.get_seq_length() == 11 and cache.get_seq_length() == 8
    assert cache.nbytes == 2 * 2 * 4 * 4 * 16 * 8  # layers, K and V, heads, kept, head_dim, fp64
