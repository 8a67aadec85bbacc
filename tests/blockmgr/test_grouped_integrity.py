"""`GroupedStore.check_integrity` over the one structure of all groups.

Each test builds a store whose trie and sequences hold pages of both
groups (full attention + a sliding window), corrupts one field of that
structure (a node's page list of group 1, a sequence's group-1 table or
released count, a group-1 reference count) and expects `IntegrityError`.
"""

from __future__ import annotations

import pytest

from blockmgr import GroupedStore, GroupedStoreConfig, IntegrityError

BLOCK = 4


def cached_store() -> tuple[GroupedStore, object]:
    """Full + a 6-token window; a 30-token prefix cached (with holes in
    group 1 before its window), and a live sequence hitting 29 of it."""
    store = GroupedStore(GroupedStoreConfig(num_blocks=32, block_size=BLOCK, windows=(None, 6)))
    stem = list(range(100, 130))
    store.allocate("a", stem)
    store.free("a")
    alloc = store.allocate("b", stem[:29] + [7, 8])
    assert alloc.num_cached_tokens == 29
    store.check_integrity()
    return store, store


def the_node(manager):
    """The cached leaf, whose page lists the tests below corrupt."""
    # private on purpose: no public call gives a trie node (only its tokens or a hit's pages)
    (node,) = [n for n in manager._trie._nodes.values() if not n.children]
    return node


def test_the_intact_structure_passes_with_holes_in_group_1():
    store, manager = cached_store()
    # private on purpose: the shape the corruptions below rely on, in the node itself
    node = the_node(manager)
    assert None in node.pages[1] and None not in node.pages[0]  # the window keeps its end only
    assert store.block_table("b", 1)[0] is None  # released before the window
    assert None not in store.block_table("b", 0)


def test_a_node_page_of_group_1_that_is_another_page_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    node = the_node(manager)
    (spare,) = manager._groups[1].pages.take(1)
    node.pages[1][-1] = spare  # the reference counts now disagree with the node
    with pytest.raises(IntegrityError):
        store.check_integrity()


def test_a_node_without_its_group_1_pages_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    del the_node(manager).pages[1]
    with pytest.raises(IntegrityError, match="other groups"):
        store.check_integrity()


def test_a_node_page_of_group_1_before_a_hole_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    pages = the_node(manager).pages[1]
    first_held = pages.count(None)
    pages[first_held - 1], pages[first_held] = pages[first_held], None
    with pytest.raises(IntegrityError, match="before a hole"):
        store.check_integrity()


def test_a_sequence_released_count_of_group_1_out_of_step_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    manager._seqs["b"].released[1] += 1
    with pytest.raises(IntegrityError, match="released out of order"):
        store.check_integrity()


def test_a_sequence_table_of_group_1_too_short_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    seq = manager._seqs["b"]
    manager._groups[1].pages.release(seq.tables[1].pop())
    with pytest.raises(IntegrityError, match="pages of group 1"):
        store.check_integrity()


def test_a_group_1_reference_count_off_by_one_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    manager._groups[1].pages.incref(store.block_table("b", 1)[-1])
    with pytest.raises(IntegrityError):
        store.check_integrity()


def test_a_sequence_without_its_group_1_table_is_caught():
    store, manager = cached_store()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    seq = manager._seqs["b"]
    manager._groups[1].pages.release_all(seq.tables[1][seq.released[1] :])
    del seq.tables[1], seq.released[1]
    with pytest.raises(IntegrityError, match="other groups"):
        store.check_integrity()
