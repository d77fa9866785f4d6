"""Chapter 11's checkers (a radix tree of prefixes over the paged pool, eviction, a second
tier), against the engine's RadixTree on the CPU, leaving the caller's random state alone:
match_length and split_blocks (tables); insert_sequence, predict_reused, evict (FixedRadixTree) and
choose_sizes (code). The hints are in hints/ch11.toml."""
from __future__ import annotations

import functools
from collections import Counter

import torch

from ...engine import GPTConfig, serve
from ...engine.paged import BlockPool, BlockTable
from ...engine.radix import TREE, Node, Radix, RadixTree, common_length
from ...engine.serving import Engine
from ...engine.session import Session, turn
from .. import checks as ck

H = ck.hints("ch11")
MT, IN, SB, PR, EV, DS = (H[k] for k in ("match_length", "insert", "split_blocks",
                                          "predict_reused", "evict", "choose_sizes"))
PAGE = 4
_CFG = GPTConfig.preset("tiny", n_layer=1, n_head=1, n_embd=4)  # blocks for books, not K/V
_model = functools.cache(lambda: ck.tiny_model(11).double())  # float64: no near-tie flips


def engine_tree(sequences, page_size: int = PAGE, spare: int = 1) -> RadixTree:
    """The engine's tree holding `sequences`, inserted in order as finished requests leave
    them (each computed into fresh blocks, then let go: the tree's references keep them)."""
    need = sum(-(-len(s) // page_size) for s in sequences) + spare
    pool = BlockPool(_CFG, need, page_size)
    tree = RadixTree(pool, Radix(), _CFG)
    for seq in sequences:
        table = BlockTable(0)
        pool.reserve(table, len(seq))
        table.length = len(seq)
        tree.insert(list(seq), table.blocks)
        pool.free_table(table)
    return tree


def _lines(root: Node) -> list[str]:
    """A tree as indented lines: each node's start and tokens."""
    out = []

    def visit(node, depth):
        for key in sorted(node.children):
            child = node.children[key]
            out.append(f"{'  ' * depth}{child.start}: {list(child.tokens)}")
            visit(child, depth + 1)
    visit(root, 0)
    return out


# --- exercise 1 (a table): how much of a sequence the tree holds ---------------------------
S1, S2, S3, S4 = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 20, 21], [1, 2, 30],
                  [40, 41, 42, 43, 44])
MATCH_CASES = [  # (what the case is about, the tree's sequences, the query)
    ("a query that leaves the only edge in its middle", [S1], [1, 2, 3, 4, 5, 6, 99]),
    ("two edges, the second matched in part", [S1, S2], [1, 2, 3, 4, 5, 6, 7, 50, 51]),
    ("a query the tree holds whole, and two tokens more", [S1], S1 + [11, 12]),
    ("a query shorter than the edge it ends in", [S1], [1, 2, 3]),
    ("a first token no edge starts with", [S1, S4], [2, 3]),
    ("an empty tree", [], [1, 2, 3]),
    ("three levels (two splits), the query down the shortest branch", [S1, S2, S3],
     [1, 2, 30, 31]),
    ("the root's second edge", [S1, S4], [40, 41, 42, 9]),
    ("down the other branch of a split", [S1, S2, S3], [1, 2, 3, 4, 5, 6, 20, 21, 22]),
    ("a query that ends exactly where an edge ends", [S1, S2], [1, 2, 3, 4, 5, 6]),
    ("a query that leaves an edge with a token one of the edge's children begins with",
     [S1, S2], [1, 2, 3, 7, 8, 9]),
]


def _labelled_root(label: str, sequences) -> Node:
    root = engine_tree(sequences).root
    root.label = f"{label}: the tree holds {sequences}" if sequences else f"{label}"
    return root


def engine_match(root: Node, tokens) -> int:
    """The engine's answer: RadixTree.match over this root, its matched tokens summed."""
    tree = RadixTree.__new__(RadixTree)
    tree.root = root
    return sum(k for _, k in RadixTree.match(tree, list(tokens)))


def _walk(root, tokens, step):
    """Down from the root: step(child edge, rest of the query) -> (tokens counted, go on?)."""
    node, pos = root, 0
    while pos < len(tokens) and tokens[pos] in node.children:
        child = node.children[tokens[pos]]
        k, go_on = step(child.tokens, tokens[pos:])
        pos += k
        if not go_on:
            break
        node = child
    return min(pos, len(tokens))


