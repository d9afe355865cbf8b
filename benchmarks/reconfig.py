"""Reconfiguration benchmark: elastic SP with a warm spare vs a full restart (paper §3.2.2, §4.4, §6.4).

Everything timed here is the real code path: a real ``spotlight-agent`` process (``python -m
agent.main join``) with its real Rollout Worker processes (SP groups, diffusers context
parallelism over gloo), talking ZeroMQ CURVE to the coordinator's own control plane in this
process, serving a run that never ends (:class:`spotlight.coordinator.fixed_run.FixedRun`: the
weights in ``cluster.weight_chunk_bytes`` chunks, rollout requests whenever a worker pulls), so
the node denoises all the time. Reconfigurations go through the agent's control socket, exactly as
``spotlight-agent revoke`` / ``add-gpu`` send them. Workers append timing events to a file
(``SPOTLIGHT_WORKER_EVENTS``, spotlight/workers/rollout/worker.py): group formed (per member, with its
phases), denoising step done.

Scenarios, one node with 2 CPU "GPUs", ``cluster.sp_degree = 2``:

* **elastic revocation** (SP 2 → 1): ``revoke --gpu 1``; the survivor finishes its step in
  progress, releases the revoked member and re-forms alone from the weights in its memory.
* **elastic grant** (SP 1 → 2, warm spare): ``add-gpu --gpu 1``; the agent's warm spare
  (torch/diffusers imported, receive buffer pre-faulted) becomes the new worker, receives the
  weights from its co-located peer by broadcast and joins; the agent starts the next spare.
* **elastic grant, cold** — the same without a spare (``--no-warm-spare``): a new Python process.
* **restart on revocation / on grant** — what an engine without elastic SP does (RLBoost-style):
  the node's agent and workers are killed, a fresh agent starts with the new GPU set, its
  workers start cold, the leader loads the weights from the coordinator over the network
  (CURVE-encrypted TCP, loopback here), broadcasts them to its peer, forms, serves. No spare.

Measured per event (``t0`` = the control command is sent, or the old node is killed; an
elastic event fires at a uniformly random point inside a denoising step, seeded by ``--seed``):

* ``serve`` — until every member of the group at the new size has formed (the group's next
  denoising step starts at once): the GPU granted back is serving / the survivor serves alone;
* ``step``  — until the first denoising step at the new size has finished;
* ``stall`` — how long the node produced no denoising step: from the end of the last step it
  completed at the old size (a restart: from the kill) until the group at the new size serves.
  A revoked group's survivor finishes the step in progress with the revoked member (useful
  work) before it re-forms; a leader alone abandons its step in progress when a GPU joins (that
  partial step counts as stall, even the part before ``t0``).
* ``released`` (elastic revocation) — until the revoked worker's process has ended (the agent
  noticed), i.e. the GPU is free for whoever revoked it.

The same scenarios run for the tiny family and for a ``qwen-image`` SP group: a saved tiny
checkpoint of Qwen-Image's real classes (VAE, Qwen2.5-VL text encoder, the transformer as wide as
the tiny one: ``QWEN_TRANSFORMER``), loaded through ``model.pretrained_path`` as a user's
checkpoint is, with true CFG (the negative prompt's rows travel with every batch) at 128² (64
image tokens).

    python benchmarks/reconfig.py --repeats 3     # ~10 min per family on 2 busy CPU cores
    python benchmarks/reconfig.py --families qwen-image --repeats 1 --skip-cold
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BIG_MODEL = {
    "num_layers": 3,
    "num_attention_heads": 16,
    "attention_head_dim": 64,
    "axes_dims_rope": [16, 24, 24],
    "image_size": 32,
    "patch_size": 2,
    "max_text_tokens": 16,
}
SAMPLER = {"num_steps": 40, "sde_window_size": 8}
QWEN_TRANSFORMER = {
    "num_layers": 3,
    "num_attention_heads": 16,
    "attention_head_dim": 64,
    "axes_dims_rope": (16, 24, 24),
}
QWEN_IMAGE_SIZE = 128
WAIT_S = 600.0
LIVE_NODES: list["Node"] = []
"""Agents started and not killed yet (killed if the benchmark is interrupted)."""


class Node:
    """One ``spotlight-agent join`` process (its own session: killed as a whole) and its events."""

    def __init__(
        self, name: str, gpus: list[int], *, spare: bool, port: int, keys_dir: pathlib.Path, work: pathlib.Path
    ):
        self.name = name
        self.events_path = work / f"{name}.events.jsonl"
        self.events_path.write_text("")
        self.log = open(work / f"{name}.log", "w")
        env = dict(os.environ, SPOTLIGHT_WORKER_EVENTS=str(self.events_path), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [
            sys.executable,
            "-m",
            "agent.main",
            "join",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--gpus",
            ",".join(map(str, gpus)),
            "--node-id",
            name,
            "--keys",
            str(keys_dir),
            "--key",
            "bench",
            "--grace-s",
            "10",
            "--warm-spare" if spare else "--no-warm-spare",
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
        LIVE_NODES.append(self)
        self._seen = 0
        self.events: list[dict] = []

    def poll_events(self) -> list[dict]:
        with open(self.events_path) as f:
            lines = f.read().splitlines()
        for line in lines[self._seen :]:
            if line.strip():
                self.events.append(json.loads(line))
        self._seen = len(lines)
        return self.events

    def wait_event(self, pred, what: str, timeout_s: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in self.poll_events():
                if pred(e):
                    return e
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: agent exited ({self.proc.returncode}) waiting for {what}; see {self.log.name}"
                )
            time.sleep(0.005)
        raise TimeoutError(f"{self.name}: timed out waiting for {what}")

    def control(self, request: dict) -> dict:
        import zmq

        from spotlight.net.agent_paths import control_endpoint

        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(control_endpoint(self.name))
        try:
            sock.send(json.dumps(request).encode())
            if not sock.poll(30_000):
                raise TimeoutError(f"{self.name}: no answer to {request}")
            return json.loads(sock.recv())
        finally:
            sock.close()

    def status(self) -> dict:
        return self.control({"cmd": "status"})

    def wait_status(self, pred, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.05) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                s = self.status()
                if pred(s):
                    return s
            except (TimeoutError, OSError, ValueError):
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"{self.name}: timed out waiting for {what}")

    def kill(self) -> None:
        """SIGKILL the agent and every process of its session (workers, spare)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        if self in LIVE_NODES:
            LIVE_NODES.remove(self)


