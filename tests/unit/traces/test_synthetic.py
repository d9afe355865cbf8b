"""Synthetic preemption cycles (paper §6.5, Fig. 13): the pool, the cycles, the fragmentation."""

import pytest

from spotlight.traces.formats import fragmentation_timeline
from spotlight.traces.synthetic import preemption_cycles


def test_each_cycle_halves_the_pool_one_gpu_per_node_and_recovers():
    acts = preemption_cycles(4, 2, cycles_per_iteration=2, iteration_s=100.0, iterations=3, down_s=5.0)
    tl = fragmentation_timeline(acts, 2)
    assert tl[0] == (0.0, 8, 0)
    # 3 iterations x 2 cycles: at 25, 75, 125, ... the pool drops to 4 with every node fragmented
    drops = [(t, live, frag) for t, live, frag in tl if live == 4]
    assert [t for t, _, _ in drops] == [25.0, 75.0, 125.0, 175.0, 225.0, 275.0]
    assert all(frag == 4 for _, _, frag in drops)  # one survivor per node: all at SP = 1
    assert [t for t, live, _ in tl if live == 8][1:] == [30.0, 80.0, 130.0, 180.0, 230.0, 280.0]
    kinds = {a.kind for a in acts if a.t_s > 0}
    assert kinds == {"revoke_gpu", "add_gpu"}  # no node loses its last GPU


def test_taking_more_than_one_gpu_per_node_preempts_whole_nodes():
    acts = preemption_cycles(2, 2, cycles_per_iteration=1, iteration_s=10.0, iterations=1, revoke_gpus=4, down_s=1.0)
    assert sorted(a.kind for a in acts if a.t_s == 5.0) == ["preempt_node", "preempt_node", "revoke_gpu", "revoke_gpu"]
    assert sorted(a.kind for a in acts if a.t_s == 6.0) == ["add_gpu", "add_gpu", "start_node", "start_node"]


def test_zero_cycles_is_a_static_pool_and_bad_input_is_refused():
    assert len(preemption_cycles(3, 2, cycles_per_iteration=0, iteration_s=10.0, iterations=5)) == 6
    with pytest.raises(ValueError, match="overlap"):
        preemption_cycles(4, 2, cycles_per_iteration=8, iteration_s=40.0, iterations=1, down_s=5.0)
    with pytest.raises(ValueError, match="revoke_gpus"):
        preemption_cycles(4, 2, cycles_per_iteration=1, iteration_s=40.0, iterations=1, revoke_gpus=9)
