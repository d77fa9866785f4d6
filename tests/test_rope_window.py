"""A sink-and-window cache on a rotary model, under its three numberings of positions (window.py):
"true" equals a full pass that masks the evicted positions, as on GPT-2; "reindex" (keys kept
unturned, turned by slot on every read) and "rerotate" (keys kept turned, turned back when the
window slides) equal each other and window_attention's re-indexed mask, and let the text run
past block_size; the numberings differ only where a sink is seen from a position it was not."""
import pytest
import torch

from minikv.engine.attention import window_attention
from minikv.engine.config import LLAMA
from minikv.engine.rope import rope_angles, rotate, turn
from minikv.engine.window import SinkWindowCache, feed

from conftest import varied_model

ROPE = varied_model("tiny", seed=3, std=0.2, n_kv_head=2, n_inner=176, block_size=64, **LLAMA)
IDS = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(0)).tolist()


def streamed(model, ids, cache) -> torch.Tensor:
    """Each token's logits, fed one token per pass, (T, vocab)."""
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([[t]]), cache=cache)[0, -1] for t in ids])


@pytest.mark.parametrize("sinks, window", [(0, 5), (2, 5), (4, 12), (1, 1)])
def test_each_numbering_equals_its_one_pass_mask(sinks, window):
    full = {}
    for rope in ("true", "reindex", "rerotate"):
        cache = SinkWindowCache.for_model(ROPE, sinks=sinks, window=window, rope=rope)
        full[rope] = streamed(ROPE, IDS, cache)
        assert len(cache.positions) == sinks + window
        assert cache.get_seq_length() == (len(IDS) if rope == "true" else sinks + window)
    with torch.inference_mode():
        plain = ROPE(torch.tensor([IDS]), attention=window_attention(sinks, window))[0]
        slots = ROPE(torch.tensor([IDS]), attention=window_attention(
            sinks, window, reindex_theta=ROPE.config.rope_theta))[0]
    assert (full["true"] - plain).abs().max() < 1e-4
    assert (full["reindex"] - slots).abs().max() < 1e-4
    assert (full["rerotate"] - full["reindex"]).abs().max() < 1e-4
    # before the first eviction the three are one cache; with no sink they stay one, since
    # every distance a window keeps is kept by both numberings
    first = sinks + window + 1
    assert (full["true"][:first] - full["reindex"][:first]).abs().max() < 1e-4
    differ = (full["true"][first:] - full["reindex"][first:]).abs().max()
    assert differ < 1e-4 if sinks == 0 else differ > 1e-2


def test_turning_composes_and_a_key_moves_without_its_input():
    k = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(1))
    at = torch.tensor([3, 7, 11, 20, 40])
    made = rotate(k, *rope_angles(at, 16, 500.0))
    moved = turn(made, torch.full((5,), -3), 500.0)
    assert (moved - rotate(k, *rope_angles(at - 3, 16, 500.0))).abs().max() < 1e-5
    q = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(2))
    # q.k depends on the distance only: both moved on by 100, the scores stay
    near = rotate(q, *rope_angles(torch.tensor([50]), 16, 500.0)) @ made.transpose(-1, -2)
    far = (rotate(q, *rope_angles(torch.tensor([150]), 16, 500.0))
           @ turn(made, torch.full((5,), 100), 500.0).transpose(-1, -2))
    assert (near - far).abs().max() < 1e-4


def test_slot_numbering_runs_past_block_size_and_true_positions_stop():
    ids = IDS + IDS  # 100 tokens through a model of block_size 64
    for rope in ("reindex", "rerotate"):
        cache = SinkWindowCache.for_model(ROPE, sinks=2, window=8, rope=rope)
        assert feed(ROPE, ids, cache).isfinite().all() and cache.get_seq_length() == 10
    cache = SinkWindowCache.for_model(ROPE, sinks=2, window=8)
    with pytest.raises(ValueError, match="rope='reindex'"):
        feed(ROPE, ids, cache)


def test_renumbering_is_refused_where_it_cannot_mean_anything():
    gpt2 = varied_model("tiny")
    with pytest.raises(ValueError, match="learned"):
        SinkWindowCache.for_model(gpt2, rope="reindex")
    with pytest.raises(ValueError, match="rope_theta"):
        SinkWindowCache(2, 4, 16, 2, 4, block_size=64, rope="rerotate")
    with pytest.raises(ValueError, match="rope must be one of"):
        SinkWindowCache.for_model(ROPE, rope="slots")
    # a slot-numbered cache of one theta, given a model of another (or a GPT-2): refused
    other = SinkWindowCache(2, 2, 16, 2, 4, block_size=64, rope="reindex", rope_theta=500.0)
    with pytest.raises(ValueError, match="rope_theta=500.0"):
        ROPE(torch.tensor([[1, 2]]), cache=other)
    assert other.get_seq_length() == 0 and other.positions == []
