"""Chapter 12's checkers accept the solutions (and other right ways), let a stub's
NotImplementedError through, and reject every plausible wrong answer with a hint that names the
mistake: the mistakes a checker writes itself (DECODE_MISTAKES, H2O_MISTAKES, the bytes', the
design's) are fed to it from its own data, the rest are listed here."""
import math

import pytest
import torch
import torch.nn.functional as F

from minikv.course.checks import ch12
from minikv.engine import H2OCache
from minikv.engine.model import LatentAttention

from conftest import assert_mistake_named, assert_right_ways_pass, checker_id, stub

DECODE, BYTES, H2O, CHOOSE = (ch12.check_absorbed_decode, ch12.check_predict_bytes_per_token,
                              ch12.check_heavy_hitters, ch12.check_choose_cache)


# --- right answers -------------------------------------------------------------------------------
def absorbed_decode(q, latent, w_uk, w_uv):
    c = latent.unsqueeze(1)                                          # (B, 1, L, dc)
    weights = torch.softmax((q @ w_uk) @ c.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return (weights @ c) @ w_uv.transpose(1, 2)                      # (B, nh, 1, hs)


def absorbed_einsum(q, latent, w_uk, w_uv):  # also right: einsum, the scale on the query
    q_lat = torch.einsum("bhqk,hkd->bhqd", q / math.sqrt(q.size(-1)), w_uk)
    weights = torch.einsum("bhqd,bld->bhql", q_lat, latent).softmax(-1)
    return torch.einsum("bhql,bld,hkd->bhqk", weights, latent, w_uv)


def absorbed_sdpa(q, latent, w_uk, w_uv):  # also right: PyTorch's kernel, told the scale
    c = latent[:, None]
    out = F.scaled_dot_product_attention(q @ w_uk, c, c, scale=1 / math.sqrt(q.size(-1)))
    return out @ w_uv.transpose(1, 2)


def predict_bytes_per_token():
    return {"deepseek_v3": 61 * (512 + 64) * 2, "deepseek_v3_mha": 61 * 128 * (192 + 128) * 2,
            "ours": 12 * (96 + 12) * 2}


class H2OCacheFixed(ch12.BuggyH2OCache):
    def _record(self, weights):
        return weights.sum(dim=(1, 2))


class H2OMeanOverHeads(ch12.BuggyH2OCache):  # also right: a constant factor ranks alike
    def _record(self, weights):
        return weights.sum(dim=2).mean(dim=1)


def cache_table():
    return dict(ch12.reference_table())


def choose_cache(budget, table):
    fits = {o: v for o, v in table.items() if v[0] <= budget}
    return max(fits, key=lambda o: (fits[o][1], -fits[o][0])) if fits else None


def choose_sorted(budget, table):  # also right: sorted by bytes, the first best kept
    best = None
    for option, (nbytes, acc) in sorted(table.items(), key=lambda kv: kv[1][0]):
        if nbytes <= budget and (best is None or acc > table[best][1]):
            best = option
    return best


# --- wrong answers -------------------------------------------------------------------------------
def naive_keys(q, latent, w_uk, w_uv):  # right values, but the cache expanded to keys
    keys = latent[:, None] @ w_uk.transpose(1, 2)
    weights = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return (weights @ latent[:, None]) @ w_uv.transpose(1, 2)


def values_first(q, latent, w_uk, w_uv):  # W_UV before the weighting: every value built
    c = latent[:, None]
    weights = torch.softmax((q @ w_uk) @ c.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return weights @ (c @ w_uv.transpose(1, 2))


def flat_keys(q, latent, w_uk, w_uv):  # the heads' keys side by side: (B, L, nh * hs)
    B, nh, _, hs = q.shape
    keys = (latent @ w_uk.reshape(nh * hs, -1).T).view(B, -1, nh, hs).transpose(1, 2)
    weights = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(hs), dim=-1)
    return (weights @ latent[:, None]) @ w_uv.transpose(1, 2)


def calls_the_engine(q, latent, w_uk, w_uv):  # the engine's layer, however it is reached
    try:
        LatentAttention.forward(None, q, None, 0, None)
    except Exception:  # noqa: BLE001 - called with nothing sensible: only the call matters
        pass
    return absorbed_decode(q, latent, w_uk, w_uv)


def _wrong_class(name, base=ch12.BuggyH2OCache, **methods):
    return type(name, (base,), methods)


class EngineRecord(ch12.BuggyH2OCache):  # delegates to the engine's H2O
    score_dtype = torch.float32

    def _record(self, weights):
        return H2OCache._record(self, weights)


class HalvesValues(H2OCacheFixed):  # the kept positions right, what the last layer reads wrong
    def update(self, key, value, layer_idx):
        k, v = super().update(key, value, layer_idx)
        return k, v * (0.5 if layer_idx == self.n_layer - 1 else 1.0)


def _table_with(column=None, **changes):
    """A cache_table that returns the reference table, its bytes replaced by `column` (a
    function of nothing, giving {option: bytes}) and entries by `changes` (functions of the
    reference entry), all computed when the checker calls it."""
    def cache_table():
        table = dict(ch12.reference_table())
        if column:
            table = {o: (column()[o], a) for o, (b, a) in table.items()}
        for option, change in changes.items():
            option = option.replace("_", " ").replace("target ", "target-")
            table[option] = change(table[option])
        return table
    return cache_table


CHOOSE_FRAGMENTS = {"over_budget": "over the budget", "smallest": "the fewest bytes",
                    "strict": "exactly the budget fits", "none_fits": "no option fits",
                    "tie": "break a tie"}
WRONG = {  # checker -> (the learner's function(s), a fragment of the hint)
    DECODE: [(naive_keys, "you built keys or values for every cached position"),
             (values_first, "not to every position before it"),
             (flat_keys, "you built keys or values"),
             (lambda q, c, k, v: absorbed_decode(q, c, k.transpose(1, 2), v),
              "a product's shapes do not meet"),
             (lambda q, c, k, v: absorbed_decode(q.div_(2.0), c, k, v), "compute on new tensors"),
             (lambda *a: absorbed_decode(*a).numpy(), "one torch tensor"),
             (lambda *a: None, "did you forget to return it"),
             (lambda *a: absorbed_decode(*(t.double() for t in a)), "compute in q's dtype"),
             (calls_the_engine, "called minikv's own minikv.engine.model.LatentAttention.forward")
             ] + [
            (wrong, hint) for hint, wrong in ch12.DECODE_MISTAKES.items()],
    BYTES: [(lambda: {**predict_bytes_per_token(), "ours": 2592.0}, "an int"),
            (lambda: (70272, 4997120, 2592), "a dict with the keys"),
            (lambda: {**predict_bytes_per_token(), "ours": ch12.measure_per_token.__wrapped__()[
                "ours"]}, "a prediction is made before the measurement")] + [
            (lambda key=key, w=w: {**predict_bytes_per_token(), key: w}, hint)
            for key in ch12.BYTE_KEYS for w, hint in ch12._byte_mistakes(key)],
    H2O: [(ch12.BuggyH2OCache, "BuggyH2OCache unchanged"),
          (_wrong_class("OverHeadsOnly", _record=lambda self, w: w.sum(dim=2)),
           "your _record returned (1, 4, 5)"),
          (EngineRecord, "called minikv's own minikv.engine.evict.H2OCache._record"),
          (HalvesValues, "the logits differ"),
          (H2OCache.for_model, "pass the class itself")] + [
         (wrong, hint) for hint, wrong in ch12.H2O_MISTAKES.items()],
    CHOOSE: [((lambda: None, choose_cache), "did you forget"),
             ((lambda: {o: v for o, v in list(ch12.reference_table().items())[:5]}, choose_cache),
              "one entry per option"),
             ((lambda: {o: (b, 100 * a) for o, (b, a) in ch12.reference_table().items()},
               choose_cache), "not a percentage"),
             ((lambda: {o: (float(b), a) for o, (b, a) in ch12.reference_table().items()},
               choose_cache), "an int and a fraction"),
             ((_table_with(target_mla=lambda e: (e[0], e[1] - 0.1)), choose_cache),
              "read every question as section 5 does"),
             ((_table_with(target_mla=lambda e: (12345, e[1])), choose_cache),
              "measure each option's"),
             ((cache_table, lambda b, t: (choose_cache(b, t),)), "return one of the option")] + [
            ((_table_with(lambda key=key: ch12._bytes_mistakes()[ch12.C[key]]), choose_cache),
             ch12.C[key]) for key in ch12.BYTES_MISTAKES] + [
            ((cache_table, wrong), CHOOSE_FRAGMENTS[key])
            for key, wrong in ch12.CHOOSE_MISTAKES.items()],
}
RIGHT = {DECODE: [(absorbed_decode,), (absorbed_einsum,), (absorbed_sdpa,)],
         BYTES: [(predict_bytes_per_token,)],
         H2O: [(H2OCacheFixed,), (H2OMeanOverHeads,)],
         CHOOSE: [(cache_table, choose_cache), (cache_table, choose_sorted)]}
STUBS = {H2O: [(type("Stub", (ch12.BuggyH2OCache,), {"_record": stub}),)],
         CHOOSE: [(stub, choose_cache), (cache_table, stub)]}


@pytest.mark.parametrize("checker", RIGHT, ids=checker_id)
def test_right_ways_pass_leaving_the_random_state_and_a_stub_goes_through(checker, capsys):
    assert_right_ways_pass(checker, RIGHT[checker], STUBS.get(checker, [(stub,)]), capsys)


@pytest.mark.parametrize("checker, wrong, fragment",
                         [(c, w, f) for c, ws in WRONG.items() for w, f in ws], ids=checker_id)
def test_every_mistake_is_named(checker, wrong, fragment):
    assert_mistake_named(checker, wrong, fragment)


# --- the checkers' cases are sound ----------------------------------------------------------------

def test_the_decode_cases_tell_expansion_from_the_absorbed_form():
    """No tensor of the absorbed form has L positions and a head's width; the naive form's
    keys do, in every case with more than one latent."""
    for B, nh, hs, dc, L in ch12.DECODE_SHAPES:
        assert hs != dc and L not in (hs, nh * hs, dc, nh, B) or L == 1
    q, latent, w_uk, w_uv = ch12.mla_decode_inputs()
    assert latent.size(1) not in (q.size(-1), q.size(1) * q.size(-1), latent.size(2))
    mine = ch12.watched(latent, q.size(1), q.size(-1))
    absorbed_decode(q, mine, w_uk, w_uv)
    assert type(mine).seen == []
    naive_keys(q, mine, w_uk, w_uv)
    assert type(mine).seen


def test_the_naive_reference_is_what_the_engine_decodes():
    """The reference (naive_decode) on the shipped target-mla's real inputs equals the engine's
    own decode step, read at the layer's output projection."""
    import minikv
    model, tok = minikv.load_course_model("target-mla", "cpu")
    ids = ch12._question_ids(tok)
    attn, seen = model.transformer.h[ch12.DECODE_LAYER].attn, {}
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(out=out))
    cache = minikv.KVCache.for_model(model, max_len=len(ids))
    with torch.no_grad():
        model(torch.tensor([ids[:-1]]), cache=cache)
        model(torch.tensor([ids[-1:]]), cache=cache)   # one token: the absorbed form
        handle.remove()
        y = ch12.naive_decode(*ch12.mla_decode_inputs()).float()
        out = attn.c_proj(y.transpose(1, 2).reshape(1, 1, -1))
    torch.testing.assert_close(out, seen["out"], atol=1e-5, rtol=0)


