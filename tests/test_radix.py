"""Chapter 11's cache across turns: the radix tree over the block pool, its eviction, its
second tier and sessions (fork, rewind, save and load). The property: whatever the
workload, the pool, the policy or the tier, every request gets the tokens it gets with no
prefix cache, and every block is accounted for."""
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv import Radix, Request
from minikv.course.sessions import load_session, save_session
from minikv.engine.paged import BlockPool, BlockTable
from minikv.engine.radix import RadixTree, block_bytes
from minikv.engine.scheduler import FirstComeFirstServed
from minikv.engine.serving import Engine
from minikv.engine.session import Session, turn

from conftest import varied_model

MODEL = varied_model().double()  # float64: no near-tie can flip a greedy token
VOCAB = MODEL.config.vocab_size


def books(engine: Engine) -> None:
    """Every block's references are the tree's nodes and the running tables that list it;
    the free lists hold exactly the blocks nobody references; locks only while running."""
    tree, pool = engine.scheduler.prefix, engine.pool
    held, tiered = Counter(), Counter()
    for node in tree.nodes():
        (tiered if node.tiered else held).update(node.blocks)
        if node.tiered:  # what hangs below a tiered node is tiered too
            assert all(c.tiered for c in node.children.values()), node
    for s in engine.scheduler.running:
        held.update(s.table.blocks)
    for store, refs in ((pool, held), (tree.tier, tiered)):
        if store is None:
            continue
        assert store.ref == [refs[b] for b in range(store.num_blocks)]
        assert sorted(store.free) == [b for b in range(store.num_blocks) if not refs[b]]
    if not engine.has_work():
        assert all(node.locks == 0 for node in tree.nodes()) and not tree.held


def play(script, engine: Engine, check: bool = False) -> tuple[list, int]:
    """Run a script of turns, forks and rewinds; the replies, and the longest prompt plus
    its max_new_tokens."""
    sessions, replies, longest = [Session(engine)], [], 0
    for kind, i, message, new in script:
        s = sessions[i % len(sessions)]
        if kind == "say":
            replies.append(s.say(message, new))
        elif kind == "fork":
            sessions += s.fork(2)
        elif kind == "rewind" and s.starts:
            s.rewind(1 + new % len(s.starts))
        elif kind == "together":  # up to three sessions' turns in one batch
            group = sessions[i % len(sessions):][:3]
            replies += turn(group, [message[:k + 1] for k in range(len(group))], new)
        if check:
            books(engine)
        longest = max([longest] + [len(x.history) + new for x in sessions])
    return replies, longest


SCRIPTS = st.lists(st.tuples(st.sampled_from(["say", "say", "fork", "rewind", "together"]),
                             st.integers(0, 5),
                             st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
                             st.integers(1, 6)), min_size=3, max_size=12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=SCRIPTS, page_size=st.sampled_from([2, 4]), slack=st.integers(0, 3),
       evict=st.sampled_from(["lru", "hits"]), tier=st.sampled_from([0, 3, 40]),
       chunked=st.booleans())
