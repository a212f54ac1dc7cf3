"""RadixPrefixCache ("ShadowRadix"): prefix caching over DeepSeek-V4's heterogeneous pools.

The tree is keyed by token ids in whole pages (P tokens) and its nodes hold FULL pages only. Every
other pool is a shadow of those pages: C4 entries, C4 indexer keys and C128 entries live at
`full_slot // ratio` (alive as long as the full page), the SWA KV lives in the SWA page behind a
full page, and the compressor rings live inside that SWA page. So a node is either live (all its
pages have SWA pages) or a tombstone (none has): its SWA was reclaimed under memory pressure while
its compressed shadows and full coordinates stay matchable.

Locks (per node, `full_lock >= swa_lock`): a request that uses a path full-locks it to the root
(no eviction) and SWA-locks only the nodes covering its last `horizon` tokens (window W plus the
compressor's look-back), which is what continuing from that point reads. A handle records the
exact nodes it SWA-locked (splits add the new upper node to it), so unlocking is exact.

    match:   walks the tree; returns the deepest node boundary with `horizon` live SWA tokens
             behind it (or attached to the root through live nodes only): continuing there reads
             valid window keys and compressor rings. Never the whole sequence (one token is left
             to compute).
    insert:  adopts a request's new pages; pages the tree already has for the same tokens stay
             the request's (duplicates). At finish, a tombstoned node whose duplicates still have
             SWA is revived by moving that SWA over (tombstone recovery).
    evict:   phase 1 frees unlocked LRU leaves (full + SWA); phase 2 tombstones unlocked live
             inner nodes in LRU order (nearer the root first), then anchors and leaves (an
             unlocked leaf is deleted instead; leaves never stay tombstones unless full-locked).
             An anchor is a node that ends where a match is likely: an insert's end, or the
             point a repeat of the inserting request's prompt matches (`insert(anchor=...)`: its
             last full page before the prompt's last token). A node ends at one only when it is
             an anchor or a leaf, and inner non-anchor SWA serves no such match: it goes first.
Counters of evictable / protected pages are kept incrementally; `check_integrity` rebuilds them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from dsv4.cache.req_table import RequestTable


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...]
    pages: list[int]
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    full_lock: int = 0
    tombstone: bool = False
    last_used: int = 0
    start: int = 0                      # absolute position of the node's first token
    swa_holders: set[LockHandle] = field(default_factory=set)   # handles SWA-locking this node
    # a likely match point ends here (an insert's end, or where a repeat of a request's prompt
    # matches): its SWA is evicted after that of the other inner nodes
    anchor: bool = False

    @property
    def swa_lock(self) -> int:
        return len(self.swa_holders)


@dataclass(eq=False)
class LockHandle:
    """A request's lock: full lock on node..root, SWA lock on `swa_nodes` (exact across splits)."""

    node: TreeNode
    length: int            # tokens on the locked path
    swa_nodes: list[TreeNode] = field(default_factory=list)

    def __hash__(self) -> int:
        return id(self)

    @property
    def swa_held(self) -> bool:
        return bool(self.swa_nodes)


@dataclass(frozen=True)
class PrefixMatch:
    node: TreeNode
    pages: list[int]
    length: int


