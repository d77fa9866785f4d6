import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minikv.course import corpus
from minikv.course.corpus import EOT, MAX_PEOPLE, NAMES, STATES, CoinFlip
from minikv.course.tokenizer import load_tokenizer

SMALL = (300, 30, 30)

coin_flips = st.builds(
    CoinFlip,
    st.sampled_from(STATES),
    st.lists(st.tuples(st.sampled_from(NAMES), st.booleans()),
             min_size=1, max_size=MAX_PEOPLE).map(tuple),
)


def docs(text: str) -> list[str]:
    assert text.endswith(EOT)
    return text.split(EOT)[:-1]


@pytest.fixture(scope="module")
def default_splits():
    return {name: corpus.splits(name) for name in corpus.CORPORA}


def test_seed_000_surface_form():
    q = CoinFlip("heads", (("Alice", True), ("Bob", True)))
    assert q.text() == ("A coin's state is heads. Alice flips, then Bob flips. "
                        "What's the state? A: heads.")
    assert q.prompt() == q.text().removesuffix(" heads.")
    assert q.states == ["heads", "tails", "heads"]
    assert q.question(1) == "A coin's state is heads. Alice flips. What's the state? A:"
    assert q.question(0) == "A coin's state is heads. What's the state? A:"
    assert q.text(cot=True) == (
        "A coin's state is heads. Alice flips, so it's tails, then Bob flips, so it's heads. "
        "What's the state? A: heads."
    )
    assert CoinFlip("tails", (("Carol", False),)).text() == (
        "A coin's state is tails. Carol doesn't flip. What's the state? A: tails."
    )


@given(coin_flips)
def test_coin_flip_states(q):
    flips = [f for _, f in q.steps]
    for i in range(len(q.steps) + 1):
        assert q.states[i] == STATES[(STATES.index(q.start) + sum(flips[:i])) % 2]
    assert q.answer == q.states[-1]
    assert q.question(len(q.steps)) == q.prompt()
    assert q.text() == f"{q.prompt()} {q.answer}."


@pytest.fixture(scope="module")
def enc():
    return load_tokenizer()


@given(coin_flips, st.booleans())
def test_step_prefix_is_a_token_prefix_of_the_prompt(enc, q, cot):
    # what lets a notebook crop a cache filled with the prompt at person i and ask question(i)
    full = enc.encode(q.prompt(cot))
    for i in range(len(q.steps) + 1):
        ids = enc.encode(q.prefix(i, cot))
        assert full[: len(ids)] == ids
        assert enc.decode(ids + enc.encode(". What's the state? A:")) == q.question(i, cot)


def test_answer_tokens_are_single_tokens(enc):
    q = CoinFlip("heads", (("Alice", True),))
    assert enc.encode(q.text())[-2:] == enc.encode(" tails.")
    assert [len(enc.encode(" " + s)) for s in STATES] == [1, 1]


def test_coin_flip_documents_are_correct():
    for doc in docs("".join(corpus.splits("coinflip", seed=1, sizes=SMALL).values())):
        state = re.match(r"A coin's state is (heads|tails)\. ", doc)[1]
        for action, said in re.findall(r" (flips|doesn't flip)(?:, so it's (\w+))?", doc):
            state = STATES[1 - STATES.index(state)] if action == "flips" else state
            assert said in ("", state)
        assert doc.endswith(f"What's the state? A: {state}.")


@pytest.mark.parametrize("name", corpus.CORPORA)
def test_splits_are_seeded(name):
    a, b, c = (corpus.splits(name, seed=s, sizes=SMALL) for s in (0, 0, 1))
    assert a == b
    assert a != c
    assert [len(docs(a[split])) for split in ("train", "val", "test")] == list(SMALL)


@pytest.mark.parametrize("name", corpus.CORPORA)
def test_no_train_document_is_held_out(default_splits, name):
    train = set(docs(default_splits[name]["train"]))
    for split in ("val", "test"):
        assert not train & set(docs(default_splits[name][split]))


def test_coin_flip_eval_is_held_out(default_splits):
    questions = corpus.coin_flip_eval(20, seed=3)
    assert [len(q.steps) for q in questions] == [n for n in range(1, MAX_PEOPLE + 1)
                                                 for _ in range(20)]
    train = set(docs(default_splits["coinflip"]["train"]))
    assert not train & {q.text(cot) for q in questions for cot in (False, True)}
    assert questions == corpus.coin_flip_eval(20, seed=3)


def test_seed_sentences_occur_naturally(default_splits):
    assert "The color of dog can vary widely." in docs(default_splits["facts"]["train"])
    assert all(d.startswith("Once upon a time there was")
               for d in docs(default_splits["stories"]["train"]))


def test_corpora_are_not_a_lookup(default_splits):
    for name in ("facts", "stories"):
        sentences = set(re.split(r"(?<=\.) ", default_splits[name]["train"].replace(EOT, " ")))
        assert len(sentences) > 2000


def test_unknown_corpus():
    with pytest.raises(ValueError, match="coinflip"):
        corpus.random_document("nope", random.Random(0))
