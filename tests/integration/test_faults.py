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
from typing import Callable

import psutil
import pytest

from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.waiting import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 900
WAIT_S = 1000  # deadline for any condition on a run (> RUN_TIMEOUT_S: the run fails first)

FAST = {
    "run.iterations": 2,
    "data.prompts_per_iteration": 6,
    "data.num_control_prompts": 2,
    "explore.planner": "fixed",
    "explore.num_candidates": 8,
    "run.sample_grid_every": 0,
    "cluster.heartbeat_timeout_s": 4.0,
    "cluster.heartbeat_interval_s": 0.5,
}


# ---------------------------------------------------------------- helpers


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _write_config(path: pathlib.Path, **overrides) -> pathlib.Path:
    from spotlight.config import EXAMPLES_DIR, dump_config, load_config

    dump_config(load_config(EXAMPLES_DIR / "jpeg-toy" / "config.toml", {**FAST, **overrides}), path)
    return path


class Up:
    """A `spotlight up` subprocess whose stdout/stderr go to files in its run dir."""

    def __init__(self, rd: pathlib.Path, args: list[str], env: dict[str, str] | None = None):
        self.rd = rd
        rd.mkdir(parents=True, exist_ok=True)
        self.out = open(rd.parent / f"{rd.name}.stdout", "w")
        self.err_path = rd.parent / f"{rd.name}.stderr"
        self.err = open(self.err_path, "w")
        cmd = [
            sys.executable,
            "-m",
            "spotlight.cli",
            "up",
            "--run-dir",
            str(rd),
            "--timeout-s",
            str(RUN_TIMEOUT_S),
            *args,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=self.out, stderr=self.err)
        self.ps = psutil.Process(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        self.out.flush()
        self.err.flush()
        return f"STDOUT\n{(self.rd.parent / f'{self.rd.name}.stdout').read_text()[-3000:]}\nSTDERR\n{self.err_path.read_text()[-6000:]}"

    def wait_for(self, cond, what: str, timeout_s: float = WAIT_S, interval_s: float = 0.1):
        """Poll ``cond()`` until it returns something truthy; fail if the run exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            if not self.alive():
                got = cond()
                if got:
                    return got
                pytest.fail(f"spotlight up exited (rc {self.proc.returncode}) while waiting for {what}\n{self.logs()}")
            time.sleep(interval_s)
        pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.logs()}")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            pytest.fail(f"spotlight up did not exit within {WAIT_S}s\n{self.logs()}")

    def kill_tree(self) -> None:
        """Last-resort cleanup (test failure): SIGKILL the run and every descendant."""
        try:
            procs = [self.ps, *self.ps.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.poll()

    def close(self) -> None:
        if self.alive():
            self.kill_tree()
        self.out.close()
        self.err.close()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
        env=_env(SPOTLIGHT_AGENT_STATE=state_dir),
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


def _requests(rd: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (rd / "requests.jsonl").read_text().splitlines()]


def _statuses(r: dict) -> list[str]:
    return [h[0] for h in r["history"]]


def _assert_every_request_done_once(reqs: list[dict], num_rollouts: int, *, explored: bool = True) -> None:
    kinds = collections.Counter(r["kind"] for r in reqs)
    assert kinds["rollout"] == num_rollouts, kinds
    assert (kinds["explore"] > 0) == explored, kinds
    assert_each_request_ended_once(reqs)


# ---------------------------------------------------------------- (a) preemption notice


def _last_events(path: pathlib.Path) -> dict[int, dict]:
    """The last worker event (``$SPOTLIGHT_WORKER_EVENTS``) of each process id."""
    last: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:  # a line being written
                continue
            last[ev["pid"]] = ev
    return last


def _freeze(procs: list[psutil.Process]) -> list[psutil.Process]:
    """SIGSTOP ``procs`` and wait until the kernel has stopped each one (the processes that
    are gone by then are dropped)."""
    stopped = []
    for p in procs:
        try:
            p.send_signal(signal.SIGSTOP)
            stopped.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in list(stopped):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    break
            except psutil.NoSuchProcess:
                stopped.remove(p)
                break
            time.sleep(0.001)
    return stopped


def _thaw(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass


def _freeze_mid_denoising(
    parent_pid: int, events: pathlib.Path, max_step: int
) -> tuple[list[psutil.Process], list[psutil.Process]] | None:
    """Freeze every descendant of ``parent_pid``. If the last event of some of them is a
    denoising step ``<= max_step`` (each is then inside the denoising loop of a leased
    request), keep them all frozen and return (all frozen, those mid-denoising); else thaw
    them and return None."""
    try:
        kids = psutil.Process(parent_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    got = _freeze(kids)
    last = _last_events(events)
    mid = [p for p in got if last.get(p.pid, {}).get("event") == "step" and last[p.pid]["step"] <= max_step]
    if mid:
        return got, mid
    _thaw(got)
    time.sleep(0.005)
    return None


def _trainers(up_pid: int) -> list[psutil.Process]:
    """The run's Train Worker processes."""
    out = []
    for p in psutil.Process(up_pid).children(recursive=True):
        try:
            if "spotlight.workers.train.train_worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _hold_training(rd: pathlib.Path, up_pid: int, alive: Callable[[], bool]) -> list[psutil.Process]:
    """Freeze the run's Train Workers as soon as they published weights v0: the run cannot get
    past iteration 0's training before the caller thaws them (e.g. once spot workers, which on
    a loaded machine can take longer to start than a whole test run, serve)."""
    v0 = rd / "tensor_store" / "weights" / "v0.safetensors"
    wait_until(v0.is_file, "weights v0", timeout_s=WAIT_S, alive=alive)
    trainers = _freeze(_trainers(up_pid))
    assert trainers, "the run has no Train Worker"
    return trainers


def _freeze_mid_denoising_holding_training(
    up_pid: int, parent_pid: int, events: pathlib.Path, max_step: int, metrics: pathlib.Path, iterations: int
):
    """:func:`_freeze_mid_denoising`, with the run's Train Workers frozen too, at a moment when
    not all ``iterations`` are done (``metrics`` rows): while the trainers are frozen at most
    one more iteration can end (its TRAIN_DONE may be on its way) and the final model cannot
    be saved, so the run cannot finish before the caller thaws them. Returns (trainers, all
    frozen, those mid-denoising) or None."""
    got = _freeze_mid_denoising(parent_pid, events, max_step)
    if got is None:
        return None
    trainers = _freeze(_trainers(up_pid))
    done = metrics.read_text().count("\n") if metrics.is_file() else 0
    if trainers and done < iterations:
        return trainers, *got
    _thaw(got[0] + trainers)
    return None


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
        env=_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    frozen: list[psutil.Process] = []
    try:
        agents = _local_agents(up)
        spot0 = agents["agents"]["spot-0"]
        frozen = _hold_training(rd, up.proc.pid, up.alive)  # until the spot workers serve
        up.wait_for(lambda: _spot_workers_serve(agents), "the spot agents' workers to serve", interval_s=0.5)
        _thaw(frozen)

        frozen, _ = up.wait_for(
            lambda: _freeze_mid_denoising(spot0["pid"], events, num_steps - 3),
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
        _thaw(frozen)
        frozen = []
        up.wait_for(lambda: _gone(spot0["pid"]), "spot-0 to drain and exit")
        rc = up.finish()
        assert rc == 0, f"spotlight up failed (rc {rc})\n{up.logs()}"
    finally:
        _thaw(frozen)
        up.close()
    return rd


@pytest.fixture(scope="module")
def notice_run(tmp_path_factory):
    """Run (a): AWS notice to spot-0 while one of its workers denoises (see _notice_attempt)."""
    tmp = tmp_path_factory.mktemp("notice")
    # exploration off: every request the notice interrupts is an on-policy rollout, whose
    # resumed result is then compared bit for bit (exploration uses the same commit path)
    cfg = _write_config(
        tmp / "config.toml",
        **{"cluster.worker_batch_size": 1, "run.save_rollouts": True, "explore.enabled": False, "run.iterations": 3},
    )
    from spotlight.config import load_config

    rd = _notice_attempt(tmp, cfg, "run", load_config(cfg).sampler.num_steps)
    return rd, cfg


def test_notice_run_completes_with_recompute(notice_run):
    rd, cfg = notice_run
    from spotlight.config import load_config

    c = load_config(cfg)
    reqs = _requests(rd)
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
    metrics = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(c.run.iterations))


def test_resumed_rollouts_are_bit_identical(notice_run):
    """Every resumed rollout equals an uninterrupted batch-1 run of its seed/prompt on its
    weights version (window latents, log-probs and image, bit for bit)."""
    import torch
    from safetensors.torch import load_file

    from spotlight import protocol as P
    from spotlight.cli.up import _cache_dir, load_prompts
    from spotlight.config import load_config
    from spotlight.models.text_encoder import cached_prompt_embeddings
    from spotlight.store.tensor_wire import unpack_tensors
    from spotlight.workers.rollout.worker import RolloutExecutor

    rd, cfg = notice_run
    c = load_config(cfg)
    reqs = _requests(rd)
    resumed = [r for r in reqs if "recompute" in _statuses(r)]
    rollouts = [r for r in resumed if r["kind"] == "rollout"]
    assert rollouts, "no rollout was committed and resumed"
    torch.set_num_threads(max(1, c.cluster.torch_threads))
    embeds, mask = cached_prompt_embeddings(load_prompts(c.data), _cache_dir(), c.model.max_text_tokens)
    embeds = embeds.float()
    ex = RolloutExecutor(c.model, c.sampler)
    saved: dict[int, dict] = {}
    for r in rollouts:
        n = r["iteration"]
        if n not in saved:
            saved[n] = load_file(rd / "rollouts" / f"iter_{n:04d}.safetensors")
            ex.add_version(n, load_file(rd / "tensor_store" / "weights" / f"v{n}.safetensors"))
        got = {k[len(r["request_id"]) + 1 :]: v for k, v in saved[n].items() if k.startswith(r["request_id"] + ".")}
        assert {"image", "window_latents", "log_probs", "seed", "prompt_index"} <= set(got), sorted(got)
        seed, pidx = int(got["seed"][0]), int(got["prompt_index"][0])
        lease = P.Leases(
            worker_id="test",
            items=[
                P.LeaseItem(
                    lease_id=0,
                    request_id=r["request_id"],
                    kind="rollout",
                    iteration=n,
                    prompt_index=pidx,
                    seed=seed,
                    weight_version=n,
                )
            ],
        )
        outcome = ex.run("test", lease, {"cond.embeds": embeds[[pidx]], "cond.mask": mask[[pidx]]})
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
    cfg = _write_config(tmp / "config.toml", **{"run.iterations": 3})
    from spotlight.config import load_config

    last_step = load_config(cfg).sampler.num_steps - 1
    rd = tmp / "run"
    events = tmp / "events.jsonl"
    up = Up(
        rd,
        ["--local", "--agents", "2", "--config", str(cfg), "--log-level", "INFO"],
        env=_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    killed = {}
    orphans: list[psutil.Process] = []
    frozen: list[psutil.Process] = []
    try:
        agents = _local_agents(up)
        spot0, spot1 = agents["agents"]["spot-0"], agents["agents"]["spot-1"]
        frozen = _hold_training(rd, up.proc.pid, up.alive)  # until the spot workers serve
        up.wait_for(lambda: _spot_workers_serve(agents), "the spot agents' workers to serve", interval_s=0.5)
        _thaw(frozen)
        # a rollout or an exploration request, whichever it is: the kill is what matters
        frozen, mid = up.wait_for(
            lambda: _freeze_mid_denoising(spot0["pid"], events, last_step),
            "a worker of spot-0 mid-denoising",
            interval_s=0.0,
        )
        mid[0].send_signal(signal.SIGKILL)
        killed["worker"] = mid[0].pid
        _thaw(frozen)
        metrics = rd / "metrics.jsonl"
        up.wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), "iteration 0 to finish", interval_s=0.2)
        # iteration 1 (or later) runs: kill spot-1 while one of its workers denoises (its
        # leases are re-enqueued when its heartbeats stop)
        frozen, _ = up.wait_for(
            lambda: _freeze_mid_denoising(spot1["pid"], events, last_step),
            "a worker of spot-1 mid-denoising",
            interval_s=0.0,
        )
        orphans.extend(frozen)  # its workers (and warm spare)
        killed["agent_workers"] = [p.pid for p in orphans]
        os.kill(spot1["pid"], signal.SIGKILL)
        killed["agent"] = spot1["pid"]
        _thaw(frozen)  # the orphans run on, find their agent gone and exit
        frozen = []
        rc = up.finish()
        assert rc == 0, f"spotlight up failed (rc {rc})\n{up.logs()}"
        # the orphaned workers of the killed agent notice and exit (no leaked processes)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_gone(pid) for pid in killed["agent_workers"]):
            time.sleep(0.2)
        killed["orphans_left"] = [p.pid for p in orphans if not _gone(p.pid)]
    finally:
        _thaw(frozen)
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
    assert _gone(killed["worker"]) and _gone(killed["agent"])
    assert killed["agent_workers"], "spot-1 had no rollout worker when it was killed"
    assert not killed["orphans_left"], f"rollout workers of the killed agent outlived it: {killed['orphans_left']}"
    reqs = _requests(rd)
    _assert_every_request_done_once(reqs, c.run.iterations * c.data.prompts_per_iteration * c.data.group_size)
    aborted = [r for r in reqs if "aborted" in _statuses(r)]
    assert aborted, "no request was re-executed from scratch after the kills"
    for r in aborted:
        st = _statuses(r)
        i = st.index("aborted")
        # re-enqueued and re-executed from scratch (no committed state to resume from)
        assert st[i + 1 : i + 3] == ["pending", "in_flight"] and "resume" not in r["history"][i + 2][2], r
    metrics = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(c.run.iterations))


