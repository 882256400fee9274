import pytest

from k3runtime.kv_cache import PagePool, pages_needed


def test_allocate_free_counts_and_fifo_reuse():
    pool = PagePool(5, page_size=16)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 2 and pool.num_used == 3
    pool.free([1])
    # Freed pages go to the back of the queue, so the untouched ones are handed out first.
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(1) == [1] and pool.num_free == 0
    pool.free(a[:1] + [1, 2, 3, 4])
    assert pool.num_free == 5 and sorted(pool.allocate(5)) == list(range(5))


def test_short_returns_none_and_takes_nothing():
    pool = PagePool(4)
    assert pool.allocate(3) is not None
    assert pool.allocate(2) is None and pool.num_free == 1
    assert pool.allocate(0) == [] and pool.allocate(1) == [3]


@pytest.mark.parametrize("ids", [[2], [0, 0]], ids=["never-allocated", "twice-in-one-call"])
def test_double_free_asserts(ids):
    pool = PagePool(4)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(ids)


def test_out_of_range_free_asserts():
    with pytest.raises(AssertionError):
        PagePool(2).free([7])


@pytest.mark.parametrize("tokens,expect", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2), (1000, 16)])
def test_pages_needed(tokens, expect):
    assert pages_needed(tokens, 64) == expect == PagePool(1).pages_needed(tokens)


@pytest.mark.parametrize("kw,field", [({"num_pages": -1}, "num_pages"), ({"num_pages": 2, "page_size": 0}, "page_size")])
def test_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        PagePool(**kw)
    with pytest.raises(ValueError, match="n >= 0"):
        PagePool(2).allocate(-1)
