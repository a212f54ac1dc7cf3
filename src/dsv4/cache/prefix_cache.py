"""The prefix-cache seam: what the scheduler asks of a prefix cache, and the cache that caches
nothing.

`PrefixCache` is the protocol the scheduler and the engine program against; `RadixPrefixCache`
(`cache/radix.py`, ShadowRadix) implements it, and `NoPrefixCache` implements it with no tree at
all (`--disable-radix-cache`): every match is empty, inserts adopt nothing (the request keeps and
later frees its pages), locks hold nothing. So the scheduler has one code path whichever is
configured.

Life of a request against either cache: `match` + `lock` at admission (the locked prefix is
mapped, not recomputed); `insert` + re-`lock` when complete pages are cached; `release_swa` once
the request is a horizon past its locked path; `insert` + `unlock` when it finishes or is
preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dsv4.cache.radix import LockHandle, PrefixMatch, RadixPrefixCache, TreeNode
from dsv4.cache.req_table import RequestTable


class PrefixCache(Protocol):
    """A prefix cache over the request table's full pages (semantics: `cache/radix.py`)."""

    @property
    def horizon(self) -> int:
        """Tokens behind a match point whose SWA state a continuing request reads."""
        ...

    @property
    def enabled(self) -> bool:
        """Whether anything is ever cached (False: `NoPrefixCache`)."""
        ...

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest usable cached prefix of `tokens[:-1]`, whole pages (one token is always left)."""
        ...

    def lock(self, node: TreeNode, length: int) -> LockHandle:
        """Pin the path ending at `node` (`length` tokens) against eviction."""
        ...

    def release_swa(self, handle: LockHandle) -> None:
        """Drop the SWA part of a lock (the request has moved a horizon past its path)."""
        ...

    def unlock(self, handle: LockHandle) -> None:
        ...

    def insert(self, tokens: Sequence[int], pages: list[int], finished: bool,
               anchor: int | None = None) -> TreeNode:
        """Offer a request's complete pages (`len(tokens) == len(pages) * page size`).
        `anchor`: pages up to the point where a repeat of the request's prompt would match (its
        SWA is kept longer). Returns the node that ends its cached path (to lock).
        """
        ...

    def flush(self) -> None:
        """Drop every entry no request uses."""
        ...

    def check_integrity(self) -> None:
        ...


class NoPrefixCache:
    """The prefix cache of `disable_prefix_cache`: nothing is ever cached or shared.

    Every path is the empty one at its own root node, so locks pin nothing and a request's pages
    stay private (the request table frees them with the request).
    """

    def __init__(self, horizon: int) -> None:
        self._horizon = horizon
        self.root = TreeNode((), [], full_lock=1)

    @property
    def horizon(self) -> int:
        return self._horizon

    @property
    def enabled(self) -> bool:
        return False

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        return PrefixMatch(self.root, [], 0)

    def lock(self, node: TreeNode, length: int) -> LockHandle:
        assert node is self.root, "NoPrefixCache hands out its root only"
        return LockHandle(node, length)

    def release_swa(self, handle: LockHandle) -> None:
        assert not handle.swa_nodes, "NoPrefixCache locks no SWA"

    def unlock(self, handle: LockHandle) -> None:
        assert handle.node is self.root, "a lock that NoPrefixCache did not hand out"

    def insert(self, tokens: Sequence[int], pages: list[int], finished: bool,
               anchor: int | None = None) -> TreeNode:
        return self.root

    def flush(self) -> None:
        return None

    def check_integrity(self) -> None:
        assert not self.root.children and self.root.full_lock == 1, "NoPrefixCache grew a tree"


def create_prefix_cache(table: RequestTable, horizon: int, enabled: bool) -> PrefixCache:
    """ShadowRadix over `table` (it evicts through the table's `evict` hook), or the empty cache."""
    return RadixPrefixCache(table, horizon) if enabled else NoPrefixCache(horizon)