def _solution_step(edge, rest) -> tuple[int, bool]:
    """The tokens an edge and the rest of the query share; go on only past a whole edge."""
    k = 0
    while k < len(edge) and k < len(rest) and edge[k] == rest[k]:
        k += 1
    return k, k == len(edge)


def _solution(root, tokens) -> int:
    return _walk(root, list(tokens), _solution_step)


def _whole_edges(root, tokens) -> int:
    def step(edge, rest):
        whole = list(edge) == list(rest[:len(edge)])
        return (len(edge), True) if whole else (0, False)
    return _walk(root, list(tokens), step)


def _off_by_one(root, tokens) -> int:
    def step(edge, rest):
        k = 0
        while k < len(edge) and k < len(rest) and edge[k] == rest[k]:
            k += 1
        return (k, True) if k == len(edge) else (k + 1, False)
    return _walk(root, list(tokens), step)


MATCH = ck.Exercise(
    "match_length",
    cases=[(_labelled_root(label, seqs), query) for label, seqs, query in MATCH_CASES],
    describe=lambda root, tokens: f"{root.label}, tokens={list(tokens)}",
    reference=engine_match, solution=_solution,
    returns=ck.integer(MT["not_int"]), forbid=(RadixTree.match, common_length),
    mistakes=ck.named(
        MT, whole_edges=_whole_edges,
        whole_blocks=lambda root, tokens: _solution(root, tokens) // PAGE * PAGE,
        first_token=lambda root, tokens: _walk(root, list(tokens),
                                               lambda edge, rest: (len(edge), True)),
        off_by_one=_off_by_one,
        root_only=lambda root, tokens: _walk(root, list(tokens), lambda edge, rest: (
            _solution_step(edge, rest)[0], False)),
        leave_one=lambda root, tokens: min(_solution(root, tokens), len(tokens) - 1)),
    otherwise=MT["otherwise"])
check_match_length = MATCH.check


# --- exercise 2 (code): insert, splitting an edge ------------------------------------------
INSERT_CASES = [  # (what the case is about, sequences inserted in order)
    ("one sequence into an empty tree", [S1]),
    ("a second sequence that leaves the first edge in its middle", [S1, S2]),
    ("a third that leaves the new shared edge in its middle: a split of a split", [S1, S2, S3]),
    ("a sequence with another first token: a second edge from the root", [S1, S4]),
    ("a sequence that ends inside an edge", [S1, [1, 2, 3]]),
    ("a sequence that goes on past a whole edge", [[1, 2, 3], S1]),
    ("the same sequence twice", [S1, S1]),
    ("a split below a split", [S1, S2, [1, 2, 3, 4, 5, 6, 7, 8, 60]]),
    ("a sequence that ends exactly where an edge ends", [S1, S2, [1, 2, 3, 4, 5, 6]]),
]


def _shape(node: Node) -> tuple:
    return tuple((key, tuple(c.tokens), c.start, _shape(c))
                 for key, c in sorted(node.children.items()))


def _books(root: Node) -> str:
    """The first rule of a tree that `root` breaks, as its hint's key; '' if none."""
    todo = [root]
    while todo:
        node = todo.pop()
        for key, child in node.children.items():
            if not isinstance(child, Node) or not len(child.tokens):
                return "empty_edge"
            if key != child.tokens[0]:
                return "key"
            if child.parent is not node:
                return "parent"
            if child.start != (node.start + len(node.tokens) if node is not root else 0):
                return "start"
            todo.append(child)
    return ""


def _spelled(root: Node) -> set[tuple]:
    """Every prefix the tree spells (root to a node's end)."""
    out, todo = set(), [(root, ())]
    while todo:
        node, prefix = todo.pop()
        for child in node.children.values():
            seq = prefix + tuple(child.tokens)
            out.add(seq)
            todo.append((child, seq))
    return out


def _holds(root: Node, seq) -> bool:
    return any(s[:len(seq)] == tuple(seq) for s in _spelled(root))


