"""Chapter 11's checkers: solutions and other right ways pass, stubs go through, each wrong answer
gets its hint (the tables' named mistakes in test_checks_table.py); the cases are sound."""
import re

import pytest
import torch

from minikv.course.checks import CheckFailed, ch11
from minikv.engine.radix import TREE, Node, RadixTree

from conftest import stub


def match_length(root, tokens):
    node, pos = root, 0
    while pos < len(tokens) and tokens[pos] in node.children:
        child = node.children[tokens[pos]]
        k = 0
        while k < len(child.tokens) and pos + k < len(tokens) and \
                child.tokens[k] == tokens[pos + k]:
            k += 1
        pos += k
        if k < len(child.tokens):
            break
        node = child
    return pos


def match_recursive(node, tokens):
    child = node.children.get(tokens[0]) if tokens else None
    if child is None:
        return 0
    k = next((i for i, (a, b) in enumerate(zip(child.tokens, tokens)) if a != b),
             min(len(child.tokens), len(tokens)))
    return k + (match_recursive(child, tokens[k:]) if k == len(child.tokens) else 0)


def inserter(split=True, prefix_split=True, start=lambda child, k: child.start + k,
             repoint=True, new_twice=False):
    """The solution, with any of its steps replaceable by a wrong one."""
    def insert(root, tokens):
        node, pos = root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or (new_twice and pos == 0 and child.tokens == tokens):
                node.children[tokens[pos]] = Node(list(tokens[pos:]), pos, node, [])
                return
            k = 0
            while k < len(child.tokens) and pos + k < len(tokens) and \
                    child.tokens[k] == tokens[pos + k]:
                k += 1
            if k < len(child.tokens) and not split:
                node.children[tokens[pos]] = Node(list(tokens[pos:]), pos, node, [])
                return
            if k < len(child.tokens) and (prefix_split or pos + k < len(tokens)):
                head = Node(child.tokens[:k], child.start, node, [])
                child.tokens, child.start = child.tokens[k:], start(child, k)
                if repoint:
                    child.parent = head
                head.children[child.tokens[0]] = child
                node.children[head.tokens[0]] = head
                child = head
            elif k < len(child.tokens):
                return
            node, pos = child, pos + k
    return insert


insert = inserter()


def predict_reused():
    return {("turn 2", "tree"): 10, ("turn 2", "hashed"): 8, ("regenerated", "tree"): 15,
            ("regenerated", "hashed"): 12, ("edited", "tree"): 13, ("edited", "hashed"): 12}


def _predict(**changes):
    names = {"t2": "turn 2", "re": "regenerated", "ed": "edited"}
    return lambda: {**predict_reused(), **{(names[k[:2]], "tree" if k[2:] == "tree" else
                                            "hashed"): v for k, v in changes.items()}}


def evictor(release=True, locks=True, use_spare=True, leaves=True, count_freed=True, twice=False,
            count=True):
    """FixedRadixTree, with any of its steps replaceable by a wrong one."""
    class Tree(ch11.BuggyRadixTree):
        def evict(self, n, spare=None, locked=False):
            keep = {node for node, _ in spare.found} if spare and use_spare else set()
            before, released = self.pool.n_free, 0
            while (self.pool.n_free - before if count_freed else released) < n:
                found = [x for x in self.nodes() if (not x.children or not leaves)
                         and x not in keep and (locked or not x.locks or not locks)]
                if not found:
                    break
                victim = min(found, key=lambda x: x.used)
                for block in victim.blocks:
                    if release:
                        self.pool.release(block, TREE)
                        if twice:
                            self.pool.release(block, TREE)
                    else:
                        self.pool.ref[block] = 0
                        self.pool.free.append(block)
                    released += 1
                if victim.tokens[0] in victim.parent.children:
                    del victim.parent.children[victim.tokens[0]]
                self.counts["evicted"] += len(victim.blocks) * count
            return self.pool.n_free - before if count_freed else released
    return Tree


FixedRadixTree = evictor()


