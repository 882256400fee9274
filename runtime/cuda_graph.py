"""Decode steps replayed from CUDA graphs, one graph per batch bucket (as nano-vllm does).

A pure decode step of N sequences (one token each, every one sampled) replays the graph captured for the
smallest bucket >= N. The rows past N point at the spare KDA slot and the spare MLA page that `open_rank`
sets aside, so their writes land where nothing reads. Step inputs go through pinned host buffers and
non-blocking copies into the graph's static tensors: the step has no device->host sync until the caller
reads the logits. The plugins are sync-free by contract (shapes alone pick their paths); capture fails loudly
if one is not.
"""

from __future__ import annotations

import torch

from .executor import Executor, StepBatch


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted({*small, *range(16, max_batch, 16), max_batch})


class DecodeGraphs:
    def __init__(self, executor: Executor, *, max_batch: int, max_pages: int, spare_slot: int, spare_page: int,
                 buckets: list[int] | None = None):
        self.executor = executor
        self.spare_slot, self.spare_page = spare_slot, spare_page
        self.buckets = sorted(buckets or default_buckets(max_batch))
        B = self.buckets[-1]
        device = next(iter(executor.weights.values())).device
        # [ids | slot | context_len] and the page table, staged in pinned memory, copied without a sync
        self.host_cols = torch.zeros(3, B, dtype=torch.int64).pin_memory()
        self.host_pages = torch.zeros(B, max_pages, dtype=torch.int64).pin_memory()
        self.cols = torch.zeros(3, B, dtype=torch.int64, device=device)
        self.pages = torch.zeros(B, max_pages, dtype=torch.int64, device=device)
        self.cu = torch.arange(B + 1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _batch(self, n: int) -> StepBatch:
        return StepBatch(input_ids=self.cols[0, :n], cu_seqlens=self.cu[:n + 1], slot_ids=self.cols[1, :n],
                         context_lens=self.cols[2, :n], page_table=self.pages[:n], logits_indices=self.cu[:n])

    def _stage(self, rows: list[tuple[int, int, int, list[int]]]) -> None:
        """rows: (token id, slot, context length, page ids) per sequence; the rest become padding."""
        if len(rows) > self.buckets[-1]:
            raise ValueError(f"{len(rows)} rows exceed the largest captured bucket {self.buckets[-1]}")
        cols, pages = self.host_cols, self.host_pages
        cols[0].zero_()
        cols[1].fill_(self.spare_slot)
        cols[2].fill_(1)
        pages.fill_(-1)
        pages[:, 0] = self.spare_page
        for i, (tok, slot, ctx, page_ids) in enumerate(rows):
            cols[0, i], cols[1, i], cols[2, i] = tok, slot, ctx
            pages[i, :len(page_ids)] = torch.tensor(page_ids, dtype=torch.int64)
        self.cols.copy_(cols, non_blocking=True)
        self.pages.copy_(pages, non_blocking=True)

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        self._stage([])
        pool = None
        for n in reversed(self.buckets):
            batch = self._batch(n)
            self.executor.run(batch)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.executor.run(batch)
            pool = graph.pool()
            self.graphs[n], self.logits[n] = graph, out["logits"]
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def replay(self, rows: list[tuple[int, int, int, list[int]]]) -> torch.Tensor:
        """Logits [len(rows), V] fp32 of one decode step (a view of the graph's output: read it before the
        next replay)."""
        n = len(rows)
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"decode step of {n} sequences exceeds the largest captured bucket {self.buckets[-1]}")
        self._stage(rows)
        self.graphs[b].replay()
        return self.logits[b][:n]