@ck.guarded
def check_insert_sequence(insert) -> None:
    """insert_sequence(root, tokens): the engine's RadixTree.insert, without blocks."""
    name = "insert_sequence"
    for label, sequences in INSERT_CASES:
        root, want = Node([], 0, None, []), engine_tree([], spare=64)
        for i, seq in enumerate(sequences):
            where = (f"{label}: {sequences[:i]} inserted, then "
                     f"insert_sequence(root, {seq})" if i else
                     f"{label}: insert_sequence(root, {seq}) into an empty tree")
            with ck.forbid(name, RadixTree.insert, RadixTree.split):
                ck.call_hinted(name, where, lambda e: IN["raised"], insert, root, list(seq))
            table = BlockTable(0)  # the engine's tree, given the sequence in fresh blocks
            want.pool.reserve(table, len(seq))
            table.length = len(seq)
            want.insert(list(seq), table.blocks)
            want.pool.free_table(table)
            if _shape(root) != _shape(want.root) or _books(root):
                broken = _books(root)
                lost = [s for s in sequences[:i + 1] if not _holds(root, s)]
                ends = any(tuple(seq) not in _spelled(root) for seq in sequences[:i + 1])
                hint = (IN[broken] if broken else IN["lost"] if lost else
                        IN["no_node_at_end"] if ends else
                        IN["twice"] if len(_spelled(root)) > len(_spelled(want.root))
                        else IN["otherwise"])
                ck.fail(name, where, "\n    " + "\n    ".join(_lines(want.root)),
                        "\n    " + "\n    ".join(_lines(root)) if root.children else
                        "an empty tree", hint)
    ck.passed(name, len(INSERT_CASES))


# --- exercise 3 (a table): the blocks of a split's two halves ------------------------------
SPLIT_CASES = [  # (what the case is about, start, blocks, k, page_size)
    ("the chapter's split: positions 0-9 cut after 7 tokens", 0, [0, 1, 2], 7, 4),
    ("a cut on a block boundary", 0, [5, 2, 7], 8, 4),
    ("an edge that starts inside a block (its first block is its parent's last)", 6,
     [1, 2, 3, 8], 5, 4),
    ("an edge that starts inside a block, cut on a boundary", 6, [1, 2, 3, 8], 6, 4),
    ("a cut after one token", 3, [4, 9], 1, 4),
    ("blocks of 16, the cut inside the second", 16, [3, 7, 1], 21, 16),
    ("blocks of 1 position: never a shared block", 5, [9, 3, 4, 6], 2, 1),
    ("an edge starting on a boundary, cut inside its third block", 8, [6, 0, 2, 5], 10, 4),
]


def engine_split(start, blocks, k, page_size) -> tuple[list[int], list[int]]:
    """RadixTree.split's halves for an edge at `start` over `blocks`."""
    first = start // page_size
    length = (first + len(blocks)) * page_size - start  # to the end of its last block
    pool = BlockPool(_CFG, max(blocks) + 1, page_size)
    for b in blocks:
        pool.share(b, TREE)
    tree = RadixTree(pool, Radix(), _CFG)
    child = Node(list(range(1000, 1000 + length)), start, tree.root, list(blocks))
    tree.root.children[child.tokens[0]] = child
    head = RadixTree.split(tree, child, k)
    return list(head.blocks), list(child.blocks)


