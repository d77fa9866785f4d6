"""KVCache against a plain Python model of it, and the seed-003 byte arithmetic against real
tensors."""
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import minikv

N_LAYER, B, NH, HS, MAX_LEN = 2, 2, 3, 4, 12


def block(start: int, n: int, layer: int, sign: float) -> torch.Tensor:
    """(B, NH, n, HS) filled so every (layer, position, K-or-V) gets its own recognisable value."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    return (sign * (1000 * layer + pos + 1)).view(1, 1, n, 1).expand(B, NH, n, HS).clone()


class CacheMachine(RuleBasedStateMachine):
    """Random sequences of update / crop / fork / reset; a list of position ids is the reference."""

    def __init__(self):
        super().__init__()
        self.cache = minikv.KVCache(N_LAYER, B, NH, HS, MAX_LEN)
        self.model: list[int] = []  # which write produced each live position
        self.forks: list[tuple[minikv.KVCache, list[int]]] = []

    @rule(n=st.integers(1, 5))
    def update(self, n):
        start = len(self.model)
        if start + n > MAX_LEN:
            with pytest.raises(ValueError, match="overflow"):
                self.cache.update(block(start, n, 0, 1.0), block(start, n, 0, -1.0), 0)
            return
        for layer in range(N_LAYER):
            k, v = self.cache.update(block(start, n, layer, 1.0), block(start, n, layer, -1.0),
                                     layer)
            assert k.shape == (B, NH, start + n, HS)
        self.model.extend(range(start, start + n))

    @rule(data=st.data())
    def crop(self, data):
        n = data.draw(st.integers(-2, len(self.model) + 2))
        if 0 <= n <= len(self.model):
            self.cache.crop(n)
            del self.model[n:]
        else:
            with pytest.raises(ValueError, match="crop length must be an int in"):
                self.cache.crop(n)

    @precondition(lambda self: len(self.forks) < 3)
    @rule()
    def fork(self):
        self.forks.append((self.cache.fork(), list(self.model)))

    @rule()
    def reset(self):
        self.cache.reset()
        self.model.clear()

    @invariant()
    def matches_reference(self):
        for cache, model in [(self.cache, self.model)] + self.forks:
            assert cache.get_seq_length() == len(model)
            assert cache.layer_lengths == [len(model)] * N_LAYER
            for layer in range(N_LAYER):
                expected_k = (torch.cat([block(p, 1, layer, 1.0) for p in model], dim=2)
                              if model else None)
                live = cache.keys[layer][:, :, : len(model)]
                if model:
                    assert torch.equal(live, expected_k)
                    assert torch.equal(cache.values[layer][:, :, : len(model)], -expected_k)
            assert cache.nbytes == len(model) * N_LAYER * 2 * B * NH * HS * 4


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_fork_is_independent():
    cache = minikv.KVCache(1, 1, 1, 2, 8)
    cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    twin = cache.fork()
    twin.crop(1)
    twin.update(torch.full((1, 1, 2, 2), 7.0), torch.full((1, 1, 2, 2), 7.0), 0)
    assert cache.get_seq_length() == 3 and torch.equal(cache.keys[0][:, :, :3],
                                                       torch.ones(1, 1, 3, 2))
    assert twin.get_seq_length() == 3 and twin.keys[0][0, 0, 1, 0] == 7.0


def test_crop_keeps_stale_values_until_overwritten():
    """Rollback moves the length only; the widgets draw that stale region."""
    cache = minikv.KVCache(1, 1, 1, 1, 4)
    cache.update(torch.arange(4.0).view(1, 1, 4, 1), torch.zeros(1, 1, 4, 1), 0)
    cache.crop(2)
    assert cache.get_seq_length() == 2
    assert cache.keys[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_kv_cache_bytes_equals_real_tensor_bytes():
    for preset, dtype, seq_len, batch in [("tiny", torch.float32, 37, 1),
                                          ("small", torch.float16, 100, 3),
                                          ("tiny", torch.bfloat16, 1, 2)]:
        cfg = minikv.GPTConfig.preset(preset)
        model = minikv.GPT(cfg).to(dtype)
        cache = minikv.KVCache.for_model(model, batch_size=batch, max_len=seq_len + 5)
        with torch.no_grad():
            model(torch.zeros(batch, seq_len, dtype=torch.long), cache=cache)
        live = sum(t[:, :, :seq_len].nbytes for t in cache.keys + cache.values)
        assert cache.nbytes == live == minikv.kv_cache_bytes(cfg, seq_len, batch, dtype)
        assert cache.allocated_nbytes == minikv.kv_cache_bytes(cfg, seq_len + 5, batch, dtype)


def test_seed_003_gpt2_cache_size():
    """12 layers x 2 x 1 x 12 heads x 100 tokens x 64 x 2 bytes: the seed's "~3.5 MB" is 3.5 MiB."""
    n = minikv.kv_cache_bytes(minikv.GPTConfig.preset("gpt2"), seq_len=100, batch_size=1,
                              dtype=torch.float16)
    assert n == 12 * 2 * 1 * 12 * 100 * 64 * 2 == 3_686_400
    assert round(n / 1e6, 2) == 3.69 and round(n / 2**20, 2) == 3.52
    gqa = minikv.kv_cache_bytes(minikv.GPTConfig.preset("gpt2"), 100, dtype=torch.float16,
                                n_kv_head=4)
    assert gqa * 3 == n  # 12 query heads sharing 4 K/V heads store a third of the cache


def test_for_model_matches_model_shapes(tiny):
    cache = minikv.KVCache.for_model(tiny, batch_size=2)
    cfg = tiny.config
    assert (cache.n_layer, cache.batch_size, cache.n_head, cache.max_len, cache.head_dim) == \
        (cfg.n_layer, 2, cfg.n_head, cfg.block_size, cfg.head_dim)
    assert cache.dtype == tiny.dtype and cache.device == tiny.device
    assert "seq_len=0/256" in repr(cache)
