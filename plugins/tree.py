"""Tree drafting as a plug-in: a `tree` drafter and a `serial_tree` scheduler.

Notation: p = target, q = draft, γ = maximum tree depth this round, V = vocabulary, n = tree nodes.

Drafting (`TreeDrafter`)
    The draft expands a token tree below the prefix. Node 0..n-1 are stored parent-first
    (`parents[i] < i`, -1 = child of the root, i.e. of the prefix's last token); siblings are kept in
    the order they were drawn. Two shapes:
    - static (`paths`): a fixed list of rank paths, e.g. (0, 1) = "second child of the first child"
      (EAGLE / SpecVLM-style trees); the list is closed under prefixes and lower sibling ranks;
    - dynamic (`budget` > 0): best-first expansion by cumulative draft probability, up to `budget`
      nodes, at most `top_k` children per node and depth γ.
    Greedy: the children of a node are the draft's top-k tokens. Sampling: the children are drawn
    one by one *without replacement*: child j ~ q_j = norm(q with children 1..j-1 zeroed); q_j is
    recorded as the proposal's `q[j]` (the exact law the child was drawn from). The draft computes each node's
    q by `session.sync(prefix + path)` (plain forwards + rollbacks, depth-first for static trees),
    so the draft's cache is brought back to the accepted prefix by the next round's `sync`.

Verification
    A tree is a `hippo.proposal.DraftProposal` with `parents`. The core verifies it like a chain: the
    target scores every node in one masked pass (`ModelSession.score_proposal`), the stock rules of
    `hippo.accept` walk it from the root (greedy: the longest argmax path; sampling: recursive
    rejection sampling over siblings), and the session keeps the accepted path (`keep_path`, a KV
    cache compaction). The parallel schedules continue drafting after the tree's first-child chain
    (its spine) while the target verifies. `serial_tree` is `serial` under the name this plugin has
    always registered.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hippo import hookimpl
from hippo.errors import ConfigError
from hippo.interfaces import Drafter, ModelSession
from hippo.plugins.schedulers import SerialScheduler
from hippo.proposal import DraftProposal
from hippo.sampling import TokenPolicy
from hippo.validators import positive_int

# ---- the drafter ------------------------------------------------------------------------------

#: A 25-node static tree (depth 5), in the spirit of EAGLE/SpecVLM's: wide near the root, narrow deep.
DEFAULT_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 2, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0),
)  # fmt: skip


def _as_paths(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(r) for r in p) for p in value)


def close_paths(paths: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Add every prefix and every lower-ranked sibling, so each node's parent and elder siblings exist."""
    out: set[tuple[int, ...]] = set()
    for p in paths:
        if not p or any(r < 0 for r in p):
            raise ConfigError(f"tree: a path must be a non-empty tuple of ranks >= 0, got {p!r}")
        for d in range(1, len(p) + 1):
            for r in range(p[d - 1] + 1):
                out.add((*p[: d - 1], r))
    return tuple(sorted(out))


class TreeDrafter(Drafter):
    """A token tree from the draft's top-k (greedy) or draws without replacement (sampling)."""

    @attrs.frozen
    class Config:
        paths: tuple[tuple[int, ...], ...] = attrs.field(default=DEFAULT_PATHS, converter=_as_paths)
        budget: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # > 0: dynamic tree
        top_k: int = attrs.field(default=4, validator=positive_int)  # dynamic: children per node
        max_depth: int = attrs.field(default=8, validator=positive_int)

    def __init__(self, config: Any = None):
        super().__init__(config)
        if not self.config.budget:
            self.shape = close_paths(self.config.paths)
            if not self.shape:
                raise ConfigError("tree: `paths` is empty; give at least one path or a `budget`")

    def propose(
        self, session, prefix, gamma, policy, should_stop=None
    ) -> DraftProposal:  # as Drafter.propose
        depth = min(gamma, self.config.max_depth)
        tree = _TreeBuilder(session, prefix, policy)
        if depth > 0:
            if self.config.budget:
                tree.dynamic(self.config.budget, self.config.top_k, depth, should_stop)
            else:
                tree.static([p for p in self.shape if len(p) <= depth], should_stop)
        return tree.proposal()