def _split(head_end=lambda cut, ps: (cut - 1) // ps + 1, tail_start=lambda cut, ps: cut // ps,
           offset=True):
    """The halves by the rule (the right one), or with one of the usual mistakes: the head
    holds the blocks of positions start .. cut - 1, the tail those of cut .. (cut = start + k);
    indices into `blocks` count from the edge's first block, start // page_size."""
    def split_blocks(start, blocks, k, page_size):
        first, cut = (start // page_size, start + k) if offset else (0, k)
        return (list(blocks[:head_end(cut, page_size) - first]),
                list(blocks[tail_start(cut, page_size) - first:]))
    return split_blocks


def _halves(got, start, blocks, k, page_size):
    """The contract: two lists of block ids."""
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        raise ck.Refused(SB["not_pair"])
    halves = tuple(ck.int_list(h) for h in got)
    if any(h is None for h in halves):
        raise ck.Refused(SB["not_ids"])
    return tuple(list(h) for h in halves)


SPLIT = ck.Exercise(
    "split_blocks", cases=[case[1:] for case in SPLIT_CASES],
    describe=lambda start, blocks, k, ps: next(
        f"{c[0]}: start={start}, blocks={blocks}, k={k}, page_size={ps}" for c in SPLIT_CASES
        if c[1:] == (start, blocks, k, ps)),
    reference=lambda *case: tuple(engine_split(*case)), solution=_split(),
    returns=_halves, same=lambda got, want: tuple(got) == tuple(want),
    forbid=(RadixTree.split,),
    mistakes=ck.named(
        SB, not_shared=_split(head_end=lambda cut, ps: cut // ps),
        tail_after=_split(tail_start=lambda cut, ps: -(-cut // ps)),
        no_offset=_split(offset=False), boundary=_split(head_end=lambda cut, ps: cut // ps + 1)),
    otherwise=SB["otherwise"], unchanged=SB["unchanged"])
check_split_blocks = SPLIT.check


# --- exercise 4 (predict, then measure): what each turn reuses -----------------------------
FIRST = [101, 102, 103, 104, 105, 106, 107, 108]          # 8 tokens: two whole blocks
SECOND = [201, 202, 203, 204, 205]                         # 5
EDITED = [201, 202, 303, 304, 305]                         # 5, its first 2 as SECOND's
REPLY = 3
PREDICT_KEYS = [(what, cache) for what in ("turn 2", "regenerated", "edited")
                for cache in ("tree", "hashed")]


def measure_reused() -> dict:
    """Each request's reused positions, served by the engine on a tiny model."""
    out = {}
    for cache, setting in (("tree", Radix()), ("hashed", True)):
        engine = Engine(_model(), 64, page_size=PAGE, prefix_caching=setting)
        s = Session(engine)
        with torch.inference_mode():
            s.say(FIRST, REPLY)
            for what, message in (("turn 2", SECOND), ("regenerated", SECOND),
                                  ("edited", EDITED)):
                if what != "turn 2":
                    s.rewind()
                s.say(message, REPLY)
                out[what, cache] = s.last.stats.reused
    return out


def _predict_mistakes(key) -> list[tuple[int, str]]:
    """The usual wrong predictions for one request, each with its hint."""
    what, cache = key
    history = len(FIRST) + REPLY          # what the first turn leaves: message and reply
    prompt = history + len(SECOND)        # the second turn's prompt (and the regenerated one's)
    return {
        ("turn 2", "tree"): [(history, PR["last_reply_token"]), (len(FIRST), PR["prompt_only"]),
                             ((history - 1) // PAGE * PAGE, PR["whole_blocks"])],
        ("regenerated", "tree"): [(prompt, PR["full_hit"]), (history - 1, PR["rewound_gone"])],
        ("edited", "tree"): [(history - 1, PR["rewound_gone"]), (history, PR["rewound_gone"]),
                             (history + 1, PR["edited_minus_one"]),
                             ((history + 2) // PAGE * PAGE, PR["whole_blocks"])],
        ("turn 2", "hashed"): [(history - 1, PR["hashed_reply"]),
                               ((prompt - 1) // PAGE * PAGE, PR["hashed_reply"]),
                               ((len(FIRST) - 1) // PAGE * PAGE, PR["hashed_first_rule"])],
        ("regenerated", "hashed"): [(prompt - 1, PR["full_hit"]),
                                    (prompt // PAGE * PAGE, PR["hashed_boundary"]),
                                    (len(FIRST), PR["hashed_published"])],
        ("edited", "hashed"): [(history + 2, PR["hashed_tokens"]),
                               (history // PAGE * PAGE, PR["hashed_edited"]),
                               (prompt // PAGE * PAGE, PR["hashed_boundary"])],
    }[what, cache]


@ck.one_thread
@ck.guarded
def check_predict_reused(predict_reused) -> None:
    """predict_reused() -> {(request, "tree" or "hashed"): positions reused}."""
    name = "predict_reused"
    case = (f"a conversation in blocks of {PAGE}: a {len(FIRST)}-token message, a "
            f"{len(SECOND)}-token one, the second regenerated, then edited; replies of {REPLY}")
    got = ck.predicted(name, case, ck.prediction(name, case, predict_reused, Engine.step,
                                                 serve, Session.say, turn),
                       PREDICT_KEYS, PR["not_a_dict"], PR["not_an_int"])
    measured = measure_reused()
    ck.as_measured(name, case, got, measured, _predict_mistakes, PR["wrong"], PR["otherwise"],
                   lambda key: f"the {key[0]} request, {key[1]}")
    print("  measured: " + "; ".join(f"{w} {c}: {measured[w, c]}" for w, c in PREDICT_KEYS))
    ck.passed(name, len(PREDICT_KEYS))


# --- exercise 5 (debug): an eviction that frees a block a request still reads ---------------
class BuggyRadixTree(RadixTree):
    """The notebook's broken eviction, verbatim (a port of SGLang's evict)."""

    def evict(self, n, spare=None, locked=False):
        keep = {node for node, _ in spare.found} if spare else set()
        freed = 0
        while freed < n:
            leaves = [x for x in self.nodes() if not x.children and x not in keep]
            if not leaves:
                break
            victim = min(leaves, key=lambda x: x.used)
            for block in victim.blocks:      # SGLang: token_to_kv_pool.free(victim.value)
                self.pool.ref[block] = 0
                self.pool.free.append(block)
                freed += 1
            del victim.parent.children[victim.tokens[0]]
            self.counts["evicted"] += len(victim.blocks)
        return freed


class _Reader:
    """A running request that reads `tokens` through the tree (its blocks shared, its path
    locked), as Scheduler.admit leaves it."""

    def __init__(self, tree: RadixTree, tokens: list[int], index: int):
        self.tokens, self.index, self.replay = list(tokens) + [0], index, False
        self.table = BlockTable(index)
        tree.take(self, tree.lookup(self))


T1, T2, T3 = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 20, 21, 22, 23],
              [40, 41, 42, 43, 44, 45])
# (what, sequences inserted (older first), what running requests read, sequences inserted
# after they started, evict's n, the spare hit's tokens, locked)
EVICT_CASES = [
    ("the least recently used leaf is read by a running request (locked): the next one goes",
     [T1], [T1], [T3], 2, None, False),
    ("the least recently used leaf goes first", [T1, T3], [], [], 1, None, False),
    ("a leaf whose first block is its parent's last (a split's cut block)", [T1, T2], [], [],
     1, None, False),
    ("two leaves below a split, then their parent", [T1, T2], [], [], 4, None, False),
    ("nothing can go: every leaf is locked", [T1], [T1], [], 1, None, False),
    ("the spare hit's nodes stay", [T1, T3], [], [], 2, T1, False),
    ("the last resort (locked=True): a locked leaf goes, the request keeps its blocks", [T1],
     [T1], [], 1, None, True),
    ("more than one leaf to free n blocks", [T3, T1, T2], [], [], 3, None, False),
]


def _evict_case(case, cls) -> tuple:
    """(freed, the nodes left, pool.ref, the free blocks, the readers' tables) after
    cls.evict on the case's tree."""
    _, sequences, readers, after, n, spare, locked = case
    tree = engine_tree(sequences, spare=6)
    tree.__class__ = cls  # inserted in order: the first the least recently used
    held = [_Reader(tree, tokens, i) for i, tokens in enumerate(readers)]
    for seq in after:
        table = BlockTable(0)
        tree.pool.reserve(table, len(seq))
        table.length = len(seq)
        tree.insert(list(seq), table.blocks)
        tree.pool.free_table(table)
    hit = None
    if spare is not None:
        probe = type("Probe", (), {"tokens": list(spare) + [0]})()
        hit = tree.lookup(probe)
    freed = cls.evict(tree, n, hit, locked)
    nodes = sorted((x.start, tuple(x.tokens)) for x in tree.nodes())
    return (freed, nodes, list(tree.pool.ref), sorted(tree.pool.free),
            [list(r.table.blocks) for r in held], tree.counts["evicted"])


@ck.guarded
def check_evict(tree_class) -> None:
    """tree_class.evict, against RadixTree.evict on the same trees, then in a server."""
    name = "evict"
    if not (isinstance(tree_class, type) and issubclass(tree_class, RadixTree)):
        ck.fail(name, "the class", "a subclass of RadixTree (of BuggyRadixTree)", tree_class,
                EV["not_a_class"])
    for case in EVICT_CASES:
        label, sequences, readers, after, n, spare, locked = case
        where = (f"{label}: the tree holds {sequences + after}" + (
            f", running requests read {readers}" if readers else "") + f"; evict({n}" + (
                     f", spare=the hit of {spare}" if spare else "") + (
                     ", locked=True" if locked else "") + ")")
        with ck.forbid(name, RadixTree.evict):
            got = ck.call_hinted(name, where, lambda e: EV["twice"] if isinstance(
                e, AssertionError) and "twice" in str(e) else EV["raised"], _evict_case,
                case, tree_class)
        want = _evict_case(case, RadixTree)
        if got == want:
            continue
        freed, nodes, ref, free, tables, _ = got
        if any(b in t for b in free for t in tables):
            hint = EV["freed_held"]
        elif any(r == 0 and w > 0 for r, w in zip(ref, want[2])):
            hint = EV["freed_shared"]
        elif len(free) != len(set(free)):
            hint = EV["free_twice"]
        elif any(r > w for r, w in zip(ref, want[2])) and len(nodes) <= len(want[1]):
            hint = EV["leaked"]
        elif nodes != want[1]:
            gone = set(want[1]) - set(nodes)
            hint = (EV["locked"] if readers and not locked and len(nodes) < len(want[1])
                    else EV["spare"] if spare and len(nodes) < len(want[1])
                    else EV["not_leaf"] if gone else EV["order"]
                    if len(nodes) == len(want[1]) else EV["too_many"]
                    if len(nodes) < len(want[1]) else EV["too_few"])
        elif freed != want[0]:
            hint = EV["returned"]
        elif got[5] != want[5]:
            hint = EV["counted"]
        else:
            hint = EV["books"]
        ck.fail(name, where, _evict_words(want), _evict_words(got), hint)
    _check_evict_serving(name, tree_class)
    ck.passed(name, len(EVICT_CASES) + 1)


def _evict_words(state) -> str:
    freed, nodes, ref, free, _, evicted = state
    return (f"{freed} freed; nodes {[list(t) for _, t in nodes]}; pool.ref {ref}; "
            f"free blocks {free}; counts['evicted'] {evicted}")


# Three users, a fork and a turn of all of them at once, in a pool too small to keep every
# history: evictions happen while requests run.
SERVE_SCRIPT = [("say", 0, [11, 12, 13, 14, 15, 16, 17], 4),
                ("say", 1, [11, 12, 13, 14, 30, 31, 32, 33, 34], 4),
                ("together", 0, [[40, 41], [42, 43, 44], [45]], 4),
                ("fork", 0, None, 0),
                ("together", 0, [[50, 51, 52], [53], [54, 55], [56]], 3),
                ("say", 2, [60, 61, 62, 63, 64], 5),
                ("together", 1, [[70], [71, 72]], 4)]


SERVE_BLOCKS = 12


def play(engine, watch=None) -> list:
    sessions, replies = [Session(engine), Session(engine), Session(engine)], []
    for kind, i, message, new in SERVE_SCRIPT:
        if kind == "say":
            replies.append(sessions[i].say(message, new))
        elif kind == "fork":
            sessions += sessions[i].fork(1)
        else:
            group = sessions[i:i + len(message)]
            replies += turn(group, message, new)
        if watch is not None:
            watch()
    return replies


def freed_but_read(engine) -> list[tuple[int, int]]:
    """(request, block) for every block a running request's table lists that the pool counts
    as free."""
    free = set(engine.pool.free)
    return [(s.index, b) for s in engine.scheduler.running for b in s.table.blocks
            if b in free or engine.pool.ref[b] == 0]


def books(engine) -> str:
    """'' when every pool block's count is the tree's nodes plus the running tables listing it
    and the free list holds exactly the blocks nobody lists; else what is wrong."""
    tree, pool = engine.scheduler.prefix, engine.pool
    held = Counter(b for x in tree.nodes() for b in x.blocks)
    held.update(b for s in engine.scheduler.running for b in s.table.blocks)
    wrong = [b for b in range(pool.num_blocks) if pool.ref[b] != held[b]]
    if wrong:
        return f"block {wrong[0]}: pool.ref {pool.ref[wrong[0]]}, held by {held[wrong[0]]}"
    if sorted(pool.free) != [b for b in range(pool.num_blocks) if not held[b]]:
        return "the free list is not the blocks nobody holds"
    return ""


@torch.inference_mode()
def _check_evict_serving(name, tree_class) -> None:
    case = (f"three users, a fork and turns of several users at once, in a pool of "
            f"{SERVE_BLOCKS} blocks of 4 too small for every history")
    plain = play(Engine(_model(), 200, page_size=PAGE, prefix_caching=False))
    engine = Engine(_model(), SERVE_BLOCKS, page_size=PAGE, prefix_caching=Radix())
    engine.scheduler.prefix = tree_class(engine.pool, Radix(), _model().config)
    freed, broken = [], []  # after which step, and what: a block freed while read; books
    step = engine.step

    def watched():
        out = step()
        when = f"engine step {engine.scheduler.now - 1}"
        freed.extend((when, request, block) for request, block in freed_but_read(engine))
        broken.extend((when, wrong) for wrong in [books(engine)] if wrong)
        return out
    engine.step = watched
    with ck.forbid(name, RadixTree.evict):
        got = ck.call_hinted(name, case, lambda e: EV["twice"] if isinstance(
            e, AssertionError) and "twice" in str(e) else EV["serve_raised"], play, engine)
    if freed:  # the symptom of the bug report, wherever it showed
        when, request, block = freed[0]
        ck.fail(name, f"{case}, after {when}", "every block a running request reads held",
                f"block {block} free", EV["serve_freed"].format(request=request, block=block))
    if broken:
        when, wrong = broken[0]
        ck.fail(name, f"{case}, after {when}", "the pool's books in order", wrong,
                EV["serve_books"].format(what=wrong))
    if got != plain:
        at = next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b)
        ck.fail(name, case, f"the replies served without a prefix cache: {plain[at]}",
                got[at], EV["serve_text"].format(at=at))


# --- exercise 6 (design): a pool and a tier for a budget -----------------------------------
DESIGN_PAGE, POOL_COST, TIER_COST = 8, 4, 1
# Four users' messages, turn by turn (token ids; every user's different from the others').
USERS = [[[100 * u + 20 * t + k for k in range(n)] for t, n in enumerate(lengths)]
         for u, lengths in enumerate(([20, 10, 10, 10], [24, 8, 12, 8], [16, 12, 8, 12],
                                      [20, 12, 12, 8]))]
DESIGN_REPLY = 3
# (budget, the most prefill positions to compute, one choice that meets it)
DESIGN_CASES = [(96, 230, (12, 40)), (120, 360, (30, 0)), (40, 640, (10, 0)), (80, 260, (12, 32))]


@functools.cache
def served_positions(num_blocks: int, tier_blocks: int) -> int | None:
    """Prefill positions the four users' turns compute with this pool and tier (None: the
    engine refuses the pool, too small for one request alone)."""
    setting = Radix(tier_blocks=tier_blocks) if tier_blocks else Radix()
    try:
        engine = Engine(_model(), num_blocks, page_size=DESIGN_PAGE, prefix_caching=setting)
        users = [Session(engine) for _ in USERS]
        computed = 0
        with torch.inference_mode():
            for t in range(len(USERS[0])):
                turn(users, [u[t] for u in USERS], DESIGN_REPLY)
                computed += sum(u.last.stats.prompt_len - u.last.stats.reused for u in users)
    except ValueError:
        return None
    return computed


@ck.one_thread
@ck.guarded
def check_choose_sizes(choose_sizes) -> None:
    """choose_sizes(budget, target) -> (num_blocks, tier_blocks), measured by the engine."""
    name = "choose_sizes"
    for budget, target, (example_pool, example_tier) in DESIGN_CASES:
        case = (f"budget={budget} (a pool block costs {POOL_COST}, a tier block {TIER_COST}), "
                f"target={target} prefill positions at most")
        got = ck.call(name, case, choose_sizes, budget, target)
        pair = ck.int_list(got)
        if pair is None or len(pair) != 2 or min(pair) < 0:
            ck.fail(name, case, "(num_blocks, tier_blocks), two ints", got,
                    DS["not_pair"] + ck.FORGOT * (got is None))
        pool, tier = pair
        cost = POOL_COST * pool + TIER_COST * tier
        if cost > budget:
            ck.fail(name, case, f"a cost of at most {budget}",
                    f"{POOL_COST}·{pool} + {TIER_COST}·{tier} = {cost}",
                    DS["tier_free"] if POOL_COST * pool <= budget else DS["over_budget"])
        measured = served_positions(pool, tier)
        if measured is None:
            ck.fail(name, case, "a pool the engine accepts", f"num_blocks={pool}",
                    DS["too_small"])
        if measured > target:
            hint = (DS["all_pool"] if tier == 0 and example_tier else DS["small_pool"]
                    if pool < example_pool else DS["otherwise"])
            ck.fail(name, case, f"at most {target} positions computed (num_blocks="
                    f"{example_pool}, tier_blocks={example_tier} computes "
                    f"{served_positions(example_pool, example_tier)})",
                    f"{measured} with num_blocks={pool}, tier_blocks={tier}", hint)
    ck.passed(name, len(DESIGN_CASES))


EXERCISES = (MATCH, SPLIT)
