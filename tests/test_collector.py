"""The collector kept off long-lived objects (trainer/core/collector.py) still frees what it must."""

from __future__ import annotations

import gc
import weakref

import pytest

from trainer.core import collector


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: refcounting alone never frees it


@pytest.fixture(autouse=True)
def unfrozen():
    yield
    gc.unfreeze()


def test_a_cycle_alive_when_settled_is_freed_by_the_next_settle_once_dropped():
    node = Node()
    held = weakref.ref(node)
    collector.settle()
    del node
    gc.collect()  # the interpreter's own and the libraries' collections do not walk it
    assert held() is not None
    collector.settle()
    assert held() is None


def test_an_error_inside_the_frozen_block_leaves_its_objects_to_the_next_collection():
    """An out-of-memory error while training: the step-down's `gc.collect()` frees the failed trainer (model/stepdown.py)."""
    node = Node()
    held = weakref.ref(node)
    with pytest.raises(RuntimeError), collector.frozen():
        raise RuntimeError("out of memory")
    del node
    gc.collect()
    assert held() is None


def test_after_training_the_objects_stay_out_of_the_collections_until_the_next_settle():
    """accelerate's `free_memory` at the end of `Trainer.train` then walks only what training created."""
    node = Node()
    held = weakref.ref(node)
    with collector.frozen():
        pass
    del node
    gc.collect()
    assert held() is not None and gc.get_freeze_count() > 0
