"""Which data-parallel rank serves a new request (`DataParallelEngine`, `--load-balance-method`;
the names: `config/server.py::LOAD_BALANCE_METHODS`).

Each DP rank has its own prefix cache, so a request whose prompt shares a prefix with earlier
requests is cheapest on the rank that served them. Methods:

* "shortest_queue" (the default; SGLang's name): the rank with the fewest unfinished requests,
  ties to the lowest rank.
* "cache_aware" (sgl-router's name): `PrefixRouter` keeps rank 0's approximate view of every
  rank's cache, the full pages of the prompts it sent there, and sends a request to the rank
  whose view matches the most leading pages of its prompt (ties to the fewer unfinished
  requests, then the lowest rank), unless that rank holds more than `BALANCE_SLACK` unfinished
  requests above the least loaded one, which then takes it (as "shortest_queue" would).

The view is approximate by design (no message from the ranks): it records what was sent, not
what a rank's cache still holds after eviction; its own LRU bound (`capacity_pages` per rank, the
rank's KV pages) forgets the oldest pages first, as the caches do. Routing changes only where a
request runs: its outputs are the same on every rank (the DP tests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BALANCE_SLACK = 32
"""Unfinished requests a cache hit may put on a rank above the least loaded one (sgl-router's
absolute balance threshold)."""


def shortest_queue(load: Sequence[int]) -> int:
    """The rank with the fewest unfinished requests (ties: the lowest)."""
    return min(range(len(load)), key=lambda r: (load[r], r))


class PrefixRouter:
    """Rank 0's approximate view of each rank's prefix cache ("cache_aware", module docstring):
    per rank, the chained hashes of the full `page_size`-token pages it was sent, least recently
    used first, at most `capacity_pages` of them."""

    def __init__(self, world: int, page_size: int, capacity_pages: int) -> None:
        if world < 1 or page_size < 1 or capacity_pages < 1:
            raise ValueError(f"world={world}, page_size={page_size}, capacity_pages="
                             f"{capacity_pages} are invalid; allowed: >= 1 each")
        self.page_size, self.capacity = page_size, capacity_pages
        self.views: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(world)]

    def pick(self, prompt_ids: Sequence[int], load: Sequence[int]) -> int:
        """The rank for a prompt, given each rank's unfinished requests; records the prompt's
        pages in that rank's view."""
        assert len(load) == len(self.views), "one load per rank"
        chain = self.chain(prompt_ids)
        least = shortest_queue(load)
        pages = [self.matched(chain, r) for r in range(len(load))]
        best = max(range(len(load)), key=lambda r: (pages[r], -load[r], -r))
        hit = pages[best] > 0 and load[best] - load[least] <= BALANCE_SLACK
        rank = best if hit else least
        self._record(chain, rank)
        return rank

    def chain(self, prompt_ids: Sequence[int]) -> list[int]:
        """One hash per full page, each over the page's ids and the previous page's hash (a
        page's hash names its whole prefix, as a radix path does)."""
        out: list[int] = []
        h = 0
        for start in range(0, len(prompt_ids) - self.page_size + 1, self.page_size):
            h = hash((h, tuple(prompt_ids[start:start + self.page_size])))
            out.append(h)
        return out

    def matched(self, chain: list[int], rank: int) -> int:
        """How many leading pages of `chain` rank `rank`'s view holds."""
        view = self.views[rank]
        n = 0
        while n < len(chain) and chain[n] in view:
            n += 1
        return n

    def _record(self, chain: list[int], rank: int) -> None:
        view = self.views[rank]
        for h in chain:
            view[h] = None
            view.move_to_end(h)
        while len(view) > self.capacity:
            view.popitem(last=False)

    def check_integrity(self) -> None:
        for rank, view in enumerate(self.views):
            assert len(view) <= self.capacity, f"rank {rank}'s view holds {len(view)} pages"
