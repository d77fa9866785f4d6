"""The cache across requests: what a finished request computed stays, findable by any
later prompt that begins the same way (a conversation's next turn, an agent's next
branch). Two prefix caches sit behind one seam, `PrefixCache`, that the scheduler asks:

- `HashedBlocks` (chapter 06, vLLM's automatic prefix caching): full blocks of a prompt,
  found by hash; a finished request's blocks stay findable until they are reallocated.
- `RadixTree` (chapter 11, SGLang's RadixAttention, Zheng et al. 2023, arXiv
  2312.07104): a tree of token prefixes over the pool's blocks, matched token by token;
  the tree holds its blocks (a reference each), so nothing it keeps is reallocated
  until it lets go of it: `evict` frees the least recently used (or least hit) leaves
  no running request reads, copying them to a second, slower pool (`Radix(tier_blocks=)`:
  SGLang's HiCache, vLLM's offloading) when there is one, from which a later hit copies
  them back instead of computing them again.

A node is an edge of tokens, positions start .. start + len - 1, and the pool blocks
that hold them: position p lives in blocks[p // page_size - start // page_size]. A
block that an edge's first position shares with its parent's last is in both (a
reference each). A match may end inside a block: the request shares it, and its first
write copies it (BlockPool.reserve's copy-on-write), one block copied for the positions
it would otherwise compute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .paged import BlockPool, BlockTable
from .validate import int_at_least, one_of

TREE = -1  # the owner the pool's log names for the tree's references


@dataclass(frozen=True)
class Radix:
    """serve(prefix_caching=Radix(...)): the tree, what it evicts first ("lru": the
    least recently used leaf; "hits": the least often matched, then the least recent),
    and a second tier of `tier_blocks` blocks (0: none) in host memory, or memory-mapped
    from `tier_file`."""
    evict: str = "lru"
    tier_blocks: int = 0
    tier_file: str | None = None

    def __post_init__(self):
        one_of("evict", self.evict, ("lru", "hits"))
        int_at_least("tier_blocks", self.tier_blocks, 0, " (blocks in the second tier)")
        if self.tier_file is not None and not isinstance(self.tier_file, str):
            raise TypeError(f"tier_file must be a path (str), not {self.tier_file!r:.30}")


@dataclass
class Hit:
    """What a prompt finds, the pool unchanged: `length` positions whose K/V are cached,
    in `n_blocks` table entries, of which `taken` need a free block (a hashed block
    already freed, a tiered block copied back, a partial last block copied on write)."""
    length: int = 0
    n_blocks: int = 0
    taken: int = 0
    found: list = field(default_factory=list)  # the cache's own: blocks, or (node, k)s


class PrefixCache:
    """The seam: what the scheduler asks of a prefix cache (this one caches nothing).
    `lookup` a waiting request's prefix; `take` it into its new table; `publish` its
    first `upto` positions; `leave` when it finishes or is preempted, before its blocks
    go back; `evict` blocks nobody runs on when the pool runs short. What it keeps of a
    running request, it keeps by the request's index (unique while the request lives)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool

    def lookup(self, s) -> Hit:
        return Hit()

    def take(self, s, hit: Hit) -> None:
        """`s.table` starts as the hit: its blocks shared, its positions counted."""
        for block in hit.found:
            self.pool.share(block, s.index)
        s.table.blocks, s.table.length = list(hit.found), hit.length

    def publish(self, s, upto: int) -> None:
        pass

    def leave(self, s) -> None:
        pass

    def evict(self, n: int, spare: Hit | None = None, locked: bool = False) -> int:
        return 0


class HashedBlocks(PrefixCache):
    """Chapter 06's cache: a prompt's full blocks by hash (BlockPool.cached_prefix,
    BlockPool.publish); a freed block stays findable until it is reallocated."""

    def __init__(self, pool: BlockPool):
        super().__init__(pool)
        self.published: dict[int, int] = {}  # blocks of each running prompt findable

    def lookup(self, s) -> Hit:
        blocks = self.pool.cached_prefix(s.prompt)
        taken = sum(self.pool.ref[b] == 0 for b in blocks)  # free, K/V still there
        return Hit(len(blocks) * self.pool.page_size, len(blocks), taken, blocks)

    def publish(self, s, upto: int) -> None:
        full = min(len(s.prompt), upto) // self.pool.page_size
        if full > self.published.get(s.index, 0):  # new full blocks (chunks come one by one)
            self.pool.publish(s.prompt, s.table, upto)
            self.published[s.index] = full

    def leave(self, s) -> None:
        self.published.pop(s.index, None)


