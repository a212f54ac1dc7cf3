"""PageAllocator: a free list of fixed-size pages. Page 0 is reserved as the null page.

Invariant (`check_integrity`): every page in 1..num_pages-1 is either free or allocated, never both,
and the free list has no duplicates. Allocation is all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Raised by `alloc` when fewer pages are free than requested (nothing is allocated)."""


class PageAllocator:
    def __init__(self, num_pages: int, name: str) -> None:
        assert num_pages >= 2, f"{name}: need at least one usable page besides the null page 0"
        self.name = name
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{self.name}: requested {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert p in self._used, f"{self.name}: freeing page {p} that is not allocated"
            self._used.remove(p)
            self._free.append(p)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: duplicate pages in the free list"
        assert not free & self._used, (f"{self.name}: pages both free and used: "
                                       f"{sorted(free & self._used)[:8]}")
        assert free | self._used == set(range(1, self.num_pages)), (
            f"{self.name}: pages lost or invented")