def _formed(events: list[dict], sp: int, after: float) -> list[dict]:
    return [e for e in events if e["event"] == "formed" and e["sp"] == sp and e["t_unix_s"] >= after]


def measure_event(node: Node, t0: float, sp: int, members: int) -> dict:
    """serve / step / stall of the reconfiguration that started at ``t0`` towards ``sp``."""
    ev = node.wait_event(lambda e: len(_formed(node.events, sp, t0)) >= members, f"{members} members formed at SP {sp}")
    formed = _formed(node.events, sp, t0)[:members]
    gen = {e["generation"] for e in formed}
    t_serve = max(e["t_unix_s"] for e in formed)
    step = node.wait_event(
        lambda e: e["event"] == "step" and e.get("sp") == sp and e["t_unix_s"] > t_serve, f"first step at SP {sp}"
    )
    old_steps = [
        e["t_unix_s"] for e in node.events if e["event"] == "step" and e.get("sp") != sp and e["t_unix_s"] <= t_serve
    ]
    paused_from = max(old_steps) if old_steps else t0  # a restarted node has no old steps: from the kill
    phases = {e["worker"]: {k: round(v, 3) for k, v in e["timings_s"].items()} for e in formed}
    del ev
    return {
        "serve_s": t_serve - t0,
        "step_s": step["t_unix_s"] - t0,
        "stall_s": t_serve - paused_from,
        "generations": sorted(gen),
        "phases_s": phases,
    }


