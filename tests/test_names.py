"""Names the course models never saw (issue 14): a seeded generator of many languages and kinds,
train and test names sharing no word, and held-out questions made of test names only."""
import random

import torch

import minikv
from minikv.course import corpus, names
from minikv.course.evaluate import NEXT_KINDS, coin_flip_accuracy, multi_token, next_token_kinds


def draw(split: str, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [names.random_name(rng, split, corpus.vocabulary()) for _ in range(n)]


def content_words(name: str) -> set[str]:
    return {names.key(w) for w in names.words(name)} - names.CONNECTORS


def test_train_and_test_names_share_no_word():
    train = set().union(*map(content_words, draw("train", 3000)))
    test = [content_words(n) for n in draw("test", 1000)]
    assert all(words and not words & train for words in test)
    assert all(names.word_split(w, corpus.vocabulary()) == "test" for ws in test for w in ws)


def test_names_are_seeded_varied_and_mostly_several_tokens():
    first = draw("test", 300, seed=7)
    assert first == draw("test", 300, seed=7) and first != draw("test", 300, seed=8)
    assert len(set(first)) > 250  # varied: few repeats
    tok = minikv.load_tokenizer()
    several = sum(map(multi_token(tok), first)) / len(first)
    assert several > 0.8, f"only {several:.0%} of test names are several tokens"
    scripts = {"latin": any(n.isascii() for n in first),
               "other": any(not n.isascii() for n in first)}
    assert all(scripts.values())
    assert any(n.startswith(("the ", "my ", "our ", "your ")) for n in draw("test", 2000))


def test_no_name_uses_a_word_of_the_question_or_of_the_corpora():
    for name in draw("test", 2000) + draw("train", 2000):
        ws = {names.key(w) for w in names.words(name)}
        assert not ws & names.QUESTION_WORDS, name
    for name in draw("test", 2000):
        assert not content_words(name) & corpus.vocabulary(), name


def test_unseen_questions_are_held_out_and_well_formed():
    questions = corpus.unseen_coin_flips(5)
    assert [len(q.steps) for q in questions] == [n for n in range(1, 9) for _ in range(5)]
    assert questions == corpus.unseen_coin_flips(5)  # seeded
    for q in questions:
        assert len({p.casefold() for p, _ in q.steps}) == len(q.steps)  # nobody twice
        assert q.prompt().startswith(f"A coin's state is {q.start}. ")
        assert q.prompt().endswith(". What's the state? A:")
        for person, _ in q.steps:
            assert content_words(person) and not content_words(person) & corpus.vocabulary()


def test_a_name_opening_the_sentence_is_capitalized():
    q = corpus.CoinFlip("heads", (("the teacher", True), ("my neighbor", False)))
    assert q.prompt() == ("A coin's state is heads. The teacher flips, then my neighbor doesn't "
                          "flip. What's the state? A:")


def test_the_target_tracks_the_coin_for_names_it_never_saw():
    # the target shipped before issue 14 (40 one-token training names): 90 100 80 70 60 40 40 60%
    model, tok = minikv.load_course_model("target", device="cpu")
    questions = corpus.unseen_coin_flips(10, seed=3)
    with torch.no_grad():
        accuracy = coin_flip_accuracy(model, tok, questions=questions)
    assert min(accuracy[n] for n in range(1, 7)) >= 0.9, accuracy
    assert min(accuracy[n] for n in range(7, 9)) >= 0.8, accuracy


def test_prompt_positions_are_told_apart_by_what_comes_next():
    """evaluate's breakdown of draft agreement: which next tokens are a name's, which are the
    coin's flip or not; by bytes, so a name whose characters span tokens is still all name."""
    tok = minikv.load_tokenizer()
    q = corpus.CoinFlip("heads", (("the teacher", True), ("马玉杰", False), ("Siobhán", True)))
    ids = tok.encode(q.prompt())
    kinds = next_token_kinds(q, tok)
    assert len(kinds) == len(ids) - 1 and set(kinds) <= set(NEXT_KINDS)
    pieces = [tok.decode_bytes([t]) for t in ids[1:]]
    name_bytes = b"".join(p for p, k in zip(pieces, kinds) if k == NEXT_KINDS[0])
    assert name_bytes.replace(b" ", b"") == "Theteacher马玉杰Siobhán".encode()
    verbs = [tok.decode([t]) for t, k in zip(ids[1:], kinds) if k == NEXT_KINDS[1]]
    assert verbs == [" flips", " doesn", " flips"]  # one per person: its clause's first word