class RadixPrefixCache:
    def __init__(self, table: RequestTable, horizon: int) -> None:
        self.table, self.P, self.horizon = table, table.P, horizon
        self.root = TreeNode((), [], full_lock=1)
        self._clock = itertools.count(1)
        self.num_pages = 0             # pages in the tree
        self.full_protected = 0        # pages of nodes with full_lock > 0
        self.swa_live = 0              # pages of live (non-tombstone) nodes
        self.swa_protected = 0         # pages of live nodes with swa_lock > 0
        table.evict = self.evict

    @property
    def enabled(self) -> bool:
        return True

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def full_evictable(self) -> int:
        return self.num_pages - self.full_protected

    @property
    def swa_evictable(self) -> int:
        return self.swa_live - self.swa_protected

    # ---- match --------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest SWA-safe cached prefix of `tokens[:-1]`, page-aligned; touches the path (MRU)."""
        max_pages = (len(tokens) - 1) // self.P
        path = self._walk(tokens, max_pages)
        cut = self._safe_cut(path)
        path = path[:cut]
        node = path[-1] if path else self.root
        self._touch(node)
        pages = [p for n in path for p in n.pages]
        return PrefixMatch(node, pages, len(pages) * self.P)

    def _walk(self, tokens: Sequence[int], max_pages: int) -> list[TreeNode]:
        node, i, path = self.root, 0, []
        while i < max_pages:
            child = node.children.get(self._page_key(tokens, i))
            if child is None:
                break
            k = self._common_pages(child, tokens, i, max_pages - i)
            if k < len(child.pages):
                child = self._split(child, k)
            path.append(child)
            node, i = child, i + k
        return path

    def _safe_cut(self, path: list[TreeNode]) -> int:
        """Largest i such that the `horizon` tokens behind the end of `path[:i]` are SWA-live."""
        for i in range(len(path), 0, -1):
            live = 0
            for n in reversed(path[:i]):
                if n.tombstone:
                    break
                live += len(n.key)
                if live >= self.horizon:
                    return i
            else:
                return i           # live all the way to the root
        return 0

    # ---- locks --------------------------------------------------------------------------------
    def lock(self, node: TreeNode, length: int) -> LockHandle:
        """Full-lock node..root; SWA-lock the live nodes covering the last `horizon` tokens."""
        handle = LockHandle(node, length)
        covered, n = 0, node
        while n is not self.root:
            assert n is not None
            if n.full_lock == 0:
                self.full_protected += len(n.pages)
            n.full_lock += 1
            if covered < self.horizon:
                # tombstone: a duplicate segment the request does not read, nothing to protect
                if not n.tombstone:
                    self._hold_swa(n, handle)
                covered += len(n.key)
            n = n.parent  # type: ignore[assignment]
        return handle

    def release_swa(self, handle: LockHandle) -> None:
        """Drop only the SWA part of a lock (the request has moved a horizon past this path)."""
        for n in handle.swa_nodes:
            n.swa_holders.discard(handle)
            if not n.swa_holders:
                self.swa_protected -= len(n.pages)
        handle.swa_nodes = []

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock; tombstones it leaves as unlocked leaves are deleted."""
        self.release_swa(handle)
        n = handle.node
        while n is not self.root:
            assert n is not None and n.full_lock > 0, "unlocking a node that is not locked"
            n.full_lock -= 1
            if n.full_lock == 0:
                self.full_protected -= len(n.pages)
            n = n.parent  # type: ignore[assignment]
        if handle.node is not self.root and handle.node.tombstone:
            self._delete(handle.node)

    def _hold_swa(self, node: TreeNode, handle: LockHandle) -> None:
        if not node.swa_holders:
            self.swa_protected += len(node.pages)
        node.swa_holders.add(handle)
        handle.swa_nodes.append(node)

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: list[int], finished: bool,
               anchor: int | None = None) -> TreeNode:
        """Add a request's cached prefix (`len(tokens) == len(pages) * P`); returns its last node.

        Pages adopted by the tree become shared; the request keeps (and later frees) its
        duplicates. The last node, and with `anchor` (pages, 1..len(pages)) a node ending
        there spanning about one horizon, are marked anchors (module docstring).
        """
        assert len(tokens) == len(pages) * self.P, "insert needs whole pages"
        node, i = self.root, 0
        while i < len(pages):
            child = node.children.get(self._page_key(tokens, i))
            if child is None:
                break
            k = self._common_pages(child, tokens, i, len(pages) - i)
            if k < len(child.pages):
                child = self._split(child, k)
            if finished and child.tombstone:
                self._recover(child, pages[i:i + k])
            node, i = child, i + k
        if i < len(pages):
            node = self._add_new(node, tokens, pages, i)
        node.anchor = True
        if anchor is not None and 0 < anchor < len(pages):
            self._anchor_at(tokens, anchor)
        self._touch(node)
        return node

    def _anchor_at(self, tokens: Sequence[int], pages: int) -> None:
        """Mark the node ending `pages` pages into `tokens` (cached) an anchor, split so that it
        spans about one horizon (its SWA is all a match there reads)."""
        path = self._walk(tokens, pages)
        assert sum(len(n.pages) for n in path) == pages, "anchor past the cached path"
        last, tail = path[-1], -(-self.horizon // self.P)
        if len(last.pages) > tail:
            self._split(last, len(last.pages) - tail)
        last.anchor = True

    def _add_new(self, node: TreeNode, tokens: Sequence[int], pages: list[int], i: int) -> TreeNode:
        for start, stop, live in self._segments(pages, i):
            child = TreeNode(tuple(tokens[start * self.P: stop * self.P]), pages[start:stop],
                             parent=node, tombstone=not live, start=start * self.P)
            node.children[child.key[:self.P]] = child
            self.table.share(child.pages)
            self.num_pages += len(child.pages)
            self.swa_live += 0 if child.tombstone else len(child.pages)
            node = child
        return node

    def _segments(self, pages: list[int], i: int) -> list[tuple[int, int, bool]]:
        """Runs of `pages[i:]` with the same SWA status.

        A dead tail stays private (a leaf is never a tombstone); the live tail is split so its last
        node spans about one horizon, so that a lock on it protects ~horizon SWA tokens, not a whole
        prefill chunk.
        """
        live = [p in self.table.swa_of for p in pages]
        end = len(pages)
        while end > i and not live[end - 1]:
            end -= 1
        runs: list[tuple[int, int, bool]] = []
        start = i
        while start < end:
            stop = start
            while stop < end and live[stop] == live[start]:
                stop += 1
            runs.append((start, stop, live[start]))
            start = stop
        tail = -(-self.horizon // self.P)
        if runs and runs[-1][2] and runs[-1][1] - runs[-1][0] > tail:
            a, b, _ = runs.pop()
            runs += [(a, b - tail, True), (b - tail, b, True)]
        return runs

    def _recover(self, node: TreeNode, duplicates: list[int]) -> None:
        """Revive a tombstone with the SWA of a finished request's duplicate pages (same tokens)."""
        if any(a == b for a, b in zip(duplicates, node.pages, strict=True)) \
                or not all(p in self.table.swa_of for p in duplicates):
            return
        for src, dst in zip(duplicates, node.pages, strict=True):
            self.table.move_swa(src, dst)
        node.tombstone = False
        self.swa_live += len(node.pages)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split `node` after k pages; the new upper node inherits every lock (SWA holders too)."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.pages)
        upper = TreeNode(node.key[:k * self.P], node.pages[:k], parent=parent,
                         full_lock=node.full_lock, tombstone=node.tombstone,
                         last_used=node.last_used, start=node.start,
                         swa_holders=set(node.swa_holders))
        for handle in upper.swa_holders:
            handle.swa_nodes.append(upper)
        node.key, node.pages, node.parent = node.key[k * self.P:], node.pages[k:], upper
        node.start += k * self.P
        parent.children[upper.key[:self.P]] = upper
        upper.children[node.key[:self.P]] = node
        # counters: upper's pages carry the same locks/tombstone as before, so nothing changes
        return upper

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, full_pages: int, swa_pages: int) -> None:
        """Free at least the requested pages if the unlocked part of the tree allows it."""
        freed = 0
        while freed < full_pages:
            leaves = [n for n in self._nodes() if not n.children and n.full_lock == 0]
            if not leaves:
                break
            freed += self._delete(min(leaves, key=lambda n: n.last_used))
        freed_swa = 0
        while freed_swa < swa_pages:
            live = [n for n in self._nodes() if not n.tombstone and n.swa_lock == 0]
            if not live:
                break
            # inner nodes before anchors and leaves (a cached path keeps the SWA behind its
            # likely match points longest), then least recent first, then nearest the root first
            victim = min(live, key=lambda n: (n.anchor or not n.children, n.last_used, n.start))
            freed_swa += len(victim.pages)
            if not victim.children and victim.full_lock == 0:
                self._delete(victim)
            else:
                self._tombstone(victim)

    def flush(self) -> None:
        """Drop everything no request is using."""
        self.evict(self.num_pages, 0)

    def _tombstone(self, node: TreeNode) -> None:
        self.table.drop_swa(node.pages)
        node.tombstone = True
        self.swa_live -= len(node.pages)

    def _delete(self, node: TreeNode) -> int:
        """Remove an unlocked leaf (and the tombstoned unlocked ancestors it leaves as leaves)."""
        freed = 0
        while node is not self.root and not node.children and node.full_lock == 0:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[:self.P]]
            self.num_pages -= len(node.pages)
            self.swa_live -= 0 if node.tombstone else len(node.pages)
            self.table.release_shared(node.pages)
            freed += len(node.pages)
            if not parent.tombstone:
                break
            node = parent
        return freed

    # ---- helpers ------------------------------------------------------------------------------
    def _page_key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.P:(i + 1) * self.P])

    def _common_pages(self, node: TreeNode, tokens: Sequence[int], i: int, limit: int) -> int:
        k = 0
        while k < min(len(node.pages), limit) and node.key[k * self.P:(k + 1) * self.P] == \
                tuple(tokens[(i + k) * self.P:(i + k + 1) * self.P]):
            k += 1
        return k

    def _touch(self, node: TreeNode) -> None:
        now = next(self._clock)
        while node is not None and node is not self.root:
            node.last_used = now
            node = node.parent  # type: ignore[assignment]

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # ---- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        pages, full_prot, live, swa_prot = [], 0, 0, 0
        for n in self._nodes():
            assert n.parent is not None and n.parent.children.get(n.key[:self.P]) is n, (
                "broken parent link")
            assert len(n.key) == len(n.pages) * self.P and n.pages, "node key/pages mismatch"
            assert n.start == n.parent.start + len(n.parent.key), "node start position drifted"
            assert n.full_lock >= n.swa_lock >= 0, "full_lock < swa_lock"
            assert n.parent is self.root or n.parent.last_used >= n.last_used, (
                "LRU order: parent older than child")
            has_swa = [p in self.table.swa_of for p in n.pages]
            if n.tombstone:
                assert n.swa_lock == 0 and not any(has_swa), (
                    "tombstone with SWA pages or an SWA lock")
                assert n.children or n.full_lock > 0, "an unlocked tombstone leaf"
            else:
                assert all(has_swa), "live node with a page lacking SWA"
                live += len(n.pages)
                swa_prot += len(n.pages) if n.swa_lock else 0
            full_prot += len(n.pages) if n.full_lock else 0
            pages.extend(n.pages)
        assert len(pages) == len(set(pages)), "a page is in the tree twice"
        assert set(pages) == self.table.shared, "tree pages and the table's shared pages differ"
        assert (len(pages), full_prot, live, swa_prot) == (
            self.num_pages, self.full_protected, self.swa_live, self.swa_protected), (
            "page counters drifted")
