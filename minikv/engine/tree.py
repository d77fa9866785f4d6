"""A token tree: several guesses for the next tokens, verified in ONE target pass.

A chain proposes one continuation; a tree proposes several that share their prefixes:

    root (the last committed token)          node  token  parent  depth
     ├── " the" (0)                             0   " the"   -1      1
     │    ├── " cat" (2)                        1   " a"     -1      1
     │    └── " dog" (3)                        2   " cat"    0      2
     └── " a" (1)                               3   " dog"    0      2

`parents[i]` is node i's parent (-1: the root); a parent comes before its children, so
the nodes are in the order they are fed. The pass sees the nodes side by side; two
things make each one read as if it were the only continuation:

- its position is the root's plus its depth (siblings share one), and
- its mask lets it see the cached positions, its ancestors and itself, never a sibling's
  branch.

A chain is the tree whose every parent is the node before."""
from __future__ import annotations

import torch

from .attention import sdpa
from .validate import int_at_least


def check_parents(parents: list[int], n: int) -> None:
    """Raise unless every node's parent is -1 (the root) or an earlier node."""
    if not isinstance(parents, (list, tuple)) or len(parents) != n:
        raise ValueError(f"parents must be a list of {n} ints (one per proposed token)")
    for i, parent in enumerate(parents):
        int_at_least(f"parents[{i}]", parent, -1, " (-1: the root, or an earlier node)",
                     i)


def depths(parents: list[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def children(parents: list[int]) -> dict[int, list[int]]:
    """node (-1: the root) -> its children, in order."""
    kids: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        kids.setdefault(parent, []).append(i)
        kids.setdefault(i, [])
    return kids


def is_chain(parents: list[int]) -> bool:
    return list(parents) == list(range(-1, len(parents) - 1))


def tree_positions(parents: list[int], root_position: int) -> list[int]:
    """The position of each node: the root's plus its depth."""
    return [root_position + d for d in depths(parents)]


def tree_mask(parents: list[int], prefix: int = 1) -> torch.Tensor:
    """(prefix + n, prefix + n) booleans for a pass over `prefix` committed rows (the
    last one the root) and then the n nodes: the committed rows are causal among
    themselves; node i sees every committed row, its ancestors and itself."""
    n = len(parents)
    mask = torch.ones(prefix + n, prefix + n, dtype=torch.bool).tril()
    mask[prefix:, prefix:] = False
    for i, parent in enumerate(parents):
        row = prefix + i
        if parent >= 0:  # an ancestor's row already holds its own ancestors
            mask[row, prefix:row] = mask[prefix + parent, prefix:row]
        mask[row, row] = True
    return mask


def tree_attention(mask: torch.Tensor):
    """Attention for a pass whose T rows follow L - T cached keys: every row sees the
    cached keys, and among its own pass what `mask` (T, T) allows."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T, L = q.size(-2), k.size(-2)
        full = torch.ones(T, L, dtype=torch.bool, device=q.device)
        full[:, L - T:] = mask.to(q.device)
        return sdpa(q, k, v, attn_mask=full)
    return attend
