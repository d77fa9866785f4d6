"""The course tokenizer: a byte-level BPE trained on minikv's own corpora, served as a
tiktoken.Encoding.

Why our own: GPT-2's 50257 ids would make a course model's embedding dwarf the rest of it, and
tiktoken.get_encoding("gpt2") downloads its vocabulary, which the course never does at run time.

VOCAB_SIZE = 1024 ids: 0..255 are the bytes (so any text round-trips), 256..1022 are merges, EOT
is 1023, the last id. 1024 is the smallest power of two at which plain merge frequency makes every
word the seeds need one token ("Once| upon| a", "The| color| of| dog", " heads", " tails", " can",
" vary", " widely", each coin-flip name: the last of them is rank 560). The corpus allows ~1180
merges, so ~90 rare words stay split into sub-words, which is what BPE looks like.

    python -m minikv tokenizer --train   # retrain; rewrite course/assets/course.tiktoken
    python -m minikv tokenizer --check   # retrain in memory; confirm it equals the shipped file
"""

import argparse
import base64
import hashlib
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import regex
import tiktoken

from . import corpus
from .corpus import EOT
from .files import read_at_most, write_atomically

# GPT-2's pre-split: merges never cross these pieces (words with their leading space, numbers, ...)
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
VOCAB_SIZE = 1024
TRAIN_SEED = 0
RANKS_PATH = Path(__file__).parent / "assets" / "course.tiktoken"
RANKS_SHA256 = "ead9ff4419322400f8aade9971793b5028b7621b13e6d4311a6d6785160d03f9"
MAX_RANKS_BYTES = 1 << 20  # the shipped file is ~12 KB: a bigger one is refused unread
# The files tiktoken_ext/openai_public.py:gpt2() reads, cached by tiktoken as <cache dir>/sha1(url)
GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe":
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json":
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def train_bpe(text: str, vocab_size: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: 0..255 are the bytes, then one rank per merge of the most frequent
    adjacent pair (ties: the smallest pair) until there are vocab_size ranks."""
    # split out EOT and pre-split exactly as tiktoken encodes, then work on unique pieces only
    pieces = Counter(p for doc in text.split(EOT) for p in regex.findall(PAT_STR, doc))
    words = [[bytes([b]) for b in piece.encode()] for piece in pieces]
    counts = list(pieces.values())
    ranks = {bytes([i]): i for i in range(256)}
    while len(ranks) < vocab_size:
        stats: Counter[tuple[bytes, bytes]] = Counter()
        for word, n in zip(words, counts):
            for pair in zip(word, word[1:]):
                stats[pair] += n
        if not stats:
            raise ValueError(f"text too small: every piece is one token at {len(ranks)} < "
                             f"{vocab_size} ranks")
        best = min(stats, key=lambda pair: (-stats[pair], pair))
        token = best[0] + best[1]
        ranks[token] = len(ranks)
        words = [_merge(word, best, token) for word in words]
    return ranks


def _merge(word: list[bytes], pair: tuple[bytes, bytes], token: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(token)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def course_ranks() -> dict[bytes, int]:
    """Retrain the shipped ranks: the train splits of all course corpora at TRAIN_SEED, coin flips
    with the classic names (the text the shipped file was trained on; the models use its ids)."""
    text = "".join(corpus.splits(name, seed=TRAIN_SEED, classic_names=True)["train"]
                   for name in corpus.CORPORA)
    return train_bpe(text, VOCAB_SIZE - 1)


def dump_ranks(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's .tiktoken format: base64 token, space, rank, one per line in rank order."""
    return b"".join(base64.b64encode(t) + b" %d\n" % r
                    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def load_ranks(path: str | Path | None = None) -> dict[bytes, int]:
    """The BPE ranks in `path`, after checking its bytes against RANKS_SHA256. The file is read
    and parsed here, not by tiktoken's loader, whose cache of local files could serve a stale or
    tampered copy (and skips the hash when TIKTOKEN_CACHE_DIR is empty)."""
    path = Path(RANKS_PATH if path is None else path)
    fix = ("restore it from git, or regenerate it with `python -m minikv tokenizer --train` and "
           "update RANKS_SHA256")
    data = read_at_most(path, MAX_RANKS_BYTES, "the course tokenizer", fix)
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise ValueError(f"{path} does not match RANKS_SHA256 in {__file__}: {fix}")
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for downloaded files (mirrors tiktoken.load.read_file_cached); '' = no
    cache."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _gpt2_is_cached() -> bool:
    cache_dir = tiktoken_cache_dir()
    if not cache_dir:
        return False
    for url, sha256 in GPT2_FILES.items():
        path = Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()
        # tiktoken deletes and re-downloads a cached file whose hash is wrong, so check it too
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
            return False
    return True


def load_tokenizer(name: str = "course") -> tiktoken.Encoding:
    """The course tokenizer, or "gpt2" when tiktoken already has its files cached. Never
    downloads."""
    if name == "course":
        ranks = load_ranks()
        return tiktoken.Encoding(
            name="minikv-course", pat_str=PAT_STR, mergeable_ranks=ranks,
            special_tokens={EOT: len(ranks)}, explicit_n_vocab=VOCAB_SIZE,
        )
    if name == "gpt2":
        if not _gpt2_is_cached():
            raise RuntimeError(
                f"GPT-2's vocabulary is not in tiktoken's cache ({tiktoken_cache_dir()!r}) "
                "and minikv never downloads at run time. On a machine with network run "
                "`python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"`, "
                "then copy its cache directory here and point TIKTOKEN_CACHE_DIR at it; "
                "or use load_tokenizer('course')."
            )
        return tiktoken.get_encoding("gpt2")
    raise ValueError(f"unknown tokenizer {name!r}; valid names: 'course', 'gpt2'")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--train", action="store_true",
                        help=f"retrain and rewrite {RANKS_PATH.name}")
    action.add_argument("--check", action="store_true",
                        help="retrain in memory and compare with the shipped file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data = dump_ranks(course_ranks())
    sha256 = hashlib.sha256(data).hexdigest()
    print(f"trained {VOCAB_SIZE - 1} ranks in {time.perf_counter() - start:.1f} s, "
          f"sha256 {sha256}")
    if args.train:
        RANKS_PATH.parent.mkdir(exist_ok=True)
        write_atomically(RANKS_PATH, data)
        print(f"wrote {RANKS_PATH}; set RANKS_SHA256 = {sha256!r} in {__file__}")
        return 0
    ok = RANKS_PATH.is_file() and data == RANKS_PATH.read_bytes() and sha256 == RANKS_SHA256
    print("OK: matches the shipped file" if ok else f"MISMATCH with {RANKS_PATH} or RANKS_SHA256")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