def prefix_cache(pool: BlockPool, setting: bool | Radix, cfg) -> PrefixCache:
    """The prefix cache serve(prefix_caching=setting) asks for: False, True or Radix()."""
    if isinstance(setting, Radix):
        return RadixTree(pool, setting, cfg)
    return HashedBlocks(pool) if setting else PrefixCache(pool)


def check_prefix_caching(setting) -> None:
    if not isinstance(setting, (bool, Radix)):
        raise TypeError(f"prefix_caching must be True, False or a minikv.Radix(), not "
                        f"{setting!r:.30}")


class Node:
    """An edge of the tree: `tokens` at positions start.., their `blocks` (in the pool,
    or in the tier when `tiered`), the running requests reading through it (`locks`),
    when it was last matched (`used`) and how often (`hits`)."""

    def __init__(self, tokens: list[int], start: int, parent: Node | None,
                 blocks: list[int]):
        self.tokens, self.start, self.parent, self.blocks = tokens, start, parent, blocks
        self.children: dict[int, Node] = {}
        self.tiered, self.locks, self.used, self.hits = False, 0, 0, 0

    def __repr__(self) -> str:
        where = "tier" if self.tiered else "pool"
        return f"Node({self.start}+{len(self.tokens)}, {where} {self.blocks}, locks={self.locks})"


