"""Bad input raises a clear error naming the fix, and leaves the cache and the model as they were."""
import pytest
import torch

import minikv


@pytest.fixture
def setup(tiny):
    cache = minikv.KVCache.for_model(tiny, max_len=10)
    with torch.no_grad():
        tiny(torch.tensor([[1, 2, 3, 4]]), cache=cache)
    return tiny, cache


def snapshot(model, cache):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            cache.layer_lengths, [t.clone() for t in cache.keys + cache.values])


def assert_unchanged(before, model, cache):
    params, lengths, tensors = before
    assert cache.layer_lengths == lengths
    assert all(torch.equal(a, b) for a, b in zip(tensors, cache.keys + cache.values))
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())


FORWARD_CASES = [
    ("overflow", lambda m: torch.tensor([[1] * 7]), {}, ValueError, "overflow.*larger max_len"),
    ("float ids", lambda m: torch.tensor([[1.0, 2.0]]), {}, TypeError, "integer tensor"),
    ("list ids", lambda m: [[1, 2]], {}, TypeError, "integer tensor"),
    ("1-D ids", lambda m: torch.tensor([1, 2]), {}, ValueError, r"idx\[None\]"),
    ("empty", lambda m: torch.zeros(1, 0, dtype=torch.long), {}, ValueError, "T >= 1"),
    ("out of vocab", lambda m: torch.tensor([[1, 512]]), {}, ValueError, "outside the vocabulary"),
    ("negative id", lambda m: torch.tensor([[-1]]), {}, ValueError, "outside the vocabulary"),
    ("batch mismatch", lambda m: torch.tensor([[1], [2]]), {}, ValueError, "batch_size=2"),
    ("bad positions", lambda m: torch.tensor([[1]]), {"positions": torch.tensor([0, 1])}, ValueError, "positions"),
]


@pytest.mark.parametrize("name, idx, kwargs, error, message", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects_bad_input_without_touching_the_cache(setup, name, idx, kwargs, error, message):
    model, cache = setup
    before = snapshot(model, cache)
    with pytest.raises(error, match=message), torch.no_grad():
        model(idx(model), cache=cache, **kwargs)
    assert_unchanged(before, model, cache)


@pytest.mark.parametrize("make_cache, message", [
    (lambda m: minikv.KVCache(2, 1, 4, 16, 10, dtype=torch.float64), "float64"),
    (lambda m: minikv.KVCache(2, 1, 4, 16, 10, device="meta"), "meta"),
    (lambda m: minikv.KVCache(3, 1, 4, 16, 10), r"n_layer, n_head, head_dim"),
    (lambda m: "not a cache", "must be a minikv.KVCache"),
])
def test_forward_rejects_incompatible_cache(tiny, make_cache, message):
    cache = make_cache(tiny)
    with pytest.raises((ValueError, TypeError), match=message), torch.no_grad():
        tiny(torch.tensor([[1, 2]]), cache=cache)
    if isinstance(cache, minikv.KVCache):
        assert cache.get_seq_length() == 0


def test_prompt_longer_than_context(tiny):
    with pytest.raises(ValueError, match="block_size=256"):
        tiny(torch.ones(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match="lower max_new_tokens or shorten the prompt"):
        minikv.generate(tiny, [1] * 250, 10)


@pytest.mark.parametrize("bad", [-1, 5, 2.0, True])
def test_crop_out_of_range(setup, bad):
    model, cache = setup
    before = snapshot(model, cache)
    with pytest.raises((ValueError, TypeError), match="crop"):
        cache.crop(bad)
    assert_unchanged(before, model, cache)


GENERATE_CASES = [
    ("empty prompt", dict(ids=[]), ValueError, "prompt is empty"),
    ("text prompt", dict(ids="The color of dog"), TypeError, "encode it first"),
    ("float ids", dict(ids=[1.5, 2.0]), TypeError, "must be ints"),
    ("float tensor", dict(ids=torch.tensor([1.0])), TypeError, "dtype=torch.long"),
    ("batch of prompts", dict(ids=torch.ones(2, 3, dtype=torch.long)), ValueError, "one sequence at a time"),
    ("out of vocab", dict(ids=[1, 9999]), ValueError, "model's own tokenizer"),
    ("negative temperature", dict(temperature=-0.5), ValueError, "temperature must be"),
    ("nan temperature", dict(temperature=float("nan")), ValueError, "temperature must be"),
    ("zero top_k", dict(top_k=0), ValueError, "top_k must be"),
    ("unknown mode", dict(mode="paged"), ValueError, "mode must be one of .'naive', 'cached'., got 'paged'"),
    ("negative max_new_tokens", dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    ("eos out of vocab", dict(eos_id=600), ValueError, "eos_id"),
    ("cache too short", dict(max_new_tokens=6), ValueError, "the cache 10: use a larger cache"),
    ("naive with cache", dict(mode="naive"), ValueError, "only applies to mode='cached'"),
]


@pytest.mark.parametrize("name, override, error, message", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_rejects_bad_input_without_side_effects(setup, name, override, error, message):
    model, cache = setup
    before = snapshot(model, cache)
    args = dict(ids=[5, 6], max_new_tokens=2, cache=cache) | override
    with pytest.raises(error, match=message):
        minikv.generate(model, **args)
    assert_unchanged(before, model, cache)


def test_cache_constructor_validation(tiny):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        minikv.KVCache.for_model(tiny, batch_size=0)
    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, 257\)"):
        minikv.KVCache.for_model(tiny, max_len=10_000)


def test_unknown_device():
    with pytest.raises(ValueError, match="unknown device"):
        minikv.resolve_device("tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            minikv.resolve_device("cuda")
