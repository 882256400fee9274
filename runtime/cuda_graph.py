"""Decode steps replayed from CUDA graphs, one graph per batch bucket (as nano-vllm does).

A pure decode step of N sequences (one token each, every one sampled) replays the graph captured for the
smallest bucket >= N (attention-DP ranks: the bucket the driver picked for all of them, which may be larger). The
rows past N point at the spare KDA slot and the spare MLA page that `open_rank` sets aside, so their writes land
where nothing reads. Step inputs go through pinned host buffers and
non-blocking copies into the graph's static tensors: the step has no device->host sync until the caller
reads the logits. The plugins are sync-free by contract (shapes alone pick their paths); capture fails loudly
if one is not.

A pipeline stage's graphs take the previous stage's hidden state and snapshots (`stage_in`) in static buffers too,
and hand back every graph output (the next stage's inputs, or the logits); the send and receive between stages
stay outside the graphs. A step's micro-batches replay one after another with no sync between them, so each
takes its own set of pinned host buffers (`host_sets`), rewritten only once its last copy has run.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .executor import Executor, StepBatch, feed_tokens


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted({*small, *range(16, max_batch, 16), max_batch})


def bucket_for(buckets: list[int], n: int) -> int | None:
    """The smallest of the (sorted) buckets that holds n sequences, or None."""
    return next((b for b in buckets if b >= n), None)


_PADDING = object()  # in `written`: the row holds padding


def fill_rows(cols: torch.Tensor, pages: torch.Tensor, rows: Sequence[tuple[int, int, int, Sequence[int]]], *,
              spare_slot: int, spare_page: int, written: list | None = None) -> None:
    """Write a step's rows into the host buffers, in place: cols [3, B] int64 (token id, slot, context length) and
    pages [B, max_pages] int64 (each row's page ids, then -1); rows past len(rows) are padding (token 0, the spare
    slot, context 1, the spare page; a row without pages holds the spare page too). Through numpy views and one
    flat copy of the page ids: the GPU waits while this runs, and a Python loop over the rows was 7-8x slower
    (BENCHMARKS.md, twenty-fifth session).

    written: what each row of `pages` holds now (B entries: a tuple of page ids, or None when not known), kept up to
    date by this call, which then rewrites only the rows whose ids changed. In steady decode a row's pages change
    once in page_size steps, so most steps write the cols alone. Page lists are compared as tuples of their values
    (a list is copied: its owner may grow it in place)."""
    c, p = cols.numpy(), pages.numpy()
    B, n = p.shape[0], len(rows)
    toks, slots, ctxs, page_lists = zip(*rows) if n else ((),) * 4
    ids = [tuple(x) for x in page_lists]  # a tuple stays itself
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=n)
    if n and lens.max() > p.shape[1]:  # checked before anything is written
        i = int(lens.argmax())
        raise ValueError(f"row {i} (slot {slots[i]}) has {lens[i]} pages; the graphs were made for at most "
                         f"{p.shape[1]} (max_pages)")
    c[0], c[1], c[2] = 0, spare_slot, 1
    if n:
        c[:, :n] = (toks, slots, ctxs)
    if written is None:
        written = [None] * B
    pad = [i for i in range(n, B) if written[i] is not _PADDING]
    if pad:
        p[pad] = -1
        p[pad, 0] = spare_page
        written[n:] = [_PADDING] * (B - n)
    todo = [i for i in range(n) if written[i] != ids[i]]
    if todo:
        block = np.full((len(todo), p.shape[1]), -1, dtype=np.int64)
        block[:, 0] = spare_page  # what a row without pages keeps, as padding does
        block[np.arange(p.shape[1]) < lens[todo, None]] = np.fromiter(
            itertools.chain.from_iterable(ids[i] for i in todo), dtype=np.int64, count=int(lens[todo].sum()))
        p[todo] = block
        for i in todo:
            written[i] = ids[i]


class DecodeGraphs:
    def __init__(self, executor: Executor, *, max_batch: int, max_pages: int, spare_slot: int, spare_page: int,
                 buckets: list[int] | None = None, stage_in: dict[str, tuple[int, torch.dtype]] | None = None,
                 host_sets: int = 1):
        """stage_in: the graph inputs a pipeline stage receives (name -> (width, dtype), a row a token);
        host_sets: how many micro-batches a step replays before the caller syncs."""
        self.executor = executor
        self.spare_slot, self.spare_page = spare_slot, spare_page
        self.buckets = sorted(buckets or default_buckets(max_batch))
        B = self.buckets[-1]
        device = next(iter(executor.weights.values())).device
        # [ids | slot | context_len] and the page table side by side in one buffer, staged in pinned memory, copied
        # in one call without a sync
        size = 3 * B + B * max_pages
        self.host_inputs = [torch.zeros(size, dtype=torch.int64).pin_memory() for _ in range(host_sets)]
        self.host_cols = [t[:3 * B].view(3, B) for t in self.host_inputs]
        self.host_pages = [t[3 * B:].view(B, max_pages) for t in self.host_inputs]
        self.copied = [None] * host_sets  # the event after each host set's last copy (made once, recorded again)
        self.written = [[None] * B for _ in range(host_sets)]  # each host set's page rows as written (fill_rows)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.cols, self.pages = self.inputs[:3 * B].view(3, B), self.inputs[3 * B:].view(B, max_pages)
        self.cu = torch.arange(B + 1, dtype=torch.int64, device=device)
        self.stage_in = {name: torch.zeros(B, width, dtype=dtype, device=device)
                         for name, (width, dtype) in (stage_in or {}).items()}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}

    def _batch(self, n: int) -> StepBatch:
        return StepBatch(input_ids=self.cols[0, :n], cu_seqlens=self.cu[:n + 1], slot_ids=self.cols[1, :n],
                         context_lens=self.cols[2, :n], page_table=self.pages[:n], logits_indices=self.cu[:n])

    def _stage(self, rows: list[tuple[int, int, int, list[int]]], host_set: int = 0, bucket: int | None = None) -> None:
        """rows: (token id, slot, context length, page ids) per sequence; the rest become padding. bucket: the
        graph to replay, whose page-table rows alone are uploaded (all of them when None)."""
        self._fill(rows, host_set)
        self._upload(host_set, bucket)

    def _fill(self, rows: list[tuple[int, int, int, list[int]]], host_set: int) -> None:
        """The rows into the host set's pinned buffer, once its previous copy has run."""
        if len(rows) > self.buckets[-1]:
            raise ValueError(f"{len(rows)} rows exceed the largest captured bucket {self.buckets[-1]}")
        if self.copied[host_set] is not None:
            self.copied[host_set].synchronize()  # at once, unless micro-batches wrap
        fill_rows(self.host_cols[host_set], self.host_pages[host_set], rows, spare_slot=self.spare_slot,
                  spare_page=self.spare_page, written=self.written[host_set])

    def _upload(self, host_set: int, bucket: int | None = None) -> None:
        """The host set's buffer into the graphs' inputs, one non-blocking copy of the cols and the first `bucket`
        page-table rows: the graph of that bucket reads no others, and the whole table is B_max x max_pages int64
        (1 MiB for the tep16 recipe, 8 MiB at 1M context), copied every step. The host buffer always holds every
        row, so a later, larger bucket copies its rows whole from it."""
        size = self.inputs.numel() if bucket is None else 3 * self.buckets[-1] + bucket * self.pages.shape[1]
        self.inputs[:size].copy_(self.host_inputs[host_set][:size], non_blocking=True)
        if self.copied[host_set] is None:
            self.copied[host_set] = torch.cuda.Event()
        self.copied[host_set].record()

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool. Python's cyclic GC is off meanwhile: a
        collection inside a capture may destroy an earlier engine's graphs (CUDAGraph reset is not permitted while
        a stream captures), which invalidates the capture; garbage is collected before it instead."""
        self._stage([])
        pool = None
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for n in reversed(self.buckets):
                batch, extra = self._batch(n), {name: t[:n] for name, t in self.stage_in.items()}
                self.executor.run(batch, extra)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.executor.run(batch, extra)
                pool = graph.pool()
                self.graphs[n], self.outputs[n] = graph, out
        finally:
            if enabled:
                gc.enable()
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return bucket_for(self.buckets, n)

    def replay(self, rows: list[tuple[int, int, int, list[int]]]) -> torch.Tensor:
        """Logits [len(rows), V] fp32 of one decode step (a view of the graph's output: read it before the
        next replay)."""
        return self.run(rows)["logits"]

    def run(self, rows: list[tuple[int, int, int, list[int]]], stage_in: dict[str, torch.Tensor] | None = None,
            host_set: int = 0, bucket: int | None = None, fed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Every output of one decode step's graph, its first len(rows) rows (views: use them before the next
        replay). stage_in: the received stage inputs, [len(rows), width] each. bucket: replay this captured bucket
        (attention-DP ranks share one) instead of the smallest that holds the rows. fed: the previous step's
        sampled ids on the device, which rows whose token id is FED - i take (executor.feed_tokens), after the
        upload and before the replay: staging needs no token from the host."""
        n = len(rows)
        b = self.bucket(n) if bucket is None else bucket
        if b is None:
            raise ValueError(f"decode step of {n} sequences exceeds the largest captured bucket {self.buckets[-1]}")
        if b not in self.graphs or n > b:
            raise ValueError(f"bucket {b} cannot replay {n} sequences (captured buckets: {self.buckets})")
        if set(stage_in or {}) != set(self.stage_in):
            raise ValueError(f"stage inputs {sorted(stage_in or {})}, expected {sorted(self.stage_in)}")
        self._stage(rows, host_set, b)
        if fed is not None:
            feed_tokens(self.cols[0, :n], fed)
        for name, t in (stage_in or {}).items():
            self.stage_in[name][:n].copy_(t)
        self.graphs[b].replay()
        return {name: t[:n] for name, t in self.outputs[b].items()}
