"""An n-gram trie with frequency counts: the retrieval memory of the Lookahead baseline.

Lookahead (Zhao et al. 2023, "Lookahead: An Inference Acceleration Framework for Large Language
Model with Lossless Generation Accuracy") drafts from a trie of n-grams seen in the prompt and
in earlier outputs. The rules below follow that framework (``LookaheadCache`` in
alipay/PainlessInferenceAcceleration, read for its rules; the code here is our own); the
deviations are listed at the end.

- **Windows.** Every position i of a text inserts the window ``text[i : i + 1 + window]``: a
  key token followed by ``window = max_prefix - 1 + branch_length`` tokens (13 for the
  framework's query of 2 tokens and branch length 12). Each node on the window's path gets +1,
  so a node's count is how often its n-gram was seen and counts never grow with depth.
- **Two counts per node.** ``fi`` counts the current request's prompt ("input"), ``fo``
  every output of the stream so far ("output"). The prompt's counts are request-local: they
  are removed when the request ends. Output counts persist across requests (the framework
  keeps one cache per model) until `clear`.
- **Incremental output.** Committed tokens go to a buffer; a window is inserted once it is
  complete (key + ``window`` tokens), so nothing is counted twice. At the end of the request
  the incomplete windows of the tail are inserted as they are.
- **Retrieval.** Match the last ``k`` history tokens for ``k = max_prefix .. 1``; the subtree
  under the match holds every continuation seen after that context. From it keep at most
  ``budget`` nodes, most frequent first, no deeper than ``branch_length``. Stop at the first
  ``k`` whose tree has at least ``branch_length`` nodes counting the root (the framework's
  "enough tokens, no need to retrieve again"); otherwise a shorter context may give a larger
  tree.
- **Ranking.** ``score = (1 - w) * fi + w * fo`` with ``w = 1e-4``: the current prompt's
  n-grams come first, output counts break ties and rank the rest. When both kinds compete,
  half of the budget is reserved for the most frequent output n-grams (the framework's
  ``min_output_size = decoding_length // 2``).
- **Bounded memory.** When a key token's subtree has grown past ``max_key_nodes`` output nodes,
  the end of the request "squeezes" it: output counts above 1 are halved, nodes seen at most
  once are dropped (the framework's ``squeeze``).

Deviations from the framework, each for a stated reason:

- Selection is best-first (a heap over the children of kept nodes). The framework computes
  count thresholds meant to keep the top nodes, then emits a depth-first walk cut at the
  budget; when fewer than half the budget has output counts its output threshold becomes 0
  and the cut alone decides, favouring the first-inserted branch. Best-first keeps exactly the
  most frequent nodes, which is what the thresholds aim at.
- A shorter context replaces a longer one's tree only if it is larger (the framework takes it
  whenever that key exists, even if it yields less).
- Prompt-tail + answer windows are output n-grams (see `begin_request`), and the whole prompt
  is indexed (the framework drops its first and last token).
- Squeezing is checked for the keys touched by each request (the framework waits until 1024
  keys were touched).
- A finished prompt's n-grams are deleted, not kept with count 0 (the framework keeps them,
  and its depth-first walk can still emit them when a subtree is under budget).

Storage is plain Python, laid out for the garbage collector: nodes are integer ids, each
node's children a ``{token: child id}`` dict and the counts two flat lists. Dicts holding only
ints are not tracked by CPython's cyclic GC, so a large trie adds no GC work (with one object
per node, ``__slots__`` plus a dict of child objects, GC took 1.3 s of a 7 s replay of 40
requests; with ids, 12 ms). Freed ids are reused. A retrieval touches only the matched
subtree, so propose + observe stay far below a millisecond.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from recap.core.tree import ROOT, DraftTree, TreeBuilder

_ROOT_ID = 0


def _segments(tokens: Sequence[int], excluded: frozenset[int]) -> list[list[int]]:
    """Runs of ``tokens`` between excluded tokens: no n-gram may contain one."""
    runs: list[list[int]] = [[]]
    for token in tokens:
        if token in excluded:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(token)
    return [run for run in runs if run]


class NGramTrie:
    """Frequency-counted n-gram trie with a request lifecycle and multi-branch retrieval."""

    def __init__(self, *, branch_length: int = 12, max_prefix: int = 2, output_weight: float = 1e-4,
                 max_key_nodes: int = 512):
        if branch_length < 1 or max_prefix < 1:
            raise ValueError("branch_length and max_prefix must be at least 1")
        self.branch_length = branch_length
        self.max_prefix = max_prefix
        self.window = max_prefix - 1 + branch_length
        """Tokens stored after each key token: enough for a ``max_prefix`` match plus a full branch."""
        self.output_weight = output_weight
        self.max_key_nodes = max_key_nodes
        self.clear()

    # ---- lifecycle -------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget everything (a new stream)."""
        self._kids: list[dict[int, int] | None] = [None]  # node id -> {token: child id}; 0 is the root
        self._fi: list[int] = [0]  # current prompt's count
        self._fo: list[float] = [0.0]  # stream's output count
        self._free: list[int] = []
        self.excluded: frozenset[int] = frozenset()
        self._prompt: list[list[int]] = []
        self._buffer: list[int] = []
        self._grown: dict[int, int] = {}
        self._touched: set[int] = set()
        self._active = False

    def __len__(self) -> int:
        """Live nodes, root excluded."""
        return len(self._fi) - 1 - len(self._free)

    def begin_request(self, prompt: Sequence[int], excluded: Iterable[int] = ()) -> None:
        """Count the prompt's n-grams as request-local input and start the output buffer.

        The buffer starts with the prompt's last ``window`` tokens, so output windows that
        straddle the prompt/answer boundary (chat-template tail + first answer tokens) are
        remembered too; the framework's SGLang integration stores the same prompt tail with the
        output. Excluded tokens (image placeholders) split the prompt: no n-gram spans them.
        """
        if self._active:
            self.end_request()
        self._active = True
        self.excluded = frozenset(excluded)
        prompt = [int(t) for t in prompt]
        self._prompt = _segments(prompt, self.excluded)
        span = self.window + 1
        for run in self._prompt:
            for i in range(len(run) - 1):
                self._insert(run[i : i + span], output=False)
        ends_in_run = bool(prompt) and prompt[-1] not in self.excluded
        self._buffer = self._prompt[-1][-self.window :] if ends_in_run else []

    def extend_output(self, tokens: Iterable[int]) -> None:
        """Committed tokens: insert every window that they complete."""
        buffer = self._buffer
        for token in tokens:
            token = int(token)
            if token in self.excluded:
                self._flush()
                continue
            buffer.append(token)
        extra = len(buffer) - self.window
        if extra > 0:
            span = self.window + 1
            for i in range(extra):
                self._insert(buffer[i : i + span], output=True)
            del buffer[:extra]

    def end_request(self) -> None:
        """Insert the tail's incomplete windows, forget the prompt, squeeze overgrown keys."""
        if not self._active:
            return
        self._flush()
        span = self.window + 1
        for run in self._prompt:
            for i in range(len(run) - 1):
                self._forget(run[i : i + span])
        self._prompt = []
        self._squeeze_touched()
        self._active = False

    # ---- insertion and removal ------------------------------------------------------------

    def _new_node(self) -> int:
        if self._free:
            node = self._free.pop()
            self._kids[node] = None
            self._fi[node] = 0
            self._fo[node] = 0.0
            return node
        self._kids.append(None)
        self._fi.append(0)
        self._fo.append(0.0)
        return len(self._fi) - 1

    def _insert(self, ngram: Sequence[int], *, output: bool) -> None:
        kids, counts = self._kids, (self._fo if output else self._fi)
        node = _ROOT_ID
        created = 0
        for token in ngram:
            children = kids[node]
            if children is None:
                children = kids[node] = {}
            child = children.get(token)
            if child is None:
                child = children[token] = self._new_node()
                created += 1
            counts[child] += 1
            node = child
        if output:
            key = ngram[0]
            self._touched.add(key)
            if created:
                self._grown[key] = self._grown.get(key, 0) + created

    def _flush(self) -> None:
        """Insert the buffered tokens' windows, however short (at least one continuation token)."""
        buffer = self._buffer
        span = self.window + 1
        for i in range(len(buffer) - 1):
            self._insert(buffer[i : i + span], output=True)
        buffer.clear()  # in place: `extend_output` holds a reference

    def _release(self, parent: int, token: int) -> None:
        """Unlink ``parent``'s child ``token`` and recycle the ids of its whole subtree."""
        kids = self._kids
        stack = [kids[parent].pop(token)]  # type: ignore[union-attr]
        while stack:
            node = stack.pop()
            children = kids[node]
            if children:
                stack.extend(children.values())
            kids[node] = None
            self._free.append(node)

    def _forget(self, ngram: Sequence[int]) -> None:
        """Remove one prompt window's input counts. Counts never grow with depth, so the first
        node without output counts heads a subtree that only this prompt made: drop it whole."""
        kids, fi, fo = self._kids, self._fi, self._fo
        parent = _ROOT_ID
        for token in ngram:
            children = kids[parent]
            node = children.get(token) if children else None
            if node is None:
                return
            if fo[node] <= 0.0:
                self._release(parent, token)
                return
            fi[node] = 0
            parent = node

    def _squeeze_touched(self) -> None:
        root = self._kids[_ROOT_ID] or {}
        for key in self._touched:
            if self._grown.get(key, 0) <= self.max_key_nodes:
                continue
            node = root.get(key)
            if node is None:
                self._grown.pop(key, None)
                continue
            self._fo[node] *= 0.5
            left = self._squeeze(node)
            if left:
                self._grown[key] = left
            else:
                self._release(_ROOT_ID, key)
                self._grown.pop(key, None)
        self._touched = set()

    def _squeeze(self, top: int) -> int:
        """Halve output counts above 1 and drop nodes seen at most once, below ``top``; returns
        the number of nodes left."""
        kids, fo = self._kids, self._fo
        left = 0
        stack = [top]
        while stack:
            parent = stack.pop()
            children = kids[parent]
            if not children:
                continue
            for token, child in list(children.items()):
                if fo[child] > 1.0:
                    fo[child] *= 0.5
                    left += 1
                    stack.append(child)
                else:
                    self._release(parent, token)
        return left

    # ---- inspection ------------------------------------------------------------------------

    def counts(self, ngram: Sequence[int]) -> tuple[int, float] | None:
        """(prompt count, output count) of ``ngram`` (its first token is the key), if stored."""
        node = self._match(ngram)
        return None if node is None else (self._fi[node], self._fo[node])

    def nodes(self) -> Iterator[tuple[int, int, float]]:
        """(depth, prompt count, output count) of every stored node, root excluded."""
        stack = [(_ROOT_ID, 0)]
        while stack:
            node, depth = stack.pop()
            if depth:
                yield depth, self._fi[node], self._fo[node]
            children = self._kids[node]
            if children:
                stack.extend((child, depth + 1) for child in children.values())

    # ---- retrieval -------------------------------------------------------------------------

    def _match(self, context: Sequence[int]) -> int | None:
        kids = self._kids
        node = _ROOT_ID
        for token in context:
            children = kids[node]
            node = children.get(int(token)) if children else None
            if node is None:
                return None
        return node

    def retrieve(self, history: Sequence[int], budget: int = 63) -> tuple[int, DraftTree]:
        """The draft tree for ``history`` and the number of history tokens it was matched on
        (0: no match, empty tree). Longest context first; a shorter one replaces it only while
        the tree has fewer than ``branch_length`` nodes counting the root, and only if larger."""
        best_k, best = 0, DraftTree.empty()
        if budget < 1:
            return best_k, best
        for k in range(min(self.max_prefix, len(history)), 0, -1):
            node = self._match(history[len(history) - k :])
            if node is None or not self._kids[node]:
                continue
            tree = self._select(node, budget)
            if len(tree) > len(best):
                best_k, best = k, tree
            if len(best) + 1 >= self.branch_length:
                break
        return best_k, best

    def draft(self, history: Sequence[int], budget: int = 63) -> DraftTree:
        return self.retrieve(history, budget)[1]

    def _select(self, start: int, budget: int) -> DraftTree:
        """At most ``budget`` nodes of ``start``'s subtree, most frequent first (best-first, so
        the kept nodes are the top ones by score and always form a tree), excluded tokens cut.
        Emitted depth-first with the most frequent sibling first, as the framework does."""
        chosen: dict[int, tuple[int, int]] = {}  # node -> (parent node, token), in pick order
        if self._fi[start] > 0 and self._fo[start] > 0.0:
            self._best_first(start, (budget + 1) // 2, chosen, by_output=True)
        self._best_first(start, budget, chosen, by_output=False)
        fi, fo, w = self._fi, self._fo, self.output_weight
        kids: dict[int, list[tuple[float, float, int, int, int]]] = {}
        for order, (node, (parent, token)) in enumerate(chosen.items()):
            score = (1.0 - w) * fi[node] + w * fo[node]
            kids.setdefault(parent, []).append((-score, -fo[node], order, token, node))
        builder = TreeBuilder()
        stack: list[tuple[int, int, int]] = []  # (parent's builder index, token, node)

        def push_children(index: int, node: int) -> None:
            children = kids.get(node)
            if children:
                children.sort()  # most frequent first; ties: output count, then pick order
                stack.extend((index, token, child) for *_, token, child in reversed(children))

        push_children(ROOT, start)
        while stack:
            parent_index, token, node = stack.pop()
            push_children(builder.add(parent_index, token), node)
        return builder.build()

    def _best_first(self, start: int, limit: int, chosen: dict[int, tuple[int, int]], *, by_output: bool) -> None:
        """Grow ``chosen`` to ``limit`` nodes by always taking the highest-scoring child of the
        start or of a chosen node; ``by_output`` ranks by the output count alone (the reserved
        half of the budget), otherwise by the mixed score. Ties go to the earlier discovered."""
        kids, fi, fo, excluded = self._kids, self._fi, self._fo, self.excluded
        w = self.output_weight
        keep = 1.0 - w
        cap = self.branch_length
        heap: list[tuple[float, int, int, int, int, int]] = []
        seq = 0

        def push(node: int, depth: int) -> None:
            nonlocal seq
            children = kids[node]
            if not children or depth >= cap:
                return
            for token, child in children.items():
                if token in excluded:
                    continue
                score = fo[child] if by_output else keep * fi[child] + w * fo[child]
                if score > 0.0:
                    heapq.heappush(heap, (-score, seq, token, child, node, depth + 1))
                    seq += 1

        push(start, 0)
        while heap and len(chosen) < limit:
            _, _, token, node, parent, depth = heapq.heappop(heap)
            if node not in chosen:
                chosen[node] = (parent, token)
            push(node, depth)
