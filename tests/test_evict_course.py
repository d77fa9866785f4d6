"""Chapter 12's eviction measurements (course/eviction.py) and their picture (viz.draw.draw_kept):
the flip clauses found token by token, every policy at an equal budget, a budget past the
question giving the full cache's answers, and the picture drawing exactly what each layer kept."""
import matplotlib.colors as mcolors
import pytest

import minikv
from minikv.course import corpus
from minikv.course.eviction import (
    POLICIES,
    coverage,
    eviction_accuracy,
    flip_marks,
    kept_positions,
    make_cache,
)
from minikv.viz.draw import COLORS, draw_kept

from conftest import varied_model

TOK = minikv.load_tokenizer()
MODEL = varied_model(vocab_size=TOK.n_vocab)  # tiny, reading the course's tokens


def test_the_flip_clauses_are_found_token_by_token():
    q = corpus.CoinFlip("heads", (("Alice", True), ("Bob", False)))
    pieces = [TOK.decode([t]) for t in TOK.encode(q.prompt())]
    marks = flip_marks(q, TOK)
    assert [pieces[i] for i in marks.start] == [" heads"]
    assert [[pieces[i] for i in c] for c in marks.clauses] == [[" Alice", " flips"],
                                                                [" Bob", " doesn", "'t", " flip"]]
    assert [[pieces[i] for i in v] for v in marks.verbs] == [[" flips"], [" doesn", "'t", " flip"]]


def test_every_policy_keeps_its_budget_and_snapkv_its_observation_window():
    q = corpus.coin_flip_eval(1)[-1]  # 8 people: longer than the budget
    T = len(TOK.encode(q.prompt())) - 1  # read before the last token
    kept = kept_positions(MODEL, TOK, q, 16)
    assert kept["full"] == [list(range(T))] * MODEL.config.n_layer
    for policy in ("window", "h2o", "snapkv"):
        assert all(len(layer) == 16 and layer == sorted(set(layer)) for layer in kept[policy])
    assert kept["window"][0] == [0, 1, 2, 3] + list(range(T - 12, T))
    assert all(layer[-6:] == list(range(T - 6, T)) for layer in kept["snapkv"])
    assert coverage(kept["full"], flip_marks(q, TOK).verbs[0]) == 1.0


def test_a_budget_past_every_question_answers_as_the_full_cache():
    acc = eviction_accuracy(MODEL, TOK, budgets=(16, 200), n_per_count=2)
    assert set(acc) == {("full", None), *((p, b) for p in POLICIES[1:] for b in (16, 200))}
    assert all(list(a) == list(range(1, 9)) and all(0 <= x <= 1 for x in a.values())
               for a in acc.values())
    assert all(acc[p, 200] == acc["full", None] for p in POLICIES[1:])


def test_streamed_reading_leaves_snapkv_out():
    acc = eviction_accuracy(MODEL, TOK, budgets=(200,), policies=("full", "h2o"), streamed=True,
                            questions=corpus.coin_flip_eval(1)[:2])
    assert acc["h2o", 200] == acc["full", None]
    with pytest.raises(ValueError, match="streamed=False"):
        eviction_accuracy(MODEL, TOK, streamed=True)


@pytest.mark.parametrize("call, match", [
    (lambda: make_cache("lru", MODEL, 16), "policy must be one of"),
    (lambda: make_cache("h2o", MODEL, 4), "budget must be an int >= 5"),
    (lambda: make_cache("snapkv", MODEL, 6), "budget must be an int >= 7"),
    (lambda: make_cache("window", MODEL, 16, batch_size=2), "one row at a time"),
    (lambda: eviction_accuracy(MODEL, TOK, policies=("h2o", "lru")), "policy must be one of"),
])
def test_bad_settings_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_picture_draws_what_each_layer_kept_in_the_prompt_colour():
    q = corpus.CoinFlip("tails", (("Alice", True), ("Bob", False), ("Carol", True)))
    ids = TOK.encode(q.prompt())[:-1]
    kept = kept_positions(MODEL, TOK, q, 12)
    fig = draw_kept(kept, ids, TOK.decode, flip_marks(q, TOK))
    boxes = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid().startswith("kept:")}
    assert set(boxes) == {f"kept:{policy}:{layer}:{p}" for policy, held in kept.items()
                          for layer, positions in enumerate(held) for p in positions}
    assert {mcolors.to_hex(b.get_facecolor()) for b in boxes.values()} == {COLORS["prompt"]}
