"""Tree drafting as a plug-in: a `tree` drafter, a `tree` verifier and a `serial_tree` scheduler.

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
    recorded in `tree_q[j]` (the exact law the child was drawn from). The draft computes each node's
    q by `session.sync(prefix + path)` (plain forwards + rollbacks, depth-first for static trees),
    so the draft's cache is brought back to the accepted prefix by the next round's `sync`.

Verification (`TreeVerifier`), from the target's scores at every node, p_v:
    - greedy: walk from the root; at node v move to the child whose token is argmax p_v, if any;
      stop at the first node without such a child and emit argmax p_v. This is the longest path
      whose tokens equal the target's argmax at every step, plus the target's next token: exactly
      what token-by-token greedy decoding emits.
    - sampling: recursive rejection sampling (SpecInfer; without-replacement form of Jeon et al.
      2024). At node v with residual target r = p_v and children c_1..c_k drawn with laws q_1..q_k:
      for j = 1..k accept c_j with probability min(1, r(c_j) / q_j(c_j)); on accept move to c_j;
      on reject set r <- norm(max(0, r - q_j)). If every child is rejected (or v is a leaf), draw
      the next token from r.
      Why it is exact: by induction on the number of remaining children, the token emitted at v is
      distributed as r. With no child left we draw from r. Otherwise c_j ~ q_j, given everything
      drawn before it (earlier siblings, other branches, the shape decisions so far), and the
      uniform is fresh; one step of Leviathan et al.'s rejection rule gives P(accept, c_j = x) =
      min(q_j(x), r(x)) and, on reject, the procedure continues with target norm(max(0, r - q_j))
      = (r - min(q_j, r)) / P(reject), which by induction it reproduces whatever c_j was; summing
      gives r. Accepting c_j means the token at this step is c_j, and since c_j's own children were
      drawn from q(. | path to c_j) independently of the uniform, the same argument applies one
      level down with p_{c_j}. Hence the emitted sequence is distributed as sampling from p token
      by token. (Zeroing the earlier siblings in q_j is what makes q_j the true law of c_j; a
      rejected c_j has r(c_j) < q_j(c_j), so the new residual gives it no mass either.)

Scoring and keeping (`TreeProposal.score` / `commit`, called by the core's `DecodeJob.verify_round`)
    The proposal's type chooses how a round scores it, so every scheduler verifies a tree in one
    target pass. The target is fed the tokens it has not consumed yet (the last round's bonus
    token) followed by all n nodes in **one** `ModelSession.forward_masked` call: each node sees the
    prefix, its ancestors and itself, at logical position prefix length + depth - 1 (the session
    applies its own position layout: M-RoPE rows for Qwen backbones, 1-D for LLaVA-OneVision).
    `ModelSession.keep` then keeps the pending tokens and the accepted path, in order (a KV cache
    compaction). A tree in which no node has a sibling is a chain and goes through the chain rules.
    `serial_tree` is `serial` under the name this plugin has always registered.

Parallel schedules (`pearl`, `hippo`)
    They verify with `bonus=False` and let the draft continue after the proposal's first-child chain
    while the target verifies. A tree round then ends with no bonus token exactly when the accepted
    path is that whole chain (the verifiers stop at its last node, `end`): the target keeps p at
    that node to check the continuation's first token. Any other accepted path emits its next token
    as usual, and the continuation (drafted after the chain) is discarded. Both cases are exact: the
    continuation's tokens are only ever checked against the target at the prefix actually accepted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hippo import hookimpl
from hippo.config import positive_int
from hippo.errors import ConfigError, UnsupportedError
from hippo.interfaces import Drafter, ModelSession, Verifier
from hippo.sampling import TokenPolicy
from hippo.types import DraftProposal, Verdict
from hippo_plugins.schedulers import SerialScheduler
from hippo_plugins.verifiers import (
    GreedyVerifier,
    RejectionVerifier,
    greedy_verify,
    rejection_verify,
    residual,
)

# ---- the tree proposal ------------------------------------------------------------------------


@attrs.frozen
class TreeProposal(DraftProposal):
    """A token tree. `tokens`/`q` (inherited) are its first-child chain: where a parallel schedule's
    draft continues while the target verifies the tree.

    Nodes are parent-first: `parents[i] < i`, -1 for children of the root (the prefix).
    """

    tree_tokens: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.long))  # [n]
    parents: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.long))  # [n]
    tree_q: torch.Tensor | None = None  # [n, V] law each node was drawn from (None when greedy)

    @property
    def n_nodes(self) -> int:
        return int(self.tree_tokens.shape[0])

    def depths(self) -> torch.Tensor:  # [n], 1 for children of the root
        d: list[int] = []
        for par in self.parents.tolist():
            d.append(1 if par < 0 else d[par] + 1)
        return torch.tensor(d, dtype=torch.long)

    def children(self) -> list[list[int]]:  # [n + 1] lists; entry 0 is the root, node i is entry i+1
        out: list[list[int]] = [[] for _ in range(self.n_nodes + 1)]
        for i, par in enumerate(self.parents.tolist()):
            out[par + 1].append(i)
        return out

    def path(self, node: int) -> list[int]:  # node indices from the root's child down to `node`
        out, par = [], node
        parents = self.parents.tolist()
        while par >= 0:
            out.append(par)
            par = parents[par]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:  # [n, n] bool: [i, j] = node j is node i or an ancestor of i
        n, parents = self.n_nodes, self.parents.tolist()
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            if parents[i] >= 0:
                mask[i] |= mask[parents[i]]
        return mask

    # ---- how a round scores and keeps a tree (see DraftProposal); a chain-shaped tree is a chain ----
    @property
    def is_chain(self) -> bool:
        """No node has a sibling: the tree is its first-child chain, verified by the chain rules."""
        return self.n_nodes == self.gamma

    @property
    def size(self) -> int:
        return self.n_nodes

    @property
    def depth(self) -> int:
        return int(self.depths().max()) if self.n_nodes else 0

    def chunks(self, size: int) -> list[DraftProposal]:
        return [self]  # a tree is verified whole

    def truncate(self, n: int) -> TreeProposal:
        """The first n nodes (parent-first, so still a tree): what a drafting stopped early had made."""
        parents, tokens = self.parents[:n], self.tree_tokens[:n]
        chain = chain_of(parents.tolist(), tokens.tolist())
        q = None if self.tree_q is None else self.tree_q[:n]
        return TreeProposal(
            tokens=tokens[chain],
            q=None if q is None else q[chain],
            tree_tokens=tokens,
            parents=parents,
            tree_q=q,
        )

    def score(self, target: ModelSession, prefix: torch.Tensor, bonus: bool) -> torch.Tensor:
        """Raw target logits [n+1, V]: row 0 at the root (after `prefix`), row i+1 after node i."""
        if self.is_chain:
            return super().score(target, prefix, bonus)
        pending = prefix[target.length :]  # [m] accepted tokens the target has not consumed
        if not pending.numel() and target.last_logits is None:  # re-feed the last token for p at the root
            target.rollback(target.length - 1)
            pending = prefix[target.length :]
        m = int(pending.shape[0])
        if m:
            return score_tree(target, pending, self)[m - 1 :]
        return torch.cat([target.last_logits[None], score_tree(target, pending, self)])

    def process(self, policy: TokenPolicy, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.is_chain:
            return super().process(policy, prefix, logits)
        if not policy.processors:  # nothing reads the sequence: skip building each node's path
            return policy.process(prefix, logits)
        seqs = [prefix] + [torch.cat([prefix, self.tree_tokens[self.path(i)]]) for i in range(self.n_nodes)]
        return torch.cat([policy.process(s, r[None]) for s, r in zip(seqs, logits)])  # [n+1, V]

    def verify(self, verifier: Verifier, scores: torch.Tensor, policy: TokenPolicy, bonus: bool) -> Verdict:
        if self.is_chain:
            return super().verify(verifier, scores, policy, bonus)
        end = None if bonus else chain_of(self.parents.tolist(), self.tree_tokens.tolist())[-1]
        return tree_verifier(verifier).verify_tree(self, scores, policy, end)

    def commit(self, target: ModelSession, length: int, verdict: Verdict) -> list[int]:
        if self.is_chain:
            return super().commit(target, length, verdict)
        m = length - target.length  # the pending tokens scored before the nodes
        path = list(verdict.path)
        target.keep([*range(m), *(m + i for i in path)])
        return self.tree_tokens[path].tolist()


def chain_of(parents: list[int], tokens: list[int]) -> list[int]:
    """Node indices of the first-child chain from the root."""
    first: dict[int, int] = {}
    for i, par in enumerate(parents):
        first.setdefault(par, i)
    out, v = [], -1
    while v in first:
        v = first[v]
        out.append(v)
    return out


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
        self,
        session: ModelSession,
        prefix: torch.Tensor,  # [T]
        gamma: int,
        policy: TokenPolicy,
        should_stop: Callable[[], bool] | None = None,
    ) -> TreeProposal:
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

        def expand(node: int, path: tuple[int, ...]) -> None:  # depth-first: one draft token per sync
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
                    expand(child, cpath)

        expand(-1, ())

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

    def proposal(self) -> TreeProposal:
        chain = chain_of(self.parents, self.tokens)
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        laws = torch.stack(self.laws) if self.laws else None  # [n, V]
        return TreeProposal(
            tokens=tokens[chain] if chain else torch.zeros(0, dtype=torch.long),
            q=None if laws is None or not chain else laws[chain],
            tree_tokens=tokens,
            parents=torch.tensor(self.parents, dtype=torch.long),
            tree_q=laws,
        )


# ---- the verifier -----------------------------------------------------------------------------


@attrs.frozen
class TreeVerdict(Verdict):
    """A verdict on a tree: `path` lists the accepted node indices (n_accepted == len(path))."""

    path: tuple[int, ...] = ()


def tree_greedy(
    proposal: TreeProposal, p_scores: torch.Tensor, end: int | None = None
) -> tuple[list[int], int | None]:
    """p_scores [n+1, V]: row 0 at the root, row i+1 at node i. Longest argmax path + next argmax.

    Reaching node `end` stops the walk with no next token (no bonus: p at `end` checks the next draft).
    """
    target = p_scores.argmax(-1).cpu()  # [n+1]
    children, tokens = proposal.children(), proposal.tree_tokens.tolist()
    path, row = [], 0
    while True:
        want = int(target[row])
        nxt = next((c for c in children[row] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        if nxt == end:
            return path, None
        row = nxt + 1


def tree_rejection(
    proposal: TreeProposal, p: torch.Tensor, generator: torch.Generator, end: int | None = None
) -> tuple[list[int], int | None]:
    """p [n+1, V] target probabilities per node. Recursive rejection sampling (see module docstring).

    Accepting node `end` stops with no next token drawn (no bonus: p at `end` checks the next draft).
    """
    if proposal.tree_q is None:
        raise ConfigError("tree verifier: sampling needs the law of each node (tree_q), got None")
    p, q = p.double().cpu(), proposal.tree_q.double().cpu()
    children, tokens = proposal.children(), proposal.tree_tokens.tolist()
    path, row = [], 0
    while True:
        r = p[row]  # [V] residual target at this node
        moved = False
        for c in children[row]:
            x = tokens[c]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(q[c, x]) < float(r[x]):  # u < r(x) / q_c(x); q_c(x) > 0 since x ~ q_c
                path.append(c)
                if c == end:
                    return path, None
                row, moved = c + 1, True
                break
            r = residual(r, q[c])
        if not moved:
            return path, int(torch.multinomial(r, 1, generator=generator))


class TreeVerifier(Verifier):
    """Longest greedy path (greedy) or recursive rejection sampling (sampling) over a token tree.

    Given a chain (a plain `DraftProposal`, or p rows for the chain view only) it applies the chain
    rules (`greedy_verify` / `rejection_verify`), so it also verifies chain drafters' proposals.
    """

    def verify(self, proposal: DraftProposal, p_logits: torch.Tensor, policy: TokenPolicy) -> Verdict:
        if (
            isinstance(proposal, TreeProposal)
            and proposal.n_nodes
            and p_logits.shape[0] == proposal.n_nodes + 1
        ):
            return self.verify_tree(proposal, p_logits, policy)
        if not policy.do_sample:
            return Verdict(*greedy_verify(proposal.tokens, p_logits))
        q = proposal.q
        if q is None:
            q = torch.nn.functional.one_hot(proposal.tokens.cpu(), p_logits.shape[-1]).double()
        return Verdict(*rejection_verify(proposal.tokens, q, policy.distribution(p_logits), policy.generator))

    def verify_tree(
        self,
        proposal: TreeProposal,
        p_logits: torch.Tensor,  # [n+1, V] processed target scores: root, then node i at row i+1
        policy: TokenPolicy,
        end: int | None = None,  # node whose acceptance ends the round with no bonus token
    ) -> TreeVerdict:
        if policy.do_sample:
            path, tok = tree_rejection(proposal, policy.distribution(p_logits), policy.generator, end)
        else:
            path, tok = tree_greedy(proposal, p_logits, end)
        return TreeVerdict(len(path), tok, tuple(path))


def tree_verifier(verifier: Verifier) -> TreeVerifier:
    """The verifier for a tree: the `tree` verifier, which generalises the stock chain rules."""
    if isinstance(verifier, TreeVerifier):
        return verifier
    if type(verifier) in (GreedyVerifier, RejectionVerifier):
        return TreeVerifier()
    raise UnsupportedError(
        f"a token tree is verified by the `tree` verifier; {type(verifier).__name__} only knows chains. "
        "Use .verifier('tree') or leave the verifier unset"
    )


# ---- one-pass tree scoring through the session's masked forward ----------------------------------


def tree_inputs(
    pending: torch.Tensor, proposal: TreeProposal
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [m+n], offsets [m+n], visible [m+n, m+n] for `ModelSession.forward_masked`.

    `pending` [m] are chain tokens the session has not consumed (each sees those before it); node i
    sits at offset m - 1 + depth_i and sees every pending token, its ancestors and itself.
    """
    m, n = int(pending.shape[0]), proposal.n_nodes
    offsets = torch.cat([torch.arange(m), m - 1 + proposal.depths()])  # [m+n]
    visible = torch.zeros(m + n, m + n, dtype=torch.bool)
    visible[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
    visible[m:, :m] = True
    visible[m:, m:] = proposal.ancestor_mask()
    tokens = torch.cat([pending.cpu(), proposal.tree_tokens.cpu()])  # [m+n]
    return tokens, offsets, visible


def score_tree(session: ModelSession, pending: torch.Tensor, proposal: TreeProposal) -> torch.Tensor:
    """Feed pending + all tree nodes in one forward; returns logits [m+n, V]. `session.keep` must follow."""
    return session.forward_masked(*tree_inputs(pending, proposal))


class SerialTreeScheduler(SerialScheduler):
    """`serial` under the name the tree plugin registers: every scheduler verifies a drafted tree in
    one target pass (the proposal's type chooses how it is scored), so this is `serial` itself."""


@hookimpl
def hippo_register_drafters():
    return {"tree": TreeDrafter}


@hookimpl
def hippo_register_verifiers():
    return {"tree": TreeVerifier}


@hookimpl
def hippo_register_schedulers():
    return {"serial_tree": SerialTreeScheduler}
