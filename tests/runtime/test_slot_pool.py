import pytest

from k3runtime.kv_cache import SlotPool


def test_allocate_until_empty_then_none():
    pool = SlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.num_free == 0 and pool.num_used == 3
    assert pool.allocate() is None
    pool.free(1)
    assert pool.num_free == 1 and pool.allocate() == 1


def test_double_free_asserts():
    pool = SlotPool(2)
    s = pool.allocate()
    pool.free(s)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(s)
    with pytest.raises(AssertionError):
        pool.free(5)


def test_zero_slots_pool_and_validation():
    assert SlotPool(0).allocate() is None
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(-2)