# ---------------------------------------------------------------- agent: lost leases


def test_agent_gives_back_leases_of_a_worker_that_died_before_they_arrived(tmp_path, monkeypatch):
    """kill -9 between a worker's PULL and the LEASES answering it: the respawned worker
    (same id, no hello yet) never asked for them, so the agent returns them with FAIL
    instead of holding them forever (its heartbeats would renew them indefinitely)."""
    import zmq

    from agent.main import AgentDaemon
    from spotlight import protocol as P
    from spotlight.net.security import (
        Authenticator,
        add_client,
        apply_server,
        init_keys,
        load_client_keys,
        load_server_keys,
    )

    monkeypatch.setenv("SPOTLIGHT_AGENT_STATE", str(tmp_path))
    init_keys(tmp_path / "keys")
    add_client(tmp_path / "keys", "agent", "n1")
    ctx = zmq.Context()
    auth = Authenticator(ctx, load_server_keys(tmp_path / "keys"))
    auth.start()
    coord = ctx.socket(zmq.ROUTER)
    coord.setsockopt(zmq.LINGER, 0)
    apply_server(coord, auth.keys)
    port = coord.bind_to_random_port("tcp://127.0.0.1")
    d = AgentDaemon(f"127.0.0.1:{port}", [0], node_id="n1", keys=load_client_keys(tmp_path / "keys", role="agent"))
    try:
        d.coord.connect(d.endpoint)
        d.session = "s1"
        # the agent queues nothing for a coordinator it is not connected to (ZMQ_IMMEDIATE):
        # wait for the CURVE handshake by sending until a message gets through
        deadline = time.monotonic() + 60
        while not d._to_coord(P.Heartbeat(node_id="n1", session="s1")):
            assert time.monotonic() < deadline, "the agent never connected"
            time.sleep(0.05)
        assert coord.poll(10_000)
        coord.recv_multipart()
        wid = d.sched.add_worker([0]).worker_id
        d.sched.hello(wid, 1234)
        d.on_worker([wid.encode(), *P.encode(P.Pull(worker_id=wid, max_requests=1))])
        assert coord.poll(10_000)
        assert P.decode(coord.recv_multipart()[1:])[0] == P.MsgType.PULL
        # the worker dies; the agent respawns it (what check_workers does)
        assert d.sched.exited(wid) == []
        d.sched.add_worker([0])
        item = P.LeaseItem(
            lease_id=7, request_id="r0-1", kind="rollout", iteration=0, prompt_index=0, seed=1, weight_version=0
        )
        d.on_coordinator(P.encode(P.Leases(worker_id=wid, items=[item])))
        assert d.sched.in_flight() == []
        assert coord.poll(10_000)
        mtype, body, _ = P.decode(coord.recv_multipart()[1:])
        assert mtype == P.MsgType.FAIL
        assert (body.request_ids, body.lease_ids, body.node_id, body.session) == (["r0-1"], [7], "n1", "s1")
    finally:
        d._detector_thread.stop_event.set()
        for sock in (d.coord, d.workers_sock, d.control):
            sock.close(linger=0)
        coord.close(linger=0)
        auth.stop()
