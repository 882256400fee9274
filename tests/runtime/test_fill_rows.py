"""The decode graphs' host staging (cuda_graph.fill_rows) on the CPU: the same buffers a row-by-row fill writes,
for ragged page lists, a row without pages, no rows and a full bucket; a row with more pages than the graphs hold is
refused by name, with the buffers untouched."""
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
    with pytest.raises(ValueError, match=r"row 1 \(slot 7\) has 4 pages; .* at most 3 \(max_pages\)"):
        fill_rows(cols, pages, [(1, 2, 3, [0]), (1, 7, 3, [0, 1, 2, 3])], spare_slot=0, spare_page=0)
    assert (cols == 5).all() and (pages == 5).all()  # refused before anything was written
