"""The decode graphs' host staging (cuda_graph.fill_rows) on the CPU: the same buffers a row-by-row fill writes,
for ragged page lists, a row without pages, no rows and a full bucket; a row with more pages than the graphs hold is
refused by name, with the buffers untouched; steps that remember what the rows hold (`written`) rewrite only
changed rows and still leave what a fresh fill leaves."""
import pytest
import torch

from k3runtime.cuda_graph import fill_rows


def _row_by_row(B, max_pages, rows, spare_slot, spare_page):
    cols = torch.tensor([[0] * B, [spare_slot] * B, [1] * B], dtype=torch.int64)
    pages = torch.full((B, max_pages), -1, dtype=torch.int64)
    pages[:, 0] = spare_page
    for i, (tok, slot, ctx, page_ids) in enumerate(rows):
        cols[:, i] = torch.tensor([tok, slot, ctx])
        pages[i, :len(page_ids)] = torch.tensor(page_ids, dtype=torch.int64)
    return cols, pages


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_fill_rows_matches_a_row_by_row_fill(n):
    B, max_pages, spare_slot, spare_page = 8, 6, 99, 77
    g = torch.Generator().manual_seed(n)
    rows = []
    for i in range(n):
        count = int(torch.randint(0, max_pages + 1, (1,), generator=g)) if i != 1 else 0  # row 1: no pages
        page_ids = (torch.randperm(50, generator=g)[:count] + 2**40 * (i % 2)).tolist()  # ids past int32 too
        rows.append((int(torch.randint(0, 1000, (1,), generator=g)), (7 * i + 3) % 17, 3 + i, page_ids))
    cols = torch.full((3, B), 12345, dtype=torch.int64)  # stale values from an earlier step
    pages = torch.full((B, max_pages), 12345, dtype=torch.int64)
    fill_rows(cols, pages, rows, spare_slot=spare_slot, spare_page=spare_page)
    want_cols, want_pages = _row_by_row(B, max_pages, rows, spare_slot, spare_page)
    assert torch.equal(cols, want_cols) and torch.equal(pages, want_pages)


def test_fill_rows_refuses_more_pages_than_the_graphs_hold():
    cols, pages = torch.full((3, 4), 5, dtype=torch.int64), torch.full((4, 3), 5, dtype=torch.int64)
    written = [None] * 4
    with pytest.raises(ValueError, match=r"row 1 \(slot 7\) has 4 pages; .* at most 3 \(max_pages\)"):
        fill_rows(cols, pages, [(1, 2, 3, [0]), (1, 7, 3, [0, 1, 2, 3])], spare_slot=0, spare_page=0,
                  written=written)
    assert (cols == 5).all() and (pages == 5).all()  # refused before anything was written
    assert written == [None] * 4


def test_remembered_rows_match_a_fresh_fill_over_steps():
    """A decode run's steps: pages that grow (a list grown in place, a tuple replaced), a page id changed in place at
    the same length, rows swapped, the batch shrinking to padding and growing back. Each step's buffers equal a
    fresh fill's, and the unchanged rows are not rewritten."""
    B, max_pages, spare_slot, spare_page = 6, 5, 40, 41
    a, b, c = [1, 2], (3,), [4, 5, 6]
    steps = [
        [(1, 0, 2, a), (2, 1, 1, b), (3, 2, 3, c)],
        [(1, 0, 3, a), (2, 1, 2, b), (3, 2, 4, c)],  # nothing changed but the cols
        "grow",
        "poke",
        [(3, 2, 5, c), (1, 0, 4, a)],                 # rows swapped, row 2 back to padding
        [],
        [(5, 3, 1, [9]), (3, 2, 6, c), (1, 0, 5, a), (2, 1, 3, b), (6, 4, 1, ()), (7, 5, 1, [10, 11])],
    ]
    cols, pages = torch.zeros(3, B, dtype=torch.int64), torch.zeros(B, max_pages, dtype=torch.int64)
    written = [None] * B
    skipped = 0
    for step in steps:
        if step == "grow":  # the scheduler grows a request's list in place; another's ids come as a new tuple
            a.append(7)
            b = b + (8,)
            rows = [(1, 0, 4, a), (2, 1, 3, b), (3, 2, 5, c)]
        elif step == "poke":  # same length, one id changed in place
            c[1] = 50
            rows = [(1, 0, 4, a), (2, 1, 3, b), (3, 2, 5, c)]
        else:
            rows = step
        unchanged = [i for i, row in enumerate(rows) if written[i] == tuple(row[3])]
        kept = pages[unchanged].clone()
        pages[unchanged] = 12345  # marks rows a rewrite would overwrite
        fill_rows(cols, pages, rows, spare_slot=spare_slot, spare_page=spare_page, written=written)
        assert (pages[unchanged] == 12345).all(), step  # not rewritten
        pages[unchanged] = kept
        want_cols, want_pages = _row_by_row(B, max_pages, rows, spare_slot, spare_page)
        assert torch.equal(cols, want_cols) and torch.equal(pages, want_pages), step
        assert written[:len(rows)] == [tuple(row[3]) for row in rows]
        skipped += len(unchanged)
    assert len(written) == B and skipped == 3 + 1 + 2  # step 2 (all), "grow" (c), "poke" (a, b)