def test_any_workload_gets_the_tokens_it_gets_uncached(script, page_size, slack, evict, tier,
                                                       chunked):
    plain = Engine(MODEL, 500, page_size=page_size, prefix_caching=False)
    expected, longest = play(script, plain)
    # The tightest pool the fit rule allows (a request alone, its replay window ahead, a
    # block to copy on write), plus a little: eviction and the tier are the common case.
    num_blocks = -(-(longest + 4) // page_size) + 1 + slack
    policy = FirstComeFirstServed(8, chunked_prefill=True) if chunked else None
    engine = Engine(MODEL, num_blocks, page_size=page_size, policy=policy,
                    prefix_caching=Radix(evict=evict, tier_blocks=tier))
    assert play(script, engine, check=True)[0] == expected
    books(engine)


CONVERSATION = [("say", 0, [5, 6, 7, 8, 9, 10, 11, 12, 13], 6), ("fork", 0, [1], 1),
                ("say", 1, [20, 21, 22], 5), ("say", 2, [30, 31, 32, 33, 34], 6),
                ("say", 1, [23, 24], 4), ("say", 0, [14, 15], 3),
                ("together", 1, [40, 41, 42], 4), ("say", 2, [35], 5),
                ("rewind", 2, [1], 1), ("say", 2, [36, 37], 4)]


def test_a_tight_pool_evicts_to_the_tier_and_copies_back_with_the_same_tokens():
    """One workload where every path the property test may miss is taken: partial blocks
    copied, leaves moved to the tier and copied back."""
    expected, longest = play(CONVERSATION, Engine(MODEL, 500, page_size=4,
                                                  prefix_caching=False))
    engine = Engine(MODEL, -(-(longest + 4) // 4) + 1, page_size=4,
                    prefix_caching=Radix(tier_blocks=40))
    assert play(CONVERSATION, engine, check=True)[0] == expected
    counts = engine.scheduler.prefix.counts
    assert counts["to_tier"] > counts["from_tier"] > 0 and counts["dropped"] == 0
    assert any(what == "copy" for what, _, _ in engine.pool.log)


# --- the tree itself ---------------------------------------------------------------------
def tree_over(num_blocks=12, page_size=4, **radix) -> RadixTree:
    pool = BlockPool(MODEL.config, num_blocks, page_size, dtype=torch.float64)
    return RadixTree(pool, Radix(**radix), MODEL.config)


def table_for(tree: RadixTree, n: int) -> BlockTable:
    table = BlockTable(owner=0)
    tree.pool.reserve(table, n)
    table.length = n
    return table


def test_a_match_is_token_by_token_and_a_split_shares_the_block_it_cuts():
    tree = tree_over()
    table = table_for(tree, 10)  # positions 0..9 in blocks 0, 1, 2
    tree.insert(list(range(10)), table.blocks)
    path = tree.match([0, 1, 2, 3, 4, 5, 99])
    assert [(len(node.tokens), k) for node, k in path] == [(10, 6)]
    head = tree.split(path[0][0], 6)  # positions 0..5 | 6..9: block 1 in both halves
    child = head.children[6]
    assert (head.blocks, child.blocks) == (table.blocks[:2], table.blocks[1:])
    assert tree.pool.ref[table.blocks[1]] == 3  # the table's, and each half's
    assert [k for _, k in tree.match([0, 1, 2, 3, 4, 5, 6, 7])] == [6, 2]


def serve_turns(prompts, prefix_caching, num_blocks=None, page_size=4):
    """Each prompt served after the last one finished (arrivals far apart)."""
    requests = [Request(p, 3, arrival=20 * i) for i, p in enumerate(prompts)]
    return minikv.serve(MODEL, requests, page_size=page_size, num_blocks=num_blocks,
                        prefix_caching=prefix_caching)


def test_a_full_hit_recomputes_only_the_last_token():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    outs = serve_turns([prompt, prompt], Radix())
    assert outs[1].stats.reused == len(prompt) - 1  # its logits choose the first token
    assert outs[1].tokens == outs[0].tokens == serve_turns([prompt], False)[0].tokens


def test_a_match_inside_a_block_copies_it_once_and_computes_less_than_hashed_blocks():
    first, second = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 40, 41]
    radix, hashed = serve_turns([first, second], Radix()), serve_turns([first, second], True)
    assert (radix[1].stats.reused, hashed[1].stats.reused) == (6, 4)  # blocks of 4
    copies = [entry for entry in radix.pool.log if entry[0] == "copy"]
    assert len(copies) == 1 and copies[0][2] == 1  # request 1 copied the block it shares
    assert radix[1].tokens == hashed[1].tokens == serve_turns([second], False)[0].tokens


def test_the_next_turn_finds_the_whole_history_the_reply_too():
    reused = {}
    for prefix in (Radix(), True):  # the tree; chapter 06's hashed prompt blocks
        engine = Engine(MODEL, 40, page_size=4, prefix_caching=prefix)
        first = [3, 1, 4, 1, 5, 9, 2]
        engine.add(Request(first, 5), index=0)
        while engine.has_work():
            engine.step()
        history = first + engine.outputs()[0].tokens  # 12 positions
        engine.add(Request(history + [6, 5], 4), index=1)
        while engine.has_work():
            engine.step()
        reused[type(engine.scheduler.prefix).__name__] = engine.outputs()[1].stats.reused
    # All but the reply's last token, whose K/V no pass computed; blocks of the prompt only.
    assert reused == {"RadixTree": 11, "HashedBlocks": 4}


def touch(tree: RadixTree, tokens: list[int]) -> None:
    """A request that reads `tokens` through the tree and leaves."""
    probe = _Probe(tokens + [0])
    tree.take(probe, tree.lookup(probe))
    tree.pool.free_table(probe.table)
    tree.relock(probe, None)


def test_eviction_frees_the_least_recently_used_leaf_or_the_least_hit():
    a, b = [1, 2, 3, 4, 10, 11, 12, 13], [1, 2, 3, 4, 20, 21, 22, 23]
    for policy, gone in (("lru", 10), ("hits", 20)):
        tree = tree_over(evict=policy)
        for tokens in (a, b):
            table = table_for(tree, len(tokens))
            tree.insert(tokens, table.blocks)
            tree.pool.free_table(table)
        touch(tree, a)
        touch(tree, a)
        touch(tree, b)  # b: the most recent, a: the most hit
        assert tree.evict(1) == 1
        assert sorted(node.tokens[0] for node in tree.nodes()) == sorted({1, 10, 20} - {gone})


def test_a_leaf_just_inserted_is_the_most_recently_used():
    """LRU keeps what a request has just computed: a leaf inserted after another leaf was last
    matched is the younger of the two (SGLang stamps an inserted node's access time too)."""
    a, b = [1, 2, 3, 4, 10, 11, 12, 13], [1, 2, 3, 4, 20, 21, 22, 23]
    tree = tree_over()
    table = table_for(tree, len(a))
    tree.insert(a, table.blocks)
    tree.pool.free_table(table)
    touch(tree, a)
    table = table_for(tree, len(b))
    tree.insert(b, table.blocks)  # computed after a was read: never matched, yet the newest
    tree.pool.free_table(table)
    assert tree.evict(1) == 1
    assert sorted(node.tokens[0] for node in tree.nodes()) == [1, 20]


class _Probe:
    """A stand-in for a scheduler.Sequence: its tokens, its table, its index."""

    def __init__(self, tokens):
        self.tokens, self.index, self.replay, self.proposer = tokens, 7, False, None
        self.table = BlockTable(owner=7)


def test_the_tier_takes_what_the_pool_evicts_and_gives_it_back_counted():
    tree = tree_over(num_blocks=6, tier_blocks=4)
    table = table_for(tree, 8)
    tree.insert(list(range(8)), table.blocks)
    tree.pool.free_table(table)
    assert tree.evict(2) == 2 and tree.counts["to_tier"] == 2
    keys = [layer[tree.root.children[0].blocks].clone() for layer in tree.tier.keys]
    probe = _Probe(list(range(9)))
    hit = tree.lookup(probe)
    assert (hit.length, hit.taken) == (8, 2)  # two blocks to copy back, none to compute
    tree.take(probe, hit)
    node = tree.root.children[0]
    assert not node.tiered and tree.counts["from_tier"] == 2
    assert all(torch.equal(layer[node.blocks], k) for layer, k in zip(tree.pool.keys, keys))
    assert tree.counts["bytes_moved"] == 4 * block_bytes(tree.pool) and tree.tier.n_free == 4


def test_a_tier_in_a_mapped_file(tmp_path):
    path = tmp_path / "tier.bin"
    tree = tree_over(tier_blocks=3, tier_file=str(path))
    assert path.stat().st_size == 3 * block_bytes(tree.pool)
    table = table_for(tree, 4)
    for layer in tree.pool.keys + tree.pool.values:
        layer[table.blocks] = torch.randn_like(layer[table.blocks])
    blocks = list(table.blocks)
    tree.insert([1, 2, 3, 4], blocks)
    tree.pool.free_table(table)
    tree.evict(1)
    node = tree.root.children[1]
    assert node.tiered and path.read_bytes().strip(b"\0")  # the K/V went to the file
    assert torch.equal(tree.tier.keys[1][node.blocks], tree.pool.keys[1][blocks])


def test_settings_and_sessions_refuse_bad_values():
    for bad in ({"evict": "random"}, {"tier_blocks": -1}, {"tier_blocks": True},
                {"tier_file": 3}):
        with pytest.raises((TypeError, ValueError)):
            Radix(**bad)
    with pytest.raises(TypeError, match="Radix"):
        minikv.serve(MODEL, [Request([1, 2], 2)], prefix_caching="radix")
    s = Session(Engine(MODEL, 20, page_size=4, prefix_caching=Radix()))
    with pytest.raises(ValueError, match="turns"):
        s.rewind()  # nothing said yet
    with pytest.raises(ValueError):
        s.fork(0)
    with pytest.raises(TypeError):
        Session("engine")


# --- a session saved, loaded and continued -------------------------------------------------
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import varied_model
from minikv import Radix
from minikv.engine.serving import Engine
from minikv.engine.session import Session
from minikv.course.sessions import load_session, save_session
model = varied_model().double()
engine = Engine(model, 40, page_size=4, prefix_caching=Radix())
if sys.argv[1] == "save":
    s = Session(engine)
    s.say([3, 1, 4, 1, 5, 9, 2, 6], 5)
    s.say([5, 3, 5], 4)
    save_session(s, sys.argv[2])
    print(s.say([8, 9, 7], 6))  # the uninterrupted conversation
else:
    s = load_session(engine, sys.argv[2])
    print(s.say([8, 9, 7], 6), engine.outputs(), engine.scheduler.prefix.held)
"""


def test_a_saved_session_goes_on_in_another_process_as_if_never_interrupted(tmp_path):
    script, path = tmp_path / "run.py", tmp_path / "chat.safetensors"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))

    def run(*args):
        return subprocess.run([sys.executable, str(script), *args], check=True,
                              capture_output=True, text=True).stdout.strip()
    uninterrupted = run("save", str(path))
    resumed = run("load", str(path))
    assert resumed == f"{uninterrupted} {{}} {{}}"


def saved(tmp_path) -> tuple[Path, Session]:
    engine = Engine(MODEL, 40, page_size=4, prefix_caching=Radix())
    s = Session(engine)
    s.say([3, 1, 4, 1, 5, 9, 2, 6], 5)
    return save_session(s, tmp_path / "chat.safetensors"), s


def test_loading_refuses_a_damaged_or_foreign_file_before_allocating(tmp_path):
    path, _ = saved(tmp_path)
    engine = Engine(MODEL, 40, page_size=4, prefix_caching=Radix())
    data = path.read_bytes()
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    other = Engine(varied_model(seed=1).double(), 40, page_size=4, prefix_caching=Radix())
    wide = Engine(varied_model(n_layer=3).double(), 40, page_size=4, prefix_caching=Radix())
    for eng, p, says in ((engine, damaged, "sha256"), (other, path, "weights"),
                         (wide, path, "config"), (engine, tmp_path, "not a file"),
                         (engine, tmp_path / "missing", "not a file")):
        with pytest.raises(ValueError, match=says):
            load_session(eng, p)
        assert eng.pool.n_free == 40 and not eng.scheduler.prefix.nodes()
    with pytest.raises(TypeError, match="radix tree"):
        load_session(Engine(MODEL, 40, page_size=4), path)


def test_saving_replaces_only_a_saved_session(tmp_path):
    path, s = saved(tmp_path)
    save_session(s, path)  # a session again: replaced
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(ValueError, match="not a saved session"):
        save_session(s, mine)
    assert mine.read_text() == "mine"


def test_a_rewound_turn_is_found_again_and_a_fork_shares_the_history():
    engine = Engine(MODEL, 60, page_size=4, prefix_caching=Radix())
    s = Session(engine)
    s.say([2, 7, 1, 8, 2, 8], 4)
    first = list(s.history)
    s.say([1, 8], 3)
    s.rewind()
    assert s.history == first and s.starts == [0]
    a, b = s.fork(2)
    log = len(engine.pool.log)
    turn([a, b], [[4], [5]], 3)
    shared = [block for what, block, owner in engine.pool.log[log:] if what == "share"]
    full = (len(first) - 1) // 4  # the history's full blocks, read by both branches
    assert all(shared.count(block) == 2 for block in shared[:full])
    assert a.history[:len(first)] == b.history[:len(first)] == first
