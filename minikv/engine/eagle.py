"""A draft that reads the target's own features (EAGLE, Li et al. 2024), proposing a
chain or a token tree, verified by the same round loop (`speculate`) as every other
proposer.

A draft model starts from the tokens alone and must rebuild, in its few layers, what the
target already knows. The head starts from the target's last hidden state f_i (what its
lm_head reads) and the next token's embedding, and predicts the next hidden state:

    f̂_{i+1} = Block(fc([f_i ; wte(x_{i+1})]))     logits_{i+2} = lm_head(f̂_{i+1})

so one small block, reusing the target's embedding and lm_head, does the draft's work.
The target's features come free with each verify pass; past the committed tokens the
head feeds on its own predictions."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from .attention import masked_attention
from .cache import KVCache, upload
from .config import GPTConfig
from .model import Block, causal_attention
from .records import GenerationOutput, TraceEvent
from .sampling import SamplingParams
from .speculative import Proposal, Proposer, scores, speculate
from .tree import children
from .validate import check_model, int_at_least


class FeatureHead(nn.Module):
    """fc: [feature ; embedding] (2C) -> C, then one transformer block of the target's
    width. No position embedding: the target's features already carry their positions."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig) or config.n_layer != 1:
            raise ValueError("a FeatureHead takes its target's GPTConfig with "
                             "n_layer=1: FeatureHead.config_for(target)")
        self.config = config
        self.fc = nn.Linear(2 * config.n_embd, config.n_embd, bias=config.bias)
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleList([Block(config)])))

    @staticmethod
    def config_for(target) -> GPTConfig:
        return replace(target.config, n_layer=1)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, cache=None,
                attention=causal_attention) -> torch.Tensor:
        """(B, T, C) features f_i, embeddings of x_{i+1} -> predicted f_{i+1}."""
        x = self.fc(torch.cat([features, embeddings], dim=-1))
        return self.transformer.h[0](x, cache, 0, attention)


