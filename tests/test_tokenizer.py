import hashlib
import socket
import time

import pytest
import tiktoken.load
from hypothesis import given
from hypothesis import strategies as st

from minikv import __main__ as cli
from minikv.course import tokenizer
from minikv.course.corpus import EOT, NAMES


@pytest.fixture(scope="module")
def enc():
    return tokenizer.load_tokenizer()


def pieces(enc, text: str) -> list[str]:
    return [enc.decode([t]) for t in enc.encode(text)]


SEED_TOKENS = [
    ("Once upon a", ["Once", " upon", " a"]),
    ("The color of dog", ["The", " color", " of", " dog"]),
    *[(w, [w]) for w in (" heads", " tails", " can", " vary", " widely")],
    *[(" " + name, [" " + name]) for name in NAMES],
]


@pytest.mark.parametrize("text,expected", SEED_TOKENS)
def test_seed_tokens(enc, text, expected):
    assert pieces(enc, text) == expected


@given(st.text())
def test_round_trip(enc, text):
    assert enc.decode(enc.encode(text)) == text


@given(st.text(), st.text())
def test_round_trip_with_eot(enc, before, after):
    text = before + EOT + after
    ids = enc.encode(text, allowed_special={EOT})
    assert enc.eot_token in ids
    assert enc.decode(ids) == text


def test_eot_is_last_id(enc):
    assert enc.n_vocab == tokenizer.VOCAB_SIZE
    assert enc.encode(EOT, allowed_special="all") == [enc.eot_token] == [enc.n_vocab - 1]
    assert enc.max_token_value == enc.n_vocab - 1


def test_shipped_file_hash_and_ranks():
    assert hashlib.sha256(tokenizer.RANKS_PATH.read_bytes()).hexdigest() == tokenizer.RANKS_SHA256
    ranks = tokenizer.load_ranks()
    assert sorted(ranks.values()) == list(range(tokenizer.VOCAB_SIZE - 1))
    assert all(ranks[bytes([b])] == b for b in range(256))


def test_tampered_ranks_fail_to_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))  # no stale copy can answer
    good, bad = tmp_path / "good.tiktoken", tmp_path / "bad.tiktoken"
    data = tokenizer.RANKS_PATH.read_bytes()
    good.write_bytes(data)
    lines = data.splitlines(keepends=True)
    lines[300], lines[301] = lines[301].split()[0] + b" 300\n", lines[300].split()[0] + b" 301\n"
    bad.write_bytes(b"".join(lines))
    assert tokenizer.load_ranks(good) == tokenizer.load_ranks()
    with pytest.raises(ValueError, match="does not match RANKS_SHA256"):
        tokenizer.load_ranks(bad)


def test_unknown_name():
    with pytest.raises(ValueError, match="'course', 'gpt2'"):
        tokenizer.load_tokenizer("nope")


@pytest.mark.parametrize("cache", ["empty", "disabled", "corrupt"])
def test_gpt2_without_cache_fails_fast_offline(tmp_path, monkeypatch, cache):
    def no_network(*args, **kwargs):
        raise AssertionError("load_tokenizer('gpt2') tried to download")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "" if cache == "disabled" else str(tmp_path))
    # right names, wrong contents: tiktoken would delete and re-download them
    if cache == "corrupt":
        for url in tokenizer.GPT2_FILES:
            (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_text("not gpt2")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="TIKTOKEN_CACHE_DIR"):
        tokenizer.load_tokenizer("gpt2")
    assert time.perf_counter() - t0 < 2


@pytest.mark.skipif(not tokenizer._gpt2_is_cached(), reason="GPT-2's vocabulary is not cached here")
def test_gpt2_from_cache():
    assert tokenizer.load_tokenizer("gpt2").n_vocab == 50257


def test_train_bpe_merges_most_frequent_pair_first():
    ranks = tokenizer.train_bpe("hug hug hug pug", 258)
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert ranks[b"ug"] == 256 and ranks[b"hug"] == 257  # "ug" occurs 4 times, then "hug" 3 times
    assert tokenizer.train_bpe("ab cd", 257)[b" c"] == 256  # a tie goes to the smallest pair


def test_train_bpe_never_merges_across_eot():
    ranks = tokenizer.train_bpe("ab" + EOT + "ab", 257)
    assert max(ranks, key=ranks.get) == b"ab"
    with pytest.raises(ValueError, match="text too small"):
        tokenizer.train_bpe("ab" + EOT + "ab", 258)


def test_check_retrains_the_shipped_file(capsys):
    assert cli.main(["tokenizer", "--check"]) == 0
    assert "OK" in capsys.readouterr().out