class RadixTree(PrefixCache):
    """Chapter 11's cache: a radix tree of token prefixes over the pool (module doc)."""

    def __init__(self, pool: BlockPool, policy: Radix, cfg=None):
        super().__init__(pool)
        self.policy, self.root, self.clock = policy, Node([], 0, None, []), 0
        self.held: dict[int, tuple[Node | None, int]] = {}  # by request: its lock, positions in
        self.tier = None
        if policy.tier_blocks:
            self.tier = tier_pool(cfg, policy.tier_blocks, pool, policy.tier_file)
        # What it did, for the benchmark and the chapter: blocks moved and bytes copied.
        self.counts = dict(evicted=0, to_tier=0, from_tier=0, dropped=0, bytes_moved=0)

    # --- reading: the longest cached prefix -------------------------------------------
    def match(self, tokens: list[int]) -> list[tuple[Node, int]]:
        """The path of the longest prefix of `tokens` the tree holds: (node, how many of
        its positions match), the last one possibly partly."""
        path, node, pos = [], self.root, 0
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            k = common_length(child.tokens, tokens[pos:])
            path.append((child, k))
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return path

    def lookup(self, s) -> Hit:
        """Its prompt's (its tokens', after a preemption) cached positions, one left to
        compute for the logits that choose its next token (a full hit recomputes its
        last)."""
        path = self.match(s.tokens[: len(s.tokens) - 1])
        length, ps = sum(k for _, k in path), self.pool.page_size
        tiered = sum(len(node.blocks) for node, _ in path if node.tiered)
        return Hit(length, -(-length // ps), tiered + bool(length % ps), path)

    def take(self, s, hit: Hit) -> None:
        """Its table starts as the path's blocks (tiered ones copied back first), each
        shared; the path locked against eviction while it runs."""
        ps, blocks = self.pool.page_size, {}  # block index: block
        self.clock += 1
        for node, k in hit.found:
            if node.tiered:
                self.move(node, to_tier=False)
            node.used, node.hits = self.clock, node.hits + 1
            first = node.start // ps  # a block the parent's edge ends in: the child's holds both
            for i in range(first, (node.start + k - 1) // ps + 1):
                blocks[i] = node.blocks[i - first]
        super().take(s, Hit(hit.length, found=list(blocks.values())))
        self.relock(s, hit.found[-1][0] if hit.found else None, hit.length)

    def relock(self, s, node: Node | None, length: int = 0) -> None:
        """`s` now reads through `node` (and its ancestors) instead of what it locked,
        and the tree holds its first `length` positions."""
        old = self.held.pop(s.index, (None, 0))[0]
        for n, delta in ((old, -1), (node, 1)):
            while n not in (None, self.root):
                n.locks += delta
                n = n.parent
        if node is not None:
            self.held[s.index] = (node, length)

    # --- writing: insert on commit ----------------------------------------------------
    def insert(self, tokens: list[int], blocks: list[int]) -> Node:
        """Cache `tokens`, whose K/V `blocks` hold (a table's: position p in blocks[p //
        page_size]); the tree shares each block it keeps. Its path counts as used now (a
        request just computed it). The deepest node of them."""
        ps, node, pos = self.pool.page_size, self.root, 0
        self.clock += 1
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = Node(tokens[pos:], pos, node, blocks[pos // ps:(len(tokens) - 1) // ps + 1])
                child.used = self.clock
                for block in child.blocks:
                    self.pool.share(block, TREE)
                node.children[tokens[pos]] = child
                return child
            k = common_length(child.tokens, tokens[pos:])
            if k < len(child.tokens):
                child = self.split(child, k)
            child.used = self.clock
            if child.tiered:  # computed again: the request's blocks replace the tier's
                self.drop_blocks(child)
                child.blocks, child.tiered = blocks[pos // ps:(pos + k - 1) // ps + 1], False
                for block in child.blocks:
                    self.pool.share(block, TREE)
            node, pos = child, pos + k
        return node

    def split(self, child: Node, k: int) -> Node:
        """Cut `child`'s edge after k tokens: a new node above it holds the first k (and
        the blocks they live in; one both halves share gets a reference more)."""
        ps, store = self.pool.page_size, self.store(child)
        first, cut = child.start // ps, child.start + k
        head = Node(child.tokens[:k], child.start, child.parent,
                    child.blocks[:(cut - 1) // ps - first + 1])
        head.tiered, head.locks, head.used, head.hits = (child.tiered, child.locks,
                                                         child.used, child.hits)
        if cut % ps:  # the block holding the cut is in both halves
            store.share(child.blocks[cut // ps - first], TREE)
        child.tokens, child.start = child.tokens[k:], cut
        child.blocks = child.blocks[cut // ps - first:]
        child.parent, head.children = head, {child.tokens[0]: child}
        head.parent.children[head.tokens[0]] = head
        return head

    def publish(self, s, upto: int) -> None:
        """Its first `upto` positions, once computed, in whole blocks (its partly filled
        last block stays its own, so its next write copies nothing); `s` locks them."""
        full = min(upto, s.table.length) // self.pool.page_size * self.pool.page_size
        if not s.replay and full > self.held.get(s.index, (None, 0))[1]:
            self.relock(s, self.insert(s.tokens[:full], s.table.blocks), full)

    def leave(self, s) -> None:
        """All it computed, its partly filled last block too, stays in the tree."""
        if not s.replay and s.table.length:
            self.insert(s.tokens[:s.table.length], s.table.blocks)
        self.relock(s, None)

    # --- eviction and the second tier -------------------------------------------------
    def store(self, node: Node) -> BlockPool:
        return self.tier if node.tiered else self.pool

    def nodes(self) -> list[Node]:
        found, todo = [], list(self.root.children.values())
        while todo:
            found.append(node := todo.pop())
            todo += node.children.values()
        return found

    def evict(self, n: int, spare: Hit | None = None, locked: bool = False) -> int:
        """Free at least n pool blocks if it can: the leaves in the pool that nobody
        locks (nor `spare`, a hit about to be taken), in the policy's order, each moved
        to the tier when there is one, else dropped. With `locked`, the last resort of a
        pool too full for one request, leaves it locks too: the tree lets go of the
        blocks, the request still holds those it reads. The blocks it freed."""
        keep = {node for node, _ in spare.found} if spare else set()
        before = self.pool.n_free
        while self.pool.n_free - before < n:
            leaves = [x for x in self.nodes() if not x.tiered and (locked or not x.locks)
                      and x not in keep and all(c.tiered for c in x.children.values())]
            if not leaves:
                break
            # A heap would find it in log time (SGLang's); a scan reads more plainly.
            victim = min(leaves, key=lambda x: (x.hits, x.used) if self.policy.evict == "hits"
                         else x.used)
            self.counts["evicted"] += len(victim.blocks)
            if self.tier is not None and self.make_tier_room(len(victim.blocks), keep):
                self.move(victim, to_tier=True)
            else:
                self.remove(victim)
        return self.pool.n_free - before

    def make_tier_room(self, n: int, keep: set) -> bool:
        """Drop the tier's least recently used leaves until n of its blocks are free."""
        while self.tier.n_free < n:
            leaves = [x for x in self.nodes() if x.tiered and not x.children and x not in keep]
            if not leaves:
                return False
            oldest = min(leaves, key=lambda x: x.used)
            self.counts["dropped"] += len(oldest.blocks)
            self.remove(oldest)
        return True

    def move(self, node: Node, to_tier: bool) -> None:
        """Copy a node's blocks to the other tier and let go of the old ones."""
        src, dst = (self.pool, self.tier) if to_tier else (self.tier, self.pool)
        new = [dst.allocate(TREE) for _ in node.blocks]
        for a, b in ((src.keys, dst.keys), (src.values, dst.values)):
            for layer_src, layer_dst in zip(a, b):
                layer_dst[new] = layer_src[node.blocks].to(layer_dst.device)
        self.counts["to_tier" if to_tier else "from_tier"] += len(new)
        self.counts["bytes_moved"] += len(new) * block_bytes(self.pool)
        self.drop_blocks(node)
        node.blocks, node.tiered = new, to_tier

    def drop_blocks(self, node: Node) -> None:
        store = self.store(node)
        for block in node.blocks:
            store.release(block, TREE)

    def remove(self, node: Node) -> None:
        """A node out of the tree, with what hangs below it (on the tier), every block
        let go."""
        todo = [node]
        while todo:
            self.drop_blocks(n := todo.pop())
            todo += n.children.values()
        del node.parent.children[node.tokens[0]]

    # --- a session's K/V out of the tree and back (course/sessions.py writes the file) --
    def export(self, tokens: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """How many of `tokens`' first positions the tree holds, and their K/V, each
        (n_layer, kv_heads, positions, head_dim), read through the path's blocks."""
        path = self.match(tokens)
        tiered = sum(len(node.blocks) for node, _ in path if node.tiered)
        hit = Hit(sum(k for _, k in path), found=path)
        if self.pool.n_free < tiered:
            self.evict(tiered - self.pool.n_free, spare=hit)
        if self.pool.n_free < tiered:
            raise MemoryError(f"copying the session back from the tier takes {tiered} free "
                              "blocks: give the pool more blocks")
        s = _Reader()
        self.take(s, hit)
        try:
            ps, n = self.pool.page_size, s.table.length
            device = self.pool.keys[0].device
            block, slot = torch.tensor([[s.table.blocks[p // ps], p % ps] for p in range(n)],
                                       dtype=torch.long, device=device).view(-1, 2).T
            kv = [torch.stack([layer[block, :, slot].transpose(0, 1).cpu() for layer in layers])
                  for layers in (self.pool.keys, self.pool.values)]
        finally:
            self.pool.free_table(s.table)
            self.relock(s, None)
        return n, kv[0], kv[1]

    def restore(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> int:
        """Put K/V computed elsewhere (export's) for `tokens` in fresh blocks and insert
        them; MemoryError, the pool as it was, when it cannot hold them. Positions kept."""
        ps, n = self.pool.page_size, len(tokens)
        need = -(-n // ps)
        if self.pool.n_free < need:
            self.evict(need - self.pool.n_free)
        if self.pool.n_free < need:
            raise MemoryError(f"the pool cannot hold {n} positions ({need} blocks): "
                              "give it more blocks")
        s = _Reader()
        self.pool.reserve(s.table, n)
        for pool_layers, src in ((self.pool.keys, keys), (self.pool.values, values)):
            for layer, x in zip(pool_layers, src):
                for i, block in enumerate(s.table.blocks):
                    chunk = x[:, i * ps:(i + 1) * ps]  # (kv_heads, <= ps, head_dim)
                    layer[block, :, :chunk.shape[1]] = chunk.to(layer.device, layer.dtype)
        s.table.length = n
        self.insert(list(tokens), s.table.blocks)
        self.pool.free_table(s.table)  # the tree holds them now
        return n


class _Reader:
    """A table that is nobody's request (export, restore), locked as one would be."""

    def __init__(self):
        self.index, self.table, self.replay = TREE, BlockTable(TREE), False


def common_length(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def block_bytes(pool: BlockPool) -> int:
    """Bytes of one block, keys and values of every layer (MLA's values: none)."""
    per_layer = pool.keys[0][0].numel() + pool.values[0][0].numel()
    return len(pool.keys) * per_layer * pool.keys[0].element_size()


def tier_pool(cfg, num_blocks: int, pool: BlockPool, path: str | None = None) -> BlockPool:
    """The second tier: a pool like `pool` on the host (CPU) memory, or in a file mapped
    into memory (what a CPU has below RAM: the OS pages it to disk)."""
    tier = BlockPool(cfg, num_blocks, pool.page_size, device="cpu", dtype=pool.keys[0].dtype)
    if path is not None:  # every layer's keys, then every layer's values (MLA's: none)
        shapes = [(len(pool.keys), *t[0].shape) for t in (tier.keys, tier.values)]
        mapped = torch.from_file(path, shared=True, size=sum(map(math.prod, shapes)),
                                 dtype=tier.keys[0].dtype)
        keys, values = mapped.split([math.prod(shape) for shape in shapes])
        tier.keys, tier.values = list(keys.view(shapes[0])), list(values.view(shapes[1]))
    return tier