class FeatureProposer(Proposer):
    """Proposes with a FeatureHead, from the target's features, which every target pass
    hands it (`take_features`: the round loop's verifier and the server's passes do). With
    `tree=(width, branch)`, a token tree: every node it grows gets `branch` children (the
    head's top ones when greedy; independent draws from its q when sampling, as the tree's
    rejection rule needs), and at each depth the `width` nodes with the highest draft
    probability of their whole path grow."""
    wants_features = True

    def __init__(self, target, head: FeatureHead, sampling: SamplingParams | None = None,
                 generator: torch.Generator | None = None, tree: tuple[int, int] | None = None):
        _check_head(target, head, tree)
        self.target, self.head = target, head
        self.sampling = sampling or SamplingParams()
        self.generator = generator or torch.Generator(target.device)
        self.tree = tree
        self.cache = KVCache.for_model(head)  # between rounds: 0 .. len(seq) - 2
        self.features = torch.zeros(target.config.block_size, target.config.n_embd,
                                    device=target.device, dtype=target.dtype)
        self.last: tuple[int, torch.Tensor] | None = None  # the target's last pass: start, f
        self.last_tree: tuple[list[int], list[int]] | None = None  # tokens, parents

    def take_features(self, start: int, features: torch.Tensor) -> None:
        self.last = (start, features)

    def verify(self, rows: list[int], cache: KVCache, positions: list[int] | None = None,
               attention=causal_attention) -> torch.Tensor:
        """The target's pass, its features handed to this proposer: speculative.scores."""
        return scores(self.target, rows, cache, positions, attention, proposer=self)

    def max_tokens(self, k: int) -> int:
        return k if self.tree is None else tree_size(k, *self.tree)

    def fresh(self) -> FeatureProposer:
        return FeatureProposer(self.target, self.head, self.sampling,
                               torch.Generator(self.target.device), self.tree)

    def propose(self, seq: list[int], k: int) -> Proposal:
        # 1. Keep the target's features of the tokens committed since the last round.
        self._take_features(seq)
        if k == 0:
            self.last_tree = None
            return Proposal([])
        # 2. Feed the head what it has not seen with the target's true features: its last
        #    output predicts the feature at the last committed token.
        n, m = len(seq), self.cache.get_seq_length()
        wte = self.target.transformer.wte
        pending = upload(seq[m + 1:n], self.target.device)
        feats = self.features[m:n - 1][None]
        h = self.head(feats, wte(pending)[None], self.cache)[0, -1]
        events = [self._event(seq[m + 1:n], m)]
        # 3. Draft from there, on the head's own predictions; then forget those.
        if self.tree is None:
            proposal = self._chain(h, k, events)
        else:
            proposal = self._grow_tree(h, k, events)
        self.cache.crop(n - 1)
        self.last_tree = None if proposal.parents is None else (proposal.tokens,
                                                                 proposal.parents)
        return proposal

    def _take_features(self, seq: list[int]) -> None:
        """The target's features for positions up to len(seq) - 2, from its last pass:
        rows in position order, or the committed rows then the accepted path of the last
        tree."""
        start, f = self.last
        n = len(seq)
        if self.last_tree is None:
            self.features[start:n - 1] = f[:n - 1 - start]
            return
        tokens, parents = self.last_tree
        prefix = f.shape[0] - len(tokens)  # the committed rows fed before the tree
        self.features[start:start + prefix] = f[:prefix]
        kids, node, pos = children(parents), -1, start + prefix
        while pos < n - 1:  # walk the path the verdict took: it committed seq[pos]
            node = next(c for c in kids[node] if tokens[c] == seq[pos])
            self.features[pos] = f[prefix + node]
            pos += 1

    def _choose(self, h: torch.Tensor, how_many: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens to follow a node whose predicted feature is h (on the device), and q."""
        logits = self.target.lm_head(h)
        if self.sampling.greedy:
            q = torch.softmax(logits.float(), dim=-1)
            return torch.topk(q, how_many).indices, q
        q = self.sampling.probabilities(logits)
        return torch.multinomial(q, how_many, replacement=True, generator=self.generator), q

    def _chain(self, h: torch.Tensor, k: int, events: list[TraceEvent]) -> Proposal:
        chosen, probs, starts = [], [], []  # the guesses stay on the device until the end
        for _ in range(k):
            token, q = self._choose(h, 1)
            chosen.append(token)
            probs.append(q)
            if len(chosen) < k:  # the next feature, from this guess
                starts.append(self.cache.get_seq_length())
                emb = self.target.transformer.wte(token)
                h = self.head(h[None, None], emb[None], self.cache)[0, -1]
        tokens = torch.cat(chosen).tolist()  # the round's one read back
        events += [self._event([t], start) for t, start in zip(tokens, starts)]
        probs = None if self.sampling.greedy else torch.stack(probs)
        return Proposal(tokens, probs, events)

    def _grow_tree(self, h_root: torch.Tensor, k: int, events: list) -> Proposal:
        width, branch = self.tree
        tokens, parents, probs = [], [], []
        committed = self.cache.get_seq_length()
        slot: dict[int, int] = {}  # node -> the head cache slot where it was fed
        feature = {-1: h_root}     # node -> its predicted feature
        frontier = [(-1, 0.0)]     # (node, log q of its whole path)
        for depth in range(1, k + 1):
            # 1. Every growing node gets `branch` children, read back once a depth.
            drawn = [self._choose(feature[node], branch) for node, _ in frontier]
            picks = torch.cat([p for p, _ in drawn]).tolist()
            log_q = torch.cat([torch.log(q[p]) for p, q in drawn]).tolist()
            born = []
            for j, (t, lq) in enumerate(zip(picks, log_q)):
                (node, score), q = frontier[j // branch], drawn[j // branch][1]
                tokens.append(t)
                parents.append(node)
                probs.append(q)
                born.append((len(tokens) - 1, score + lq))
            if depth == k:
                break
            # 2. The `width` most likely paths grow: one head pass over their ends, each
            #    seeing the committed positions, its ancestors and itself.
            frontier = sorted(born, key=lambda b: -b[1])[:width]
            grow = [node for node, _ in frontier]
            start = self.cache.get_seq_length()
            slot.update({node: start + j for j, node in enumerate(grow)})
            mask = self._mask(grow, parents, slot, committed)
            feats = torch.stack([feature[parents[node]] for node in grow])
            emb = self.target.transformer.wte(upload([tokens[n] for n in grow], h_root.device))
            out = self.head(feats[None], emb[None], self.cache,
                            lambda q_, k_, v_: masked_attention(q_, k_, v_, mask))[0]
            feature.update({node: out[j] for j, node in enumerate(grow)})
            events.append(self._event([tokens[n] for n in grow], start))
        sure = self.sampling.greedy  # top-k children are sure: judged by matching
        return Proposal(tokens, None if sure else torch.stack(probs), events, parents)

    def _mask(self, rows: list[int], parents: list[int], slot: dict[int, int],
              committed: int) -> torch.Tensor:
        """(rows, cache length after the pass) booleans: row j (a node) sees the
        committed positions, the slots of its ancestors, and its own slot."""
        end = max(slot[n] for n in rows) + 1
        mask = [[i < committed for i in range(end)] for _ in rows]  # on the host: one upload
        for j, node in enumerate(rows):
            while node >= 0:
                mask[j][slot[node]] = True
                node = parents[node]
        return upload(mask, self.target.device, torch.bool)

    def _event(self, fed: list[int], start: int) -> TraceEvent:
        n = len(fed)
        return TraceEvent(kind="draft", step=0, input_ids=tuple(fed), kv_computed=n,
                          positions=tuple(range(start, start + n)),
                          cache_len_before=start, cache_len_after=start + n)


def tree_size(gamma: int, width: int, branch: int) -> int:
    """The most tokens a FeatureProposer tree holds: `branch` at depth 1, then `width`
    nodes growing `branch` children at each further depth."""
    return branch + (gamma - 1) * width * branch


def feature_generate(target, head: FeatureHead, ids, max_new_tokens: int, gamma: int = 4,
                     temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
                     eos_id: int | None = None, *, tree: tuple[int, int] | None = None,
                     trace: bool = False) -> GenerationOutput:
    """Generate with `head` proposing γ tokens a round (a tree γ deep with
    `tree=(width, branch)`) and `target` verifying them in one pass. Greedy output is
    exactly the target's own; sampled output follows the target's distribution."""
    sp = SamplingParams(temperature, top_k, seed, eos_id)
    int_at_least("gamma", gamma)
    generator = torch.Generator(device=target.device).manual_seed(sp.seed)
    propose = FeatureProposer(target, head, sp, generator, tree)
    return speculate(target, ids, max_new_tokens, sp, propose, gamma=gamma,
                     generator=generator, tree_size=propose.max_tokens(gamma) if tree else None,
                     trace=trace)


def _check_head(target, head, tree) -> None:
    check_model("target", target)
    if not isinstance(head, FeatureHead) or head.config != FeatureHead.config_for(target):
        raise ValueError("head must be a FeatureHead made for this target: "
                         "minikv.load_feature_head(target), or "
                         "FeatureHead(FeatureHead.config_for(target))")
    if head.device != target.device or head.dtype != target.dtype:
        raise ValueError("the head must be on the target's device, in its dtype: "
                         "head.to(target.device, target.dtype)")
    if tree is not None:
        if not (isinstance(tree, tuple) and len(tree) == 2):
            raise ValueError("tree must be (width, branch), e.g. (2, 2); None: a chain")
        int_at_least("tree width", tree[0])
        int_at_least("tree branch", tree[1], hint=" (children of each growing node)",
                     below=target.config.vocab_size + 1)
