"""Free-list bookkeeping for the paged MLA cache (no tensors; nano-vllm's block manager in spirit).

A page holds `page_size` consecutive token positions of one request in every local MLA layer;
token position p of a request lives in page `page_ids[p // page_size]`, row `p % page_size`.
The same class, with another instance, books host-store pages for swapped requests.
"""

from __future__ import annotations

from collections import deque


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` token positions."""
    return -(-num_tokens // page_size)


class PagePool:
    """Page ids 0..num_pages-1; first-in first-out reuse so freed pages are not rewritten at once.

    `allocate(n)` returns None when fewer than n pages are free (and allocates nothing), so callers
    test for shortage without exceptions; freeing a page that is not allocated is an internal bug
    and raises AssertionError.
    """

    def __init__(self, num_pages: int, page_size: int = 64):
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages: expected an int >= 0, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size: expected an int > 0, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._used = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """Take n free pages.

        Returns:
            the page ids, or None (nothing taken) when fewer than n are free.
        """
        if n < 0:
            raise ValueError(f"allocate: expected n >= 0, got {n}")
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._used[i] = True
        return ids

    def free(self, ids) -> None:
        """Return pages to the pool; each must be allocated (and listed once)."""
        for i in ids:
            assert 0 <= i < self.num_pages and self._used[i], f"page {i} freed twice or never allocated"
            self._used[i] = False
            self._free.append(i)
