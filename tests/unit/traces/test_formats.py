"""Unit tests for spotlight.traces.formats: Bamboo spot trace loading, slicing, placement, replay."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spotlight.traces.formats import (
    ReplayAction,
    TraceEvent,
    TracePlacement,
    TraceReplayer,
    alive_at,
    alive_counts,
    count_kinds,
    fragmentation,
    fragmentation_summary,
    fragmentation_timeline,
    load_bamboo_trace,
    slice_trace,
)

P3 = Path(__file__).resolve().parents[3] / "examples" / "traces" / "bamboo" / "p3-trace.csv"


@pytest.fixture(scope="module")
def p3() -> list[TraceEvent]:
    return load_bamboo_trace(P3)


# -- loading ------------------------------------------------------------------


def test_p3_trace_shape(p3):
    assert P3.read_bytes().count(b"\r\n") == 344  # the copy keeps CRLF endings
    assert len(p3) == 344
    assert len({e.node for e in p3}) == 177
    assert Counter(e.action for e in p3) == {"add": 177, "remove": 167}
    assert max(c for _, c in alive_counts(p3)) == 32
    assert p3[-1].t_s == 40920.0  # 40920000 ms
    assert alive_counts(p3)[-1][1] == 10
    assert all(b.t_s >= a.t_s for a, b in zip(p3, p3[1:]))


def test_crlf_handled(p3):
    assert not any("\r" in e.node or "\n" in e.node for e in p3)
    assert all(e.node.startswith("node") and e.node[4:].isdigit() for e in p3)


def test_lf_and_unsorted_input(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("120000,remove,a\n0,add,a\n60000,add,b\n\n")
    evs = load_bamboo_trace(f)
    assert evs == [TraceEvent(0.0, "add", "a"), TraceEvent(60.0, "add", "b"), TraceEvent(120.0, "remove", "a")]


@pytest.mark.parametrize(
    "bad, why",
    [
        ("60000,add\r\n", "expected 3 fields"),
        ("1.5e3,add,node9\r\n", "not an integer"),
        ("-60000,add,node9\r\n", "negative"),
        ("60000,join,node9\r\n", "neither 'add' nor 'remove'"),
        ("60000,add,\r\n", "empty node"),
        ("60000,remove,node9\r\n", "not alive"),
        ("60000,add,node1\r\n", "already alive"),
    ],
)
def test_malformed_line_named(tmp_path, bad, why):
    f = tmp_path / "bad.csv"
    f.write_bytes(b"0,add,node1\r\n0,add,node2\r\n" + bad.encode())
    with pytest.raises(ValueError) as exc:
        load_bamboo_trace(f)
    assert "bad.csv:3:" in str(exc.value)
    assert why in str(exc.value)


# -- slicing / alive counts ---------------------------------------------------------


def test_slice_initial_population_and_rebase(p3):
    start, dur = 2 * 3600.0, 1800.0
    s = slice_trace(p3, start, dur)
    window = [e for e in p3 if start <= e.t_s < start + dur]
    synthetic = s[: len(s) - len(window)]
    assert all(e.t_s == 0.0 and e.action == "add" for e in synthetic)
    assert len(synthetic) == alive_at(p3, start - 1e-9)
    # the slice starts from the trace's population at 2 h, and follows it exactly
    assert alive_counts(s)[0] == (0.0, alive_at(p3, start))
    assert alive_at(p3, start) == 30
    for t, c in alive_counts(s):
        assert c == alive_at(p3, start + t)
    rest = s[len(synthetic) :]
    assert [(e.t_s + start, e.action, e.node) for e in rest] == [(e.t_s, e.action, e.node) for e in window]
    assert all(0.0 <= e.t_s < dur for e in s)


def test_slice_events_at_start_come_after_population():
    evs = [
        TraceEvent(0.0, "add", "a"),
        TraceEvent(10.0, "add", "b"),
        TraceEvent(10.0, "remove", "a"),
        TraceEvent(30.0, "add", "c"),
    ]
    s = slice_trace(evs, 10.0, 20.0)
    assert s == [TraceEvent(0.0, "add", "a"), TraceEvent(0.0, "add", "b"), TraceEvent(0.0, "remove", "a")]
    assert alive_counts(s) == [(0.0, 1)]
    with pytest.raises(ValueError):
        slice_trace(evs, 0.0, 0.0)


def test_alive_counts_collapses_timestamps():
    evs = [
        TraceEvent(0.0, "add", "a"),
        TraceEvent(0.0, "add", "b"),
        TraceEvent(5.0, "remove", "a"),
        TraceEvent(7.0, "add", "c"),
    ]
    assert alive_counts(evs) == [(0.0, 2), (5.0, 1), (7.0, 2)]
    assert alive_at(evs, -1.0) == 0 and alive_at(evs, 6.0) == 1 and alive_at(evs, 100.0) == 2


# -- placement ---------------------------------------------------------------------


def check_invariants(actions: list[ReplayAction], num_agents: int, gpus_per_agent: int) -> None:
    """Replay the actions against slot state; assert every documented invariant."""
    slots: dict[tuple[int, int], str] = {}
    per_agent = Counter()
    last_t = 0.0
    for a in actions:
        assert a.t_s >= last_t
        last_t = a.t_s
        assert 0 <= a.agent < num_agents and a.gpu is not None and 0 <= a.gpu < gpus_per_agent
        key = (a.agent, a.gpu)
        if a.kind in ("start_node", "add_gpu"):
            assert key not in slots, f"{a} lands on an occupied slot"
            assert (a.kind == "start_node") == (per_agent[a.agent] == 0), a
            slots[key] = a.trace_node
            per_agent[a.agent] += 1
            assert per_agent[a.agent] <= gpus_per_agent
        else:
            assert slots.get(key) == a.trace_node, f"{a} targets a slot it does not occupy"
            del slots[key]
            per_agent[a.agent] -= 1
            assert (a.kind == "preempt_node") == (per_agent[a.agent] == 0), a
    assert len(set(slots.values())) == len(slots)


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("agents, gpus", [(2, 2), (4, 2), (3, 4), (1, 1), (40, 1)])
def test_placement_invariants_full_trace(p3, scale, agents, gpus):
    for seed in range(3):
        pl = TracePlacement(agents, gpus, seed, scale_to_capacity=scale)
        acts = pl.plan(p3)
        check_invariants(acts, agents, gpus)
        st = pl.stats
        assert st["max_alive"] == 32 and st["max_local_alive"] <= agents * gpus
        assert st["placed"] + st["unplaced"] == 177
        assert sum(st["kinds"].values()) == len(acts)


def test_capped_mode_follows_trace_when_capacity_suffices(p3):
    pl = TracePlacement(8, 4, seed=1)  # 32 slots = trace peak -> every node placed
    acts = pl.plan(p3)
    assert pl.stats["unplaced"] == 0 and pl.stats["placed"] == 177 and len(acts) == 344
    assert [(a.t_s, a.trace_node) for a in acts] == [(e.t_s, e.node) for e in p3]
    live = {t: n for t, n, _ in fragmentation_timeline(acts, 2)}
    assert live == dict(alive_counts(p3))


def test_capped_mode_counts_unplaced(p3):
    pl = TracePlacement(2, 2, seed=0)
    acts = pl.plan(p3)
    st = pl.stats
    assert st["mode"] == "capped" and st["unplaced"] > 0 and st["scaled_down"] == 0
    placed_nodes = {a.trace_node for a in acts}
    assert len(placed_nodes) == st["placed"]
    # a local GPU's lifetime is its trace node's lifetime
    added = {e.node: e.t_s for e in p3 if e.action == "add"}
    removed = {e.node: e.t_s for e in p3 if e.action == "remove"}
    for a in acts:
        assert a.t_s == (added if a.kind in ("start_node", "add_gpu") else removed)[a.trace_node]


def test_proportional_mode_tracks_scaled_alive_count(p3):
    pl = TracePlacement(2, 2, seed=0, scale_to_capacity=True)
    acts = pl.plan(p3)
    live = {t: n for t, n, _ in fragmentation_timeline(acts, 2)}
    for t, c in alive_counts(p3):
        assert live.get(t, None) in (None, int(c * 4 / 32 + 0.5))
    assert pl.stats["mode"] == "proportional" and pl.stats["max_local_alive"] == 4


def test_placement_deterministic_per_seed(p3):
    a = TracePlacement(4, 2, seed=7).plan(p3)
    b = TracePlacement(4, 2, seed=7).plan(p3)
    assert a == b
    pl = TracePlacement(4, 2, seed=7)
    assert pl.plan(p3) == pl.plan(p3)  # re-planning restarts the RNG
    others = [TracePlacement(4, 2, seed=s).plan(p3) for s in range(1, 4)]
    assert any([(x.agent, x.gpu) for x in o] != [(x.agent, x.gpu) for x in a] for o in others)


def test_time_scale_divides_times(p3):
    s = slice_trace(p3, 7200.0, 1800.0)
    base = TracePlacement(2, 2, seed=0).plan(s)
    fast = TracePlacement(2, 2, seed=0).plan(s, time_scale=10.0)
    assert [(a.kind, a.agent, a.gpu, a.trace_node) for a in base] == [
        (a.kind, a.agent, a.gpu, a.trace_node) for a in fast
    ]
    assert [a.t_s / 10.0 for a in base] == pytest.approx([a.t_s for a in fast])
    assert max(a.t_s for a in fast) < 180.0
    with pytest.raises(ValueError):
        TracePlacement(2, 2, seed=0).plan(s, time_scale=0.0)


def test_plan_rejects_inconsistent_events():
    pl = TracePlacement(1, 2, seed=0)
    with pytest.raises(ValueError, match="not alive"):
        pl.plan([TraceEvent(0.0, "remove", "x")])
    with pytest.raises(ValueError, match="already alive"):
        pl.plan([TraceEvent(0.0, "add", "x"), TraceEvent(1.0, "add", "x")])
    with pytest.raises(RuntimeError):
        _ = TracePlacement(1, 1, seed=0).stats


def test_start_and_preempt_semantics_small():
    evs = [
        TraceEvent(0.0, "add", "a"),
        TraceEvent(1.0, "add", "b"),
        TraceEvent(2.0, "remove", "a"),
        TraceEvent(3.0, "remove", "b"),
        TraceEvent(4.0, "add", "c"),
    ]
    acts = TracePlacement(1, 2, seed=0).plan(evs)
    assert [a.kind for a in acts] == ["start_node", "add_gpu", "revoke_gpu", "preempt_node", "start_node"]
    assert [a.gpu for a in acts] == [0, 1, 0, 1, 0]


# -- fragmentation -----------------------------------------------------------------


def test_fragmentation_metric():
    acts = [
        ReplayAction(0.0, "start_node", 0, 0, "a"),
        ReplayAction(0.0, "add_gpu", 0, 1, "b"),
        ReplayAction(0.0, "start_node", 1, 0, "c"),
        ReplayAction(0.0, "add_gpu", 1, 1, "d"),
        ReplayAction(10.0, "revoke_gpu", 1, 1, "d"),  # agent 1 left with one GPU -> fragmented
        ReplayAction(20.0, "preempt_node", 1, 0, "c"),
    ]
    assert fragmentation_timeline(acts, 2) == [(0.0, 4, 0), (10.0, 3, 1), (20.0, 2, 0)]
    # [0,10): 0/4, [10,20): 1/3, [20,30): 0/2
    assert fragmentation(acts, 2, end_s=30.0) == pytest.approx((10 * (1 / 3)) / 30)
    s = fragmentation_summary(acts, 2, end_s=30.0)
    assert s["gpu_time_share"] == pytest.approx(10 / (40 + 30 + 20))
    assert s["time_any_fragmented"] == pytest.approx(10 / 30)
    assert fragmentation(acts, 1, end_s=30.0) == 0.0
    assert fragmentation([], 2) == 0.0
    with pytest.raises(ValueError):
        fragmentation_timeline([ReplayAction(0.0, "revoke_gpu", 0, 0, "z")], 2)


def test_fragmentation_in_stats(p3):
    pl = TracePlacement(4, 2, seed=0)  # the paper's Fig. 4 setting: 4 nodes x 2 GPUs, SP=2
    acts = pl.plan(p3)
    assert pl.stats["fragmentation"] == pytest.approx(fragmentation(acts, 2, end_s=p3[-1].t_s))
    assert 0.0 < pl.stats["fragmentation"] < 1.0
    assert count_kinds(acts) == pl.stats["kinds"]


# -- replay ------------------------------------------------------------------------


def test_replayer_returns_each_action_once_in_order(p3):
    acts = TracePlacement(2, 2, seed=0).plan(p3, time_scale=10.0)
    assert len(acts) > 20
    rp = TraceReplayer(acts, start_s=1000.0)
    assert rp.due(999.0) == []
    got: list[ReplayAction] = []
    now = 1000.0
    while not rp.done:
        batch = rp.due(now)
        assert all(a.t_s <= now - 1000.0 for a in batch)
        got.extend(batch)
        assert rp.next_due_s is None or rp.next_due_s > now  # nothing due is held back
        assert rp.remaining == len(acts) - len(got)
        now += 7.3
    assert got == acts and rp.remaining == 0 and rp.next_due_s is None
    assert rp.due(1e9) == []


def test_replayer_boundary_and_sorting():
    a0 = ReplayAction(5.0, "start_node", 0, 0, "x")
    a1 = ReplayAction(5.0, "add_gpu", 0, 1, "y")
    a2 = ReplayAction(2.0, "start_node", 1, 0, "z")
    rp = TraceReplayer([a0, a1, a2])
    assert rp.due(1.999) == []
    assert rp.due(2.0) == [a2]  # t_s <= now - start is due
    assert rp.due(4.0) == []
    assert rp.due(5.0) == [a0, a1]  # ties keep input order
    assert rp.done


# -- published formats other than Bamboo's add/remove CSV ----------------
# Each file below is written here from the format's documentation, not copied from a trace.

from spotlight.traces.formats import TRACE_FORMATS, detect_trace_format, events_from_counts, load_trace  # noqa: E402


def _alive_steps(events):
    return [(t, n) for t, n in alive_counts(events)]


def test_events_from_counts_lifo_and_seeded():
    evs = events_from_counts([(100.0, 2), (160.0, 3), (220.0, 1), (280.0, 1)])
    assert evs[:3] == [
        TraceEvent(0.0, "add", "node0"),
        TraceEvent(0.0, "add", "node1"),
        TraceEvent(60.0, "add", "node2"),
    ]
    # removals hit the most recently added nodes first
    assert evs[3:] == [TraceEvent(120.0, "remove", "node2"), TraceEvent(120.0, "remove", "node1")]
    seeded = events_from_counts([(0.0, 5), (60.0, 2)], seed=3)
    assert [e.action for e in seeded] == ["add"] * 5 + ["remove"] * 3
    assert seeded == events_from_counts([(0.0, 5), (60.0, 2)], seed=3)
    with pytest.raises(ValueError, match="negative"):
        events_from_counts([(0.0, -1)])


def test_bamboo_gcp_count_log(tmp_path):
    # Bamboo traces/gcloud/*.txt: "YYYY-MM-DD, HH:MM:SS, <instances>" per line
    f = tmp_path / "a100x1-east1b.txt"
    f.write_text("2021-12-11, 11:11:30, 4\n2021-12-11, 11:13:10, 4\n2021-12-11, 11:15:50, 2\n2021-12-11, 11:20:50, 5\n")
    assert detect_trace_format(f) == "count-log"
    evs = load_trace(f)
    assert _alive_steps(evs) == [(0.0, 4), (260.0, 2), (560.0, 5)]
    assert sum(e.action == "remove" for e in evs) == 2 and sum(e.action == "add" for e in evs) == 7


def test_bamboo_aws_count_log_with_zones_and_header(tmp_path):
    # older AWS logs: timestamp, zone and instance count; counts are per zone
    f = tmp_path / "aws.log"
    f.write_text(
        "\ufefftime zone instances\n"
        "2021-06-01 12:00:00 us-east-1a 3\n"
        "2021-06-01 12:00:00 us-east-1b 2\n"
        "2021-06-01T12:01:00Z us-east-1a 1\n"
        "# a comment\n"
        "2021-06-01 12:02:00, us-east-1b, 4\n"
    )
    assert detect_trace_format(f) == "count-log"
    assert _alive_steps(load_trace(f)) == [(0.0, 5), (60.0, 3), (120.0, 5)]


def test_count_log_bad_line_named_and_short(tmp_path):
    f = tmp_path / "g.txt"
    f.write_text("2021-12-11, 11:11:30, 4\n2021-12-11, 11:13:10, many" + "x" * 5000 + "\n")
    with pytest.raises(ValueError) as exc:
        load_trace(f)
    msg = str(exc.value)
    assert "g.txt:2:" in msg and "\n" not in msg and len(msg) < 300 and msg.count(str(f)) == 1


@pytest.mark.parametrize("meta", ['"metadata": {"gap_seconds": 300}', '"gap_seconds": 300'])
def test_skypilot_availability_and_preemption_json(tmp_path, meta):
    # skypilot-org/spot-traces: {"metadata": {"gap_seconds": G}, "data": [live instances per tick]}
    f = tmp_path / "us-east-1f_v100_1.json"
    f.write_text("{" + meta + ', "data": [0, 4, 4, 1, 1.0, 4, 0]}')
    assert detect_trace_format(f) == "skypilot"
    evs = load_trace(f)
    assert _alive_steps(evs) == [(300.0, 4), (900.0, 1), (1500.0, 4), (1800.0, 0)]
    single = tmp_path / "us-west-2a_v100_1.json"  # a 1-node availability trace: 0/1 per tick
    single.write_text('{"metadata": {"gap_seconds": 600}, "data": [1, 0, 0, 1]}')
    assert _alive_steps(load_trace(single)) == [(0.0, 1), (600.0, 0), (1800.0, 1)]


@pytest.mark.parametrize(
    "body, why",
    [
        ('{"metadata": {}, "data": [1]}', "gap_seconds"),
        ('{"metadata": {"gap_seconds": 60}, "data": []}', "'data'"),
        ('{"metadata": {"gap_seconds": 60}, "data": [1, -2]}', "data[1]"),
        ('{"metadata": {"gap_seconds": 60}, "data": [1, "' + "y" * 20000 + '"]}', "data[1]"),
        ('{"metadata": {"gap_seconds": 60}, "data": [1, 2', "not valid JSON"),
    ],
)
def test_skypilot_errors_are_one_short_line(tmp_path, body, why):
    f = tmp_path / "t.json"
    f.write_text(body)
    with pytest.raises(ValueError) as exc:
        load_trace(f)
    msg = str(exc.value)
    assert why in msg and "\n" not in msg and len(msg) < 300 and msg.count(str(f)) == 1


def test_unknown_format_one_line_naming_accepted_formats(tmp_path):
    # a Python list of 20 KB on one line: the error quotes a short excerpt, never the whole
    f = tmp_path / "trace.txt"
    f.write_text(repr(list(range(4000))) + "\n")
    with pytest.raises(ValueError) as exc:
        load_trace(f)
    msg = str(exc.value)
    assert "unknown trace format" in msg and "\n" not in msg and len(msg) < 500
    for desc in TRACE_FORMATS.values():
        assert desc in msg
    # a Bamboo-looking row with the wrong field count is quoted short too
    g = tmp_path / "wide.csv"
    g.write_text("0,add,node1\n" + ",".join(["7"] * 5000) + "\n")
    with pytest.raises(ValueError) as exc2:
        load_trace(g)
    assert "wide.csv:2:" in str(exc2.value) and len(str(exc2.value)) < 300


def test_bamboo_detected_by_content_with_bom(tmp_path):
    f = tmp_path / "trace.json"  # the suffix does not decide
    f.write_bytes("\ufeff0,add,node1\r\n60000,remove,node1\r\n".encode())
    assert detect_trace_format(f) == "bamboo"
    assert load_trace(f) == [TraceEvent(0.0, "add", "node1"), TraceEvent(60.0, "remove", "node1")]


def test_default_time_scale_stretches_slice_over_expected_run():
    from spotlight.traces.formats import EXPECTED_ITERATION_S, default_time_scale

    # a 1800 s slice over 20 iterations at ~30 s: 3 trace seconds per wall second
    assert default_time_scale(1800.0, 20, iteration_s=30.0) == pytest.approx(3.0)
    assert default_time_scale(600.0, 2) == pytest.approx(600.0 / (2 * EXPECTED_ITERATION_S))
    with pytest.raises(ValueError):
        default_time_scale(0.0, 20)


# -- full replay (the paper's way) -----------------------------


@pytest.mark.parametrize("agents, gpus", [(8, 4), (16, 2), (32, 1), (40, 1)])
def test_full_mode_replays_the_whole_trace_unscaled(p3, agents, gpus):
    """Every trace event becomes one local action at its own time; the local alive count
    equals the trace's at every instant (nothing scaled, dropped or back-filled)."""
    pl = TracePlacement(agents, gpus, seed=3, full=True)
    acts = pl.plan(p3)
    check_invariants(acts, agents, gpus)
    assert len(acts) == len(p3) and [a.t_s for a in acts] == [e.t_s for e in p3]
    live = {t: n for t, n, _ in fragmentation_timeline(acts, 2)}
    assert live == dict(alive_counts(p3))
    st = pl.stats
    assert st["mode"] == "full" and st["unplaced"] == 0 and st["scaled_down"] == 0 and st["max_local_alive"] == 32


