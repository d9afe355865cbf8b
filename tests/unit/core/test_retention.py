"""Which weight versions the Tensor Store deletes (run.keep_weight_versions)."""

from __future__ import annotations

from spotlight.core.retention import versions_to_delete


def test_keeps_the_newest_n_and_every_version_still_needed():
    on_disk = [0, 1, 2, 3, 4, 5]
    assert versions_to_delete(on_disk, newest=5, keep=3) == [0, 1, 2]
    # v1: a spot worker still explores on it; v2: an unfinished request; v0: the checkpoint's
    assert versions_to_delete(on_disk, newest=5, keep=3, needed={0, 1, 2}) == []
    assert versions_to_delete(on_disk, newest=5, keep=3, needed={1}) == [0, 2]
    assert versions_to_delete(on_disk, newest=5, keep=2, needed={9}) == [0, 1, 2, 3]


def test_zero_keeps_everything_and_few_versions_delete_nothing():
    assert versions_to_delete(range(100), newest=99, keep=0) == []
    assert versions_to_delete([0, 1], newest=1, keep=3) == []
    # a resumed run republishes an older version: newer files on disk are not "older than the newest keep"
    assert versions_to_delete([0, 1, 2, 3, 4], newest=2, keep=2) == [0]


def test_tensor_store_lists_and_deletes_versions(tmp_path):
    from spotlight.store.tensor_store import TensorStore

    store = TensorStore(tmp_path).open()
    for v in range(4):
        store.put_weights(v, b"x" * 16)
    assert store.weight_versions() == [0, 1, 2, 3]
    for v in versions_to_delete(store.weight_versions(), newest=3, keep=2, needed={0}):
        store.delete_weights(v)
    assert store.weight_versions() == [0, 2, 3] and store.weights_info(1) is None