def settle(node: Node, sp: int, steps: int = 2, rng: random.Random | None = None) -> None:
    """Wait until ``steps`` more denoising steps ran at ``sp`` (steady state); with ``rng``, then
    wait a uniform random part of the last step's duration, so the next event lands at a random
    point inside a step (not right after one ends, which would bias what the event waits for)."""
    n0 = sum(1 for e in node.poll_events() if e["event"] == "step" and e.get("sp") == sp)
    node.wait_event(
        lambda e: sum(1 for x in node.events if x["event"] == "step" and x.get("sp") == sp) >= n0 + steps,
        f"{steps} steps at SP {sp}",
    )
    if rng is not None:
        t = [e["t_unix_s"] for e in node.events if e["event"] == "step" and e.get("sp") == sp][-2:]
        time.sleep(rng.uniform(0.0, t[1] - t[0]))


def elastic_round(tag: str, spare: bool, ctx: dict, rng: random.Random) -> dict:
    """Start a 2-GPU node (not timed), then time: revoke GPU 1, grant GPU 1 back."""
    node = Node(f"elastic-{tag}", [0, 1], spare=spare, **ctx)
    out = {}
    try:
        node.wait_event(lambda e: e["event"] == "formed" and e["sp"] == 2, "initial SP 2 group")
        if spare:
            node.wait_status(lambda s: s.get("spare") and s["spare"]["ready"], "warm spare ready")
        settle(node, 2, rng=rng)
        # --- revocation: GPU 1 (the follower) leaves
        revoked = [w for w in node.status()["workers"] if w.endswith("/gpu1") or "/gpu1." in w][-1]
        released: dict = {}
        t0 = time.time()
        assert node.control({"cmd": "revoke", "gpus": [1], "grace_s": 10})["ok"]
        # watched concurrently: the agent saw the revoked worker's process end
        watch = threading.Thread(
            target=lambda: released.update(
                s=node.wait_status(lambda s: s["workers"][revoked] == "exited", "revoked worker gone", poll_s=0.01)
                and time.time() - t0
            ),
            daemon=True,
        )
        watch.start()
        out["revoke"] = measure_event(node, t0, 1, 1)
        watch.join(WAIT_S)
        out["revoke"]["released_s"] = released["s"]
        settle(node, 1, rng=rng)
        # --- grant: GPU 1 comes back
        before = node.status()
        spare_pid = before["spare"]["pid"] if before.get("spare") else None
        t0 = time.time()
        reply = node.control({"cmd": "add", "gpus": [1]})
        assert reply["ok"], reply
        out["add"] = measure_event(node, t0, 2, 2)
        after = node.wait_status(lambda s: s["worker_pids"].get(reply["started"][0], 0) > 0, "new worker's hello")
        out["add"]["new_worker_pid"] = after["worker_pids"][reply["started"][0]]
        out["add"]["spare_pid_before"] = spare_pid
        out["add"]["spare_used"] = spare_pid is not None and out["add"]["new_worker_pid"] == spare_pid
        settle(node, 2)
        if spare:
            s = node.wait_status(lambda s: s.get("spare") and s["spare"]["ready"], "replacement spare ready")
            out["add"]["next_spare_pid"] = s["spare"]["pid"]
    finally:
        node.kill()
    return out