class _TreeBuilder:
    """Mutable state of one drafted tree. Node -1 is the root (the prefix)."""

    def __init__(self, session: ModelSession, prefix: torch.Tensor, policy: TokenPolicy):
        self.session, self.prefix, self.policy = session, prefix.cpu(), policy
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.laws: list[torch.Tensor] = []  # [V] float64 per node (sampling)
        self.cum: list[float] = []  # cumulative draft probability of each node's path
        self.dist: dict[int, torch.Tensor] = {}  # node -> [V] float64 draft probabilities below it
        self.drawn: dict[int, list[int]] = {}  # node -> its children's tokens, in draw order

    def seq(self, node: int) -> torch.Tensor:  # [T + depth] prefix + the node's path
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return torch.cat([self.prefix, torch.tensor(path[::-1], dtype=torch.long)])

    def q(self, node: int) -> torch.Tensor:  # [V] draft law below `node` (probabilities, float64)
        if node not in self.dist:
            seq = self.seq(node)
            logits = self.session.sync(seq)  # [V] draft logits after the node's path
            scores = self.policy.process(seq, self.policy.fit(logits)[None].cpu())  # [1, V]
            self.dist[node] = self.policy.probs(scores)[0]
        return self.dist[node]

    def remaining(self, node: int) -> torch.Tensor:  # [V] q below `node` without its drawn children
        q = self.q(node).clone()
        drawn = self.drawn.get(node, [])
        if drawn:
            q[torch.tensor(drawn)] = 0.0
        return q

    def add_child(self, node: int) -> int | None:
        """Draw (sampling) or take (greedy: next best) one more child of `node`; None if q is exhausted."""
        rest = self.remaining(node)  # [V]
        total = float(rest.sum())
        if total <= 0.0:
            return None
        if self.policy.do_sample:
            law = rest / total
            tok = self.policy.sample(law)
            self.laws.append(law)
        else:
            tok = int(torch.argmax(rest))  # first index among ties, like argmax decoding
        self.drawn.setdefault(node, []).append(tok)
        base = 1.0 if node < 0 else self.cum[node]
        self.tokens.append(tok)
        self.parents.append(node)
        self.cum.append(base * float(self.q(node)[tok]))
        return len(self.tokens) - 1

    def static(self, shape: list[tuple[int, ...]], should_stop: Callable[[], bool] | None) -> None:
        kids: dict[tuple[int, ...], int] = {}  # rank path -> number of children in the shape
        for p in shape:
            kids[p[:-1]] = max(kids.get(p[:-1], 0), p[-1] + 1)

        self._expand(-1, (), kids, should_stop)

    def _expand(
        self,
        node: int,
        path: tuple[int, ...],
        kids: dict[tuple[int, ...], int],
        should_stop: Callable[[], bool] | None,
    ) -> None:
        """`static`'s depth-first walk (one draft token per sync). A method, not a nested function:
        a closure that calls itself is a reference cycle, which would keep the tree and its session
        alive until Python's cyclic collector runs."""
        made = []
        for rank in range(kids.get(path, 0)):
            child = self.add_child(node)
            if child is None:
                break
            made.append((child, (*path, rank)))
        for child, cpath in made:
            if should_stop is not None and should_stop():
                return
            if cpath in kids:
                self._expand(child, cpath, kids, should_stop)

    def dynamic(self, budget: int, top_k: int, depth: int, should_stop: Callable[[], bool] | None) -> None:
        """Best-first: the next node is the candidate child with the highest cumulative probability
        bound cum(parent) * max(q below parent, undrawn), computed from what was drawn so far."""
        heap: list[tuple[float, int, int]] = []
        order = 0

        def push(node: int) -> None:
            nonlocal order
            d = 0 if node < 0 else self.depth(node)
            if d >= depth or len(self.drawn.get(node, [])) >= top_k:
                return
            bound = (1.0 if node < 0 else self.cum[node]) * float(self.remaining(node).max())
            if bound > 0:
                heapq.heappush(heap, (-bound, order, node))
                order += 1

        push(-1)
        while heap and len(self.tokens) < budget:
            if should_stop is not None and should_stop():
                break
            _, _, node = heapq.heappop(heap)
            child = self.add_child(node)
            if child is None:
                continue
            push(node)  # its next sibling
            push(child)  # its first child

    def depth(self, node: int) -> int:
        d = 0
        while node >= 0:
            d, node = d + 1, self.parents[node]
        return d

    def proposal(self) -> DraftProposal:
        return DraftProposal(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            q=torch.stack(self.laws) if self.laws else None,  # [n, V]
            parents=torch.tensor(self.parents, dtype=torch.long),
        )


class SerialTreeScheduler(SerialScheduler):
    """`serial` under the name the tree plugin registers: every scheduler verifies a drafted tree in
    one target pass (the proposal's type chooses how it is scored), so this is `serial` itself."""


@hookimpl
def hippo_register_drafters():
    return {"tree": TreeDrafter}


@hookimpl
def hippo_register_schedulers():
    return {"serial_tree": SerialTreeScheduler}