def test_full_mode_removals_hit_a_random_node_not_the_arrivals_own():
    """Two one-GPU agents: n0 arrives, then n1 (on the other agent), then n0 leaves. Capped
    placement always revokes n0's own agent; the full replay picks the agent at random."""
    events = [TraceEvent(0.0, "add", "n0"), TraceEvent(1.0, "add", "n1"), TraceEvent(2.0, "remove", "n0")]
    hit_other = {False: 0, True: 0}
    for seed in range(30):
        for full in (False, True):
            acts = TracePlacement(2, 1, seed, full=full).plan(events)
            first = acts[0].agent
            assert acts[-1].kind == "preempt_node"
            hit_other[full] += acts[-1].agent != first
    assert hit_other[False] == 0
    assert 5 <= hit_other[True] <= 25


def test_full_mode_says_how_many_agents_the_peak_needs(p3):
    with pytest.raises(ValueError, match=r"peaks at 32 alive GPUs .* at least 11 agents of 3 GPUs"):
        TracePlacement(4, 3, seed=0, full=True).plan(p3)
    with pytest.raises(ValueError, match="excludes scale_to_capacity"):
        TracePlacement(4, 3, seed=0, full=True, scale_to_capacity=True)


def test_full_mode_deterministic_per_seed_and_relabels_a_name_still_in_use():
    events = [
        TraceEvent(0.0, "add", "a"),
        TraceEvent(0.0, "add", "b"),
        TraceEvent(1.0, "remove", "a"),
        TraceEvent(2.0, "add", "a"),
        TraceEvent(3.0, "remove", "b"),
        TraceEvent(4.0, "remove", "a"),
    ]
    runs = [TracePlacement(2, 2, 7, full=True).plan(events) for _ in range(2)]
    assert runs[0] == runs[1]
    for seed in range(20):
        acts = TracePlacement(2, 2, seed, full=True).plan(events)
        check_invariants(acts, 2, 2)
        assert [a.kind in ("start_node", "add_gpu") for a in acts] == [True, True, False, True, False, False]


def test_unknown_format_quotes_the_first_line(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello world\nfoo bar baz\n")
    with pytest.raises(ValueError, match="first line 'hello world'"):
        load_trace(p)


def test_a_full_replay_too_big_for_one_agent_says_so_in_proper_plurals():
    """Was: `1 agents x 1 GPUs hold 1`."""
    import pathlib

    import pytest

    from spotlight.traces.replay_plan import plan_local_replay

    trace = pathlib.Path(__file__).resolve().parents[3] / "examples" / "traces" / "bamboo" / "p3-trace.csv"
    with pytest.raises(ValueError) as info:
        plan_local_replay(
            iterations=1,
            agents=1,
            gpus_per_agent=1,
            trace=trace,
            trace_mode="full",
            time_scale=None,
            trace_start_s=0,
            trace_duration_s=100,
            seed=0,
            preemption_cycles=None,
            cycle_down_s=5,
            cycle_iteration_s=30,
        )
    msg = str(info.value)
    assert "but 1 agent x 1 GPU hold 1: a full replay needs at least 32 agents of 1 GPU " in msg, msg