def restart_round(tag: str, ctx: dict) -> dict:
    """Time a full restart of a node onto 1 GPU (revocation) and onto 2 GPUs (grant)."""
    out = {}
    for event, before, after in (("revoke", [0, 1], [0]), ("add", [0], [0, 1])):
        old = Node(f"restart-{event}-old-{tag}", before, spare=False, **ctx)
        try:
            old.wait_event(
                lambda e: e["event"] == "formed" and e["sp"] == len(before), f"initial SP {len(before)} group"
            )
            settle(old, len(before))
        finally:
            t0 = time.time()
            old.kill()
        new = Node(f"restart-{event}-new-{tag}", after, spare=False, **ctx)
        try:
            out[event] = measure_event(new, t0, len(after), len(after))
        finally:
            new.kill()
    return out


def _model(family: str, args, work: pathlib.Path):
    """``(model section, v0 weights file, one row of conditioning, parameters, weights bytes)``."""
    import torch

    from spotlight.config import ModelConfig
    from spotlight.models.dit import build_transformer
    from spotlight.rl.sampler import Conditioning
    from spotlight.store.tensor_wire import save_version

    tokens = BIG_MODEL["max_text_tokens"]
    if family == "tiny":
        cfg = ModelConfig(**dict(BIG_MODEL, num_layers=args.num_layers))
        model = build_transformer(cfg)
        cond = Conditioning(torch.randn(1, tokens, 384), torch.ones(1, tokens, dtype=torch.int64))
    else:
        from spotlight.models.families import get_family
        from spotlight.models.families.qwen_image import TINY_TEXT_CONFIG, make_random_checkpoint

        ckpt = make_random_checkpoint(
            work / "ckpt-qwen-image", transformer_kwargs=dict(QWEN_TRANSFORMER, num_layers=args.num_layers)
        )
        cfg = ModelConfig(
            family="qwen-image", pretrained_path=str(ckpt), image_size=QWEN_IMAGE_SIZE, max_text_tokens=tokens
        )
        model = get_family(cfg).build_transformer(torch.float32)
        dim, mask = TINY_TEXT_CONFIG["hidden_size"], torch.ones(1, tokens, dtype=torch.int64)
        neg = {"neg.embeds": torch.randn(1, tokens, dim), "neg.mask": mask.clone()}
        cond = Conditioning(torch.randn(1, tokens, dim), mask, neg)
    n_params = sum(p.numel() for p in model.parameters())
    size_bytes, _ = save_version(model.state_dict(), work / "v0.safetensors")
    return cfg, work / "v0.safetensors", cond, n_params, size_bytes


