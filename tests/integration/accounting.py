"""The exactly-once check every end-to-end test makes on ``requests.jsonl``."""

from __future__ import annotations


def assert_each_request_ended_once(reqs: list[dict]) -> None:
    """Every request ended exactly once: DONE, or -- only an exploration candidate streamed
    while training ran -- CANCELLED when the update ended; its history has
    exactly one terminal entry, the last one, equal to its final status. Rollouts are DONE."""
    assert reqs
    for r in reqs:
        ends = [h for h in r["history"] if h[0] in ("done", "cancelled")]
        assert len(ends) == 1 and r["history"][-1] == ends[0], r
        assert ends[0][0] == r["status"], r
        if r["status"] == "cancelled":
            assert r["kind"] == "explore" and "training ended" in ends[0][2], r
        else:
            assert r["status"] == "done", r