def choose_sizes(budget, target):
    for pool in range(10, budget // 4 + 1):
        tier = budget - 4 * pool
        if ch11.served_positions(pool, tier) <= target:
            return pool, tier
    return budget // 4, 0


CODE = {ch11.check_insert_sequence: insert, ch11.check_predict_reused: predict_reused,
        ch11.check_evict: FixedRadixTree, ch11.check_choose_sizes: choose_sizes}
RIGHT = [
    (ch11.check_match_length, lambda root, tokens: match_recursive(root, list(tokens))),
    (ch11.check_insert_sequence, inserter(start=lambda child, k: child.parent.start + len(
        child.parent.tokens) + k if child.parent.tokens else k)),
    (ch11.check_choose_sizes, lambda budget, target: [c for b, t, c in ch11.DESIGN_CASES
                                                      if (b, t) == (budget, target)][0]),
]
MISTAKES = {  # checker: [(wrong answer, a fragment of the hint it must get)]
    ch11.check_insert_sequence: [
        (inserter(split=False), "split the edge"),
        (inserter(prefix_split=False), "a node ending where each inserted sequence ends"),
        (inserter(start=lambda child, k: child.start), "a node's start is the position"),
        (inserter(repoint=False), "a node's parent must be"),
        (lambda root, tokens: root.children.update({0: Node(list(tokens), 0, root, [])}),
         "keyed by their edge's FIRST token"),
        (lambda root, tokens: RadixTree.insert(ch11.engine_tree([]), tokens, []),
         "called minikv's own")],
    ch11.check_predict_reused: [
        (_predict(t2tree=11), "never fed"), (_predict(t2tree=8), "the first message only"),
        (_predict(t2tree=8), "token by token"), (_predict(retree=16), "computed again"),
        (_predict(retree=10), "rewinding forgets turns"),
        (_predict(edtree=12), "the match goes on into the old message"),
        (_predict(t2hashed=10), "never findable"), (_predict(t2hashed=4), "being matched"),
        (_predict(rehashed=8), "was published when it was admitted"),
        (_predict(rehashed=16), "ends on a block"),
        (_predict(edhashed=13), "differ in one position"),
        (_predict(edhashed=8), "still found"), (_predict(edhashed=16), "ends on a block"),
        (_predict(t2tree=10.0), "positions come whole"),
        (lambda: {"turn 2": 11}, "one prediction per"),
        (lambda: ch11.measure_reused(), "a prediction is made before the measurement")],
    ch11.check_evict: [
        (ch11.BuggyRadixTree, "running request still reads"),
        (evictor(release=False), "another node still lists"),
        (evictor(locks=False), "a leaf that a running request reads"),
        (evictor(use_spare=False), "spare hit"),
        (evictor(leaves=False), "only leaves go"),
        (evictor(release=False, locks=False), "running request still reads"),
        (evictor(count_freed=False), "return the blocks actually freed"),
        (evictor(twice=True), "released twice"),
        (evictor(count=False), "count what you evict"),
        (type("ByTheEngine", (ch11.BuggyRadixTree,),
              {"evict": lambda self, n, spare=None, locked=False:
               RadixTree.evict(self, n, spare, locked)}), "called minikv's own"),
        (type("NotATree", (), {}), "a subclass of RadixTree")],
    ch11.check_choose_sizes: [
        (lambda budget, target: (budget // 4, 0), "whole budget in the pool"),
        (lambda budget, target: (10, budget - 40), "this small"),
        (lambda budget, target: (budget // 4, 40), "tier blocks cost too"),
        (lambda budget, target: (budget, 0), "4 per pool block"),
        (lambda budget, target: (4, 0), "the engine refuses this pool"),
        (lambda budget, target: None, "forget to return"),
        (lambda budget, target: (12.0, 3), "two ints")],
}
WRONG = [(checker, wrong, fragment) for checker, pairs in MISTAKES.items()
         for wrong, fragment in pairs]


@pytest.mark.parametrize("checker, solution", CODE.items(), ids=lambda v: v.__name__)
def test_the_solution_passes_and_leaves_the_random_state(checker, solution, capsys):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    checker(solution)
    assert torch.equal(before, torch.random.get_rng_state())
    assert re.search(r"✓ \w+: all \d+ cases pass\n$", capsys.readouterr().out)
    with pytest.raises(NotImplementedError):
        checker(type("Stub", (ch11.BuggyRadixTree,), {"evict": stub})
                if checker is ch11.check_evict else stub)


@pytest.mark.parametrize("checker, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_other_right_ways_pass(checker, right, capsys):
    checker(right)
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("checker, wrong, fragment", WRONG, ids=[
    f"{c.__name__[6:]}-{i}" for i, (c, _, _) in enumerate(WRONG)])
def test_a_wrong_answer_is_rejected_with_its_mistake_named(checker, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        checker(wrong)


# --- the checkers' cases are sound ----------------------------------------------------------

def test_the_buggy_eviction_frees_a_block_a_running_request_reads():
    """The serving case reproduces the bug report: the notebook's eviction puts a block on the
    free list while a running request's table lists it."""
    with pytest.raises(CheckFailed, match=r"request \d+'s table lists block \d+"):
        ch11._check_evict_serving("evict", ch11.BuggyRadixTree)


def test_every_design_case_has_the_answer_it_shows_and_needs_a_tier_or_not():
    for budget, target, (pool, tier) in ch11.DESIGN_CASES:
        assert 4 * pool + tier <= budget and ch11.served_positions(pool, tier) <= target
    needs = [ch11.served_positions(budget // 4, 0) > target
             for budget, target, _ in ch11.DESIGN_CASES]
    assert any(needs) and not all(needs)  # the pool alone is enough for some, not all


def test_the_predicted_counts_follow_the_rules_the_hints_state():
    measured = ch11.measure_reused()
    history = len(ch11.FIRST) + ch11.REPLY
    assert measured["turn 2", "tree"] == history - 1
    assert measured["regenerated", "tree"] == history + len(ch11.SECOND) - 1
    assert measured["edited", "tree"] == history + 2  # two tokens of the old message agree
    assert measured["turn 2", "hashed"] == len(ch11.FIRST)  # both of its full blocks
    assert measured["regenerated", "hashed"] == measured["regenerated", "tree"] // 4 * 4
    assert measured == predict_reused()