def measure(args, family: str) -> dict:
    import torch

    from spotlight.config import ClusterConfig, SamplerConfig, SpotlightConfig
    from spotlight.coordinator.fixed_run import FixedRun
    from spotlight.net.security import add_client, init_keys, load_server_keys

    torch.set_num_threads(1)
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"spotlight-reconfig-{family}-"))
    cfg, weights, cond, n_params, size_bytes = _model(family, args, work)
    print(f"{family} model: {n_params / 1e6:.1f} M parameters, {size_bytes / 1e6:.0f} MB fp32 weights", flush=True)
    os.environ["SPOTLIGHT_AGENT_STATE"] = str(work / "state")
    keys_dir = work / "keys"
    init_keys(keys_dir)
    add_client(keys_dir, "agent", "bench")
    run_cfg = SpotlightConfig(
        model=cfg,
        sampler=SamplerConfig(**SAMPLER),
        cluster=ClusterConfig(
            sp_degree=2, heartbeat_interval_s=1.0, lease_timeout_s=600.0, worker_batch_size=1, torch_threads=1
        ),
    )
    coord = FixedRun(run_cfg, work, keys=load_server_keys(keys_dir), weights=weights, cond=cond).start()
    ctx = {"port": coord.port, "keys_dir": keys_dir, "work": work}
    rows: dict[str, list[dict]] = {
        k: [] for k in ("elastic_revoke", "elastic_add", "cold_add", "restart_revoke", "restart_add")
    }
    rng = random.Random(args.seed)
    try:
        for rep in range(args.repeats):
            e = elastic_round(f"spare{rep}", True, ctx, rng)
            rows["elastic_revoke"].append(e["revoke"])
            rows["elastic_add"].append(e["add"])
            if not args.skip_cold:
                c = elastic_round(f"cold{rep}", False, ctx, rng)
                rows["elastic_revoke"].append(c["revoke"])
                rows["cold_add"].append(c["add"])
            r = restart_round(str(rep), ctx)
            rows["restart_revoke"].append(r["revoke"])
            rows["restart_add"].append(r["add"])
            print(
                f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]['serve_s']:.2f}s" for k, v in rows.items() if v),
                flush=True,
            )
            print(
                f"  grant phases: {e['add']['phases_s']}; spare used: {e['add']['spare_used']} "
                f"(pid {e['add']['new_worker_pid']}, next spare {e['add'].get('next_spare_pid')})",
                flush=True,
            )
            print(f"  revoke phases: {e['revoke']['phases_s']}", flush=True)
    finally:
        coord.stop()
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("serve_s", "step_s", "stall_s")}
        for k, v in rows.items()
        if v
    }
    ratios = {
        f"{ev}_{m}": med[f"restart_{ev}"][m] / med[f"elastic_{ev}"][m]
        for ev in ("revoke", "add")
        for m in ("serve_s", "step_s", "stall_s")
    }
    med["elastic_revoke"]["released_s"] = statistics.median(r["released_s"] for r in rows["elastic_revoke"])
    return {
        "family": family,
        "model_params_m": n_params / 1e6,
        "weights_mb": size_bytes / 1e6,
        "repeats": args.repeats,
        "median": med,
        "ratios": ratios,
        "raw": rows,
        "work_dir": str(work),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=3, help="transformer blocks (3 x 1024 wide = 469 MB fp32)")
    ap.add_argument("--skip-cold", action="store_true", help="skip the elastic grant without a spare")
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the random point inside a step at which elastic events fire"
    )
    ap.add_argument(
        "--families", default="tiny,qwen-image", help="comma-separated: tiny, qwen-image (a real-class checkpoint)"
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "reconfig.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    results = {}
    try:
        for family in [f.strip() for f in args.families.split(",") if f.strip()]:
            if family not in ("tiny", "qwen-image"):
                raise SystemExit(f"--families: unknown family {family!r} (tiny, qwen-image)")
            results[family] = measure(args, family)
            report(results[family])
    finally:
        for node in list(LIVE_NODES):  # an interrupted run leaves no agent behind
            node.kill()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def report(res: dict) -> None:
    m, r = res["median"], res["ratios"]
    lines = [
        f"\n{res['family']}: weights {res['weights_mb']:.0f} MB; median of {res['repeats']} (seconds from the event):",
        f"{'':34s}{'serve':>8s}{'step':>8s}{'stall':>8s}",
    ]
    names = {
        "elastic_revoke": "revocation SP 2->1, elastic",
        "restart_revoke": "revocation SP 2->1, restart",
        "elastic_add": "grant SP 1->2, elastic + spare",
        "cold_add": "grant SP 1->2, elastic, cold",
        "restart_add": "grant SP 1->2, restart",
    }
    for k, label in names.items():
        if k in m:
            lines.append(f"  {label:32s}{m[k]['serve_s']:8.2f}{m[k]['step_s']:8.2f}{m[k]['stall_s']:8.2f}")
    lines.append(
        "  elastic revocation: the revoked worker's process ended "
        f"{m['elastic_revoke']['released_s']:.2f}s after the event"
    )
    lines.append(
        f"  restart / elastic, revocation:  serve {r['revoke_serve_s']:.1f}x  step {r['revoke_step_s']:.1f}x"
        f"  stall {r['revoke_stall_s']:.1f}x"
    )
    lines.append(
        f"  restart / elastic, grant:       serve {r['add_serve_s']:.1f}x  step {r['add_step_s']:.1f}x"
        f"  stall {r['add_stall_s']:.1f}x"
    )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