def test_the_bytes_are_the_formulas():
    m = ch12.measure_per_token()
    assert m == {"deepseek_v3": 70_272, "deepseek_v3_mha": 4_997_120, "ours": 2_592}
    for key in ch12.BYTE_KEYS:  # every usual mistake is a wrong answer
        assert all(w != m[key] for w, _ in ch12._byte_mistakes(key))


def test_the_buggy_cache_is_silent_and_keeps_other_positions():
    """The bug raises nothing, agrees with H2O until the first eviction, then keeps other
    positions than H2O's, in every case."""
    torch.set_num_threads(1)
    for what, which, heavy, recent, n, how in ch12.H2O_CASES:
        model, tok = ch12._h2o_model(which)
        ids = ch12._question_ids(tok) if tok else list(range(3, 3 + n))
        with torch.no_grad():
            buggy = ch12._h2o_run(model, ch12.BuggyH2OCache(model, heavy, recent), ids, how)
            engine = ch12._h2o_run(model, H2OCache.for_model(model, heavy, recent), ids, how)
        assert [k for _, k in buggy] != [k for _, k in engine], what


def test_the_design_budgets_tell_the_choices_apart():
    for table in (ch12.reference_table(), ch12.SYNTHETIC):
        budgets = ch12._design_budgets(table)
        for key, wrong in ch12.CHOOSE_MISTAKES.items():
            assert any(wrong(b, table) != ch12.best_choice(b, table) for b in budgets), key
        assert ch12.best_choice(min(budgets), table) is None
