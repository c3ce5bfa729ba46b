"""What a draft proposes and what the target decides, as plain data (`hippo.accept` has the rules).

A proposal is n draft tokens stored parent-first: token i continues the prefix followed by the path
to its parent `parents[i]` (< i; -1 = the prefix itself). A chain is the tree in which token i's parent
is i - 1 (`parents` None), so one rule verifies both. Notation: p = target, q = draft, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

#: a `hippo.sampling.TokenPolicy`: the target's logits processors, decoding mode and generator
TokenPolicy = Any


@attrs.frozen
class DraftProposal:
    """n draft tokens (a chain, or a token tree stored parent-first) and, when sampling, their laws."""

    tokens: torch.Tensor  # [n] long
    q: torch.Tensor | None = None  # [n, V] law each token was drawn from (None for greedy drafts)
    parents: torch.Tensor | None = None  # [n] long: parent of each token, -1 = the prefix; None = a chain

    def __attrs_post_init__(self):
        par = self.parents
        if par is not None and torch.equal(par.cpu(), torch.arange(par.shape[0]) - 1):
            object.__setattr__(self, "parents", None)  # a tree without siblings is a chain

    @property
    def chain(self) -> bool:
        return self.parents is None

    @property
    def size(self) -> int:
        """Draft tokens made (a round books them as drafted)."""
        return int(self.tokens.shape[0])

    def parent_list(self) -> list[int]:
        return list(range(-1, self.size - 1)) if self.parents is None else self.parents.tolist()

    def depths(self) -> torch.Tensor:  # [n], 1 for the children of the prefix
        if self.parents is None:
            return torch.arange(1, self.size + 1)
        d: list[int] = []
        for par in self.parents.tolist():
            d.append(1 if par < 0 else d[par] + 1)
        return torch.tensor(d, dtype=torch.long)

    @property
    def depth(self) -> int:
        """The most draft tokens one round can accept; fewer accepted means a rejection."""
        if self.parents is None:  # a chain: its size, without reading a tensor
            return self.size
        return int(self.depths().max()) if self.size else 0

    def children(self) -> list[list[int]]:  # [n + 1] lists: entry 0 is the root, node i is entry i + 1
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, par in enumerate(self.parent_list()):
            out[par + 1].append(i)
        return out

    def path(self, node: int) -> list[int]:  # node indices from the root's child down to `node`
        parents, out = self.parent_list(), []
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out[::-1]

    def spine(self) -> list[int]:
        """Node indices of the first-child chain from the root: where a parallel draft continues."""
        if self.parents is None:
            return list(range(self.size))
        children, out, v = self.children(), [], -1
        while children[v + 1]:
            v = children[v + 1][0]
            out.append(v)
        return out

    def spine_tokens(self) -> torch.Tensor:  # [s]
        return self.tokens if self.parents is None else self.tokens[self.spine()]

    def ancestor_mask(self) -> torch.Tensor:  # [n, n] bool: [i, j] = node j is node i or one of its ancestors
        n, parents = self.size, self.parent_list()
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            if parents[i] >= 0:
                mask[i] |= mask[parents[i]]
        return mask

    def after(self, token: int) -> DraftProposal | None:
        """What this proposal drafted after `token` at its first position, re-rooted there: a chain's
        tokens after its first, where that was `token`; a tree's subtree under the child of the root
        that drafted `token`. None where it drafted `token` with nothing after it, or not at all (a
        continuation drafted beside p, once p emitted `token` where it starts)."""
        tokens = self.tokens.tolist()
        if self.parents is None:
            if self.size < 2 or tokens[0] != token:
                return None
            return DraftProposal(tokens=self.tokens[1:], q=None if self.q is None else self.q[1:])
        parents = self.parents.tolist()
        root = next((i for i, par in enumerate(parents) if par < 0 and tokens[i] == token), None)
        if root is None:
            return None
        index, keep, new_parents = {root: -1}, [], []  # old node -> new index (the root: the prefix)
        for i, par in enumerate(parents):  # parent-first: a node's parent is placed before it
            if par >= 0 and par in index:
                index[i] = len(keep)
                keep.append(i)
                new_parents.append(index[par])
        if not keep:
            return None
        nodes = torch.tensor(keep)
        return DraftProposal(
            tokens=self.tokens[nodes],
            q=None if self.q is None else self.q[nodes],
            parents=torch.tensor(new_parents, dtype=torch.long),
        )

    def truncate(self, n: int) -> DraftProposal:
        """The first n tokens (parent-first, so still a tree): what a drafting stopped early had made."""
        return DraftProposal(
            tokens=self.tokens[:n],
            q=None if self.q is None else self.q[:n],
            parents=None if self.parents is None else self.parents[:n],
        )

    def chunks(self, size: int) -> list[DraftProposal]:
        """A chain in consecutive pieces of at most `size` tokens, to verify one after the other
        without bonus tokens (a piece's last target row checks the next piece's first token).
        A tree is verified whole."""
        if size >= self.size or self.parents is not None:
            return [self]
        return [
            DraftProposal(
                tokens=self.tokens[i : i + size], q=None if self.q is None else self.q[i : i + size]
            )
            for i in range(0, self.size, size)
        ]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
        """The same proposal with `fn` applied to each tensor field (to host, to shared memory)."""
        changes = {
            a.name: fn(getattr(self, a.name))
            for a in attrs.fields(type(self))
            if isinstance(getattr(self, a.name), torch.Tensor)
        }
        return attrs.evolve(self, **changes)

    def cpu(self) -> DraftProposal:
        return self.map_tensors(lambda t: t.cpu())


@attrs.frozen
class Verdict:
    """A rule's decision: the accepted `path` (node indices, root first), then `next_token`.

    `next_token` is the recovered or bonus token; None when a round dropped its bonus token.
    """

    path: tuple[int, ...]
    next_token: int | None

    @property
    def n_accepted(self) -> int:
        return len(self.path)
