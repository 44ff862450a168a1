"""The collector around a compiling call (sbd_ext.decoding.compile_options.gc_paused): paused inside, restored after
(also on an exception), never turned on where it was off, and one full collection after a block that left many new
tracked objects -- cyclic garbage made inside is gone after the block, and stays where the block made little."""

import gc
import weakref

import pytest

from sbd_ext.decoding import compile_options
from sbd_ext.decoding.compile_options import gc_paused


class _Node:
    pass


def _cycle() -> weakref.ref:
    """A two-object reference cycle, unreachable on return; a weak reference to one of them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    gc.collect()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_restored(collector_on):
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_left_off_where_it_was_off(collector_on):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
        ref = _cycle()
        keep = [[] for _ in range(compile_options.COLLECT_AFTER + 1000)]
    assert not gc.isenabled()
    assert ref() is not None  # no collection: the caller had the collector off
    del keep


def test_one_full_collection_after_a_large_block(collector_on):
    runs = []

    def seen(phase, info):
        if phase == "stop":
            runs.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with gc_paused():
            ref = _cycle()
            keep = [[] for _ in range(compile_options.COLLECT_AFTER + 1000)]  # tracked objects, still alive
            assert runs == []  # nothing collected inside, whatever was allocated
        assert runs == [2]  # one full collection at the exit
        assert ref() is None
        assert len(keep) > compile_options.COLLECT_AFTER  # (alive until here: freed, they would lower the count)
        runs.clear()
        with gc_paused():
            ref = _cycle()
        assert runs == []  # a small block: no collection
        assert ref() is not None
    finally:
        gc.callbacks.remove(seen)
