"""Fault injection against real `spotlight up` runs (docs/architecture.md §9, paper §4.5).

Three scenarios, each one real process tree over loopback ZeroMQ:

(a) an AWS spot-interruption notice through spot-0's mock metadata server while it
    denoises: its worker commits in-flight state, another worker resumes it, and every
    resumed rollout is bit-identical to an uninterrupted run of the same seed/prompt;
(b) ``kill -9`` of one rollout worker, later of a whole spot agent: the leases are
    re-executed from scratch and the run still finishes with every request done once;
(bad frames and attacks on the control plane live in ``test_control_plane_security.py``.)

Runs are tiny (2 iterations × 6 prompts × 8 seeds, 8 exploration candidates) so the file
fits in a few minutes on 2 CPU cores. Nothing here assumes a timing: every wait is on a
condition with a generous deadline, training is held (Train Worker frozen) until every spot
worker serves, and every fault is injected while the target's processes are frozen (SIGSTOP)
at a point their worker events show to be mid-denoising (``$SPOTLIGHT_WORKER_EVENTS``), so it
cannot miss the work it is meant to interrupt.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.factories import make_lease_item
from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.runs import (
    Up,
    freeze_mid_denoising,
    gone,
    hold_training,
    read_jsonl,
    thaw,
    toy_config,
    up_env,
)

REPO = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers


def _local_agents(up: Up) -> dict:
    path = up.rd / "local_agents.json"
    return json.loads(up.wait_for(lambda: path.is_file() and path.read_text(), "local_agents.json"))


def _agent_status(state_dir: str, node_id: str) -> dict | None:
    """`spotlight-agent agent-status --node-id X` (None while the agent does not answer)."""
    if not (pathlib.Path(state_dir) / node_id / "control.sock").exists():
        return None
    proc = subprocess.run(
        [sys.executable, "-m", "agent.main", "agent-status", "--node-id", node_id],
        cwd=REPO,
        env=up_env(SPOTLIGHT_AGENT_STATE=state_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return None


def _spot_workers_serve(agents: dict) -> bool:
    """Every worker of every spot agent (``local_agents.json``) said hello."""
    for node_id, a in agents["agents"].items():
        st = _agent_status(agents["state_dir"], node_id) if a["spot"] else None
        if a["spot"] and (not st or not st["workers"] or set(st["workers"].values()) != {"ready"}):
            return False
    return True


def _statuses(r: dict) -> list[str]:
    return [h[0] for h in r["history"]]


def _assert_every_request_done_once(reqs: list[dict], num_rollouts: int, *, explored: bool = True) -> None:
    kinds = collections.Counter(r["kind"] for r in reqs)
    assert kinds["rollout"] == num_rollouts, kinds
    assert (kinds["explore"] > 0) == explored, kinds
    assert_each_request_ended_once(reqs)


# ---------------------------------------------------------------- (a) preemption notice


def _notice_attempt(tmp: pathlib.Path, cfg: pathlib.Path, name: str, num_steps: int) -> pathlib.Path:
    """One run with an AWS notice to spot-0 that is certain to find a rollout mid-denoising.

    No timing is assumed: spot-0's processes are frozen (SIGSTOP) at a moment when a worker's
    last event is a denoising step with at least 3 steps left (so it is inside the loop, and
    checks for STOP before each of those steps); the notice is sent and the agent's drain
    begins while they are frozen; then they continue, see the STOP and commit."""
    rd = tmp / name
    events = tmp / f"{name}.events.jsonl"
    up = Up(
        rd,
        [
            "--local",
            "--agents",
            "2",
            "--gpus-per-agent",
            "2",
            "--mock-cloud",
            "aws",
            "--spot-nice",
            "0",
            "--config",
            str(cfg),
            "--log-level",
            "INFO",
        ],
        env=up_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    frozen: list[psutil.Process] = []
    try:
        agents = _local_agents(up)
        spot0 = agents["agents"]["spot-0"]
        frozen = hold_training(rd, up.proc.pid, up.alive)  # until the spot workers serve
        up.wait_for(lambda: _spot_workers_serve(agents), "the spot agents' workers to serve", interval_s=0.5)
        thaw(frozen)

        frozen, _ = up.wait_for(
            lambda: freeze_mid_denoising(spot0["pid"], events, num_steps - 3),
            "a worker of spot-0 mid-denoising",
            interval_s=0.0,
        )
        from spotlight.cloud.mock_metadata import control

        control(spot0["control_url"], "notice", lead_time_s=20)
        up.wait_for(
            lambda: (_agent_status(agents["state_dir"], "spot-0") or {}).get("draining"),
            "spot-0 to begin draining",
            interval_s=0.1,
        )
        thaw(frozen)
        frozen = []
        up.wait_for(lambda: gone(spot0["pid"]), "spot-0 to drain and exit")
        rc = up.finish()
        assert rc == 0, f"spotlight up failed (rc {rc})\n{up.logs()}"
    finally:
        thaw(frozen)
        up.close()
    return rd


@pytest.fixture(scope="module")
def notice_run(tmp_path_factory):
    """Run (a): AWS notice to spot-0 while one of its workers denoises (see _notice_attempt)."""
    tmp = tmp_path_factory.mktemp("notice")
    # exploration off: every request the notice interrupts is an on-policy rollout, whose
    # resumed result is then compared bit for bit (exploration uses the same commit path)
    cfg = toy_config(
        tmp / "config.toml",
        **{
            "cluster.worker_batch_size": 1,
            "run.save_rollouts": True,
            "explore.enabled": False,
            "run.iterations": 3,
            "run.keep_weight_versions": 0,  # every rollout is checked against its version
        },
    )
    from spotlight.config import load_config

    rd = _notice_attempt(tmp, cfg, "run", load_config(cfg).sampler.num_steps)
    return rd, cfg


def test_notice_run_completes_with_recompute(notice_run):
    rd, cfg = notice_run
    from spotlight.config import load_config

    c = load_config(cfg)
    reqs = read_jsonl(rd / "requests.jsonl")
    _assert_every_request_done_once(
        reqs, c.run.iterations * c.data.prompts_per_iteration * c.data.group_size, explored=False
    )
    resumed = [r for r in reqs if "recompute" in _statuses(r)]
    assert resumed, "the notice committed no in-flight request (no 'recompute' in any history)"
    for r in resumed:
        st = _statuses(r)
        # committed, then leased again (resumed) and finished exactly once
        i = st.index("recompute")
        assert st[i + 1] == "in_flight" and "resume from step" in r["history"][i + 1][2], r
        assert st.count("done") == 1 and st[-1] == "done", r
    metrics = read_jsonl(rd / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == list(range(c.run.iterations))


def test_resumed_rollouts_are_bit_identical(notice_run):
    """Every resumed rollout equals an uninterrupted batch-1 run of its seed/prompt on its
    weights version (window latents, log-probs and image, bit for bit)."""
    import torch
    from safetensors.torch import load_file

    from spotlight import protocol as P
    from spotlight.cli.up import _cache_dir, load_prompts
    from spotlight.config import load_config
    from spotlight.models.lora import lora_spec
    from spotlight.models.text_encoder import cached_prompt_embeddings
    from spotlight.store.tensor_wire import unpack_tensors
    from spotlight.workers.rollout.worker import RolloutExecutor

    rd, cfg = notice_run
    c = load_config(cfg)
    reqs = read_jsonl(rd / "requests.jsonl")
    resumed = [r for r in reqs if "recompute" in _statuses(r)]
    rollouts = [r for r in resumed if r["kind"] == "rollout"]
    assert rollouts, "no rollout was committed and resumed"
    torch.set_num_threads(max(1, c.cluster.torch_threads))
    embeds, mask = cached_prompt_embeddings(
        load_prompts(c.data), _cache_dir(), c.model.max_text_tokens, c.model.text_encoder
    )
    embeds = embeds.float()
    ex = RolloutExecutor(c.model, c.sampler, lora=lora_spec(c.train))  # as the run's workers
    saved: dict[int, dict] = {}
    for r in rollouts:
        n = r["iteration"]
        if n not in saved:
            saved[n] = load_file(rd / "rollouts" / f"iter_{n:04d}.safetensors")
            ex.add_version(n, load_file(rd / "tensor_store" / "weights" / f"v{n}.safetensors"))
        got = {k[len(r["request_id"]) + 1 :]: v for k, v in saved[n].items() if k.startswith(r["request_id"] + ".")}
        assert {"image", "window_latents", "log_probs", "seed", "prompt_index"} <= set(got), sorted(got)
        seed, pidx = int(got["seed"][0]), int(got["prompt_index"][0])
        item = make_lease_item(r["request_id"], iteration=n, prompt_index=pidx, seed=seed, weight_version=n)
        outcome = ex.run(
            "test", P.Leases(worker_id="test", items=[item]), {"cond.embeds": embeds[[pidx]], "cond.mask": mask[[pidx]]}
        )
        msg, frames = outcome.result
        ref = unpack_tensors(msg.tensors, frames)
        for key in ("window_latents", "log_probs"):
            assert torch.equal(got[key], ref[key][0]), (
                f"{r['request_id']}: resumed {key} differs from an uninterrupted run"
            )
        assert torch.equal(got["image"], ref["images"][0]), (
            f"{r['request_id']}: resumed image differs from an uninterrupted run"
        )


# ---------------------------------------------------------------- (b) kill -9


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory):
    """Run (b): SIGKILL a rollout worker of spot-0 while it denoises a leased request, then
    the whole spot-1 agent, once iteration 0 finished, while one of its workers denoises.

    No timing is assumed: each kill happens while the agent's processes are frozen
    (SIGSTOP) at a moment when a worker's last event is a denoising step before the last."""
    tmp = tmp_path_factory.mktemp("kill")
    # 3 iterations: on a loaded machine spot-0's worker can start after a 2-iteration run's
    # work is all taken (the run then ended before anything was in flight on spot-0)
    cfg = toy_config(tmp / "config.toml", **{"run.iterations": 3})
    from spotlight.config import load_config

    last_step = load_config(cfg).sampler.num_steps - 1
    rd = tmp / "run"
    events = tmp / "events.jsonl"
    up = Up(
        rd,
        ["--local", "--agents", "2", "--config", str(cfg), "--log-level", "INFO"],
        env=up_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    killed = {}
    orphans: list[psutil.Process] = []
    frozen: list[psutil.Process] = []
    try:
        agents = _local_agents(up)
        spot0, spot1 = agents["agents"]["spot-0"], agents["agents"]["spot-1"]
        frozen = hold_training(rd, up.proc.pid, up.alive)  # until the spot workers serve
        up.wait_for(lambda: _spot_workers_serve(agents), "the spot agents' workers to serve", interval_s=0.5)
        thaw(frozen)
        # a rollout or an exploration request, whichever it is: the kill is what matters
        frozen, mid = up.wait_for(
            lambda: freeze_mid_denoising(spot0["pid"], events, last_step),
            "a worker of spot-0 mid-denoising",
            interval_s=0.0,
        )
        mid[0].send_signal(signal.SIGKILL)
        killed["worker"] = mid[0].pid
        thaw(frozen)
        metrics = rd / "metrics.jsonl"
        up.wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), "iteration 0 to finish", interval_s=0.2)
        # iteration 1 (or later) runs: kill spot-1 while one of its workers denoises (its
        # leases are re-enqueued when its heartbeats stop)
        frozen, _ = up.wait_for(
            lambda: freeze_mid_denoising(spot1["pid"], events, last_step),
            "a worker of spot-1 mid-denoising",
            interval_s=0.0,
        )
        orphans.extend(frozen)  # its workers (and warm spare)
        killed["agent_workers"] = [p.pid for p in orphans]
        os.kill(spot1["pid"], signal.SIGKILL)
        killed["agent"] = spot1["pid"]
        thaw(frozen)  # the orphans run on, find their agent gone and exit
        frozen = []
        rc = up.finish()
        assert rc == 0, f"spotlight up failed (rc {rc})\n{up.logs()}"
        # the orphaned workers of the killed agent notice and exit (no leaked processes)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(gone(pid) for pid in killed["agent_workers"]):
            time.sleep(0.2)
        killed["orphans_left"] = [p.pid for p in orphans if not gone(p.pid)]
    finally:
        thaw(frozen)
        up.close()
        for p in orphans:  # no longer children of the run: never leak them on a failure
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    return rd, cfg, killed


def test_kill9_run_completes_and_reexecutes(kill_run):
    rd, cfg, killed = kill_run
    from spotlight.config import load_config

    c = load_config(cfg)
    assert gone(killed["worker"]) and gone(killed["agent"])
    assert killed["agent_workers"], "spot-1 had no rollout worker when it was killed"
    assert not killed["orphans_left"], f"rollout workers of the killed agent outlived it: {killed['orphans_left']}"
    reqs = read_jsonl(rd / "requests.jsonl")
    _assert_every_request_done_once(reqs, c.run.iterations * c.data.prompts_per_iteration * c.data.group_size)
    aborted = [r for r in reqs if "aborted" in _statuses(r)]
    assert aborted, "no request was re-executed from scratch after the kills"
    for r in aborted:
        st = _statuses(r)
        i = st.index("aborted")
        # re-enqueued and re-executed from scratch (no committed state to resume from)
        assert st[i + 1 : i + 3] == ["pending", "in_flight"] and "resume" not in r["history"][i + 2][2], r
    metrics = read_jsonl(rd / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == list(range(c.run.iterations))
