"""Reconfiguration benchmark: elastic SP vs a full engine restart (paper §3.2.2, §4.4, §6.4).

Measures, on one node with real processes, the time from a GPU revocation (SP 2 → 1) and
from a GPU addition (SP 1 → 2) until the node produces a denoising step again:

* elastic  — the persistent path Spotlight takes: on revocation only the revoked worker
  exits and the survivor re-forms its group from the weights in its memory; on addition
  one new worker process starts and receives the weights from its co-located peer by a
  torch.distributed broadcast over the rebuilt group;
* restart  — what an engine without elastic SP does (RLBoost-style): every worker of the
  node is killed, fresh processes start, each loads the weights from the coordinator's
  Tensor Store over the network (ZeroMQ TCP, safetensors bytes), forms the group, runs.

The model is the Qwen-Image transformer class at a size whose fp32 weights exceed
300 MB (default 3 blocks × 1024 wide ≈ 108 M parameters ≈ 430 MB). Both paths are
measured side by side in one run and reported as a ratio, several repetitions each.

    python benchmarks/reconfig.py            # ~3-5 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch.multiprocessing as mp  # noqa: E402

BIG_MODEL = {"num_layers": 3, "num_attention_heads": 16, "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24], "image_size": 32, "patch_size": 2, "max_text_tokens": 16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights_server(blob: bytes, endpoint_out: list, stop: threading.Event) -> None:
    """The coordinator's Tensor Store stand-in: serves the safetensors blob over ZeroMQ TCP."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_out.append(f"tcp://127.0.0.1:{port}")
    while not stop.is_set():
        if sock.poll(100):
            sock.recv()
            sock.send(blob, copy=False)
    sock.close(0)


def member_main(worker_id: str, model_cfg: dict, cmd_q, out_q, t_spawn: float) -> None:
    """One GPU worker process: follows commands from the driver."""
    import torch

    torch.set_num_threads(1)
    import zmq

    from spotlight.config import ModelConfig, SamplerConfig
    from spotlight.models.dit import token_shape
    from spotlight.rl.sampler import Conditioning, Sampler
    from spotlight.tensor_wire import bytes_to_state_dict
    from spotlight.workers import sp_group as G

    cfg = ModelConfig(**model_cfg)
    member = G.SPGroupMember(cfg, worker_id, torch.device("cpu"))
    sampler = Sampler(SamplerConfig(), token_shape(cfg))
    cond = Conditioning(torch.randn(1, 16, 384), torch.ones(1, 16, dtype=torch.long))
    state = sampler.initial_state([1234])
    pending = None
    out_q.put(("ready", worker_id, time.time() - t_spawn))
    while True:
        cmd, *args = cmd_q.get()
        if cmd == "fetch":  # load weights from the coordinator over the network
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.connect(args[0])
            sock.send(b"weights")
            pending = bytes_to_state_dict(sock.recv())
            sock.close(0)
            out_q.put(("fetched", worker_id, time.time()))
        elif cmd == "set":  # weights handed in directly (initial setup only)
            pending = bytes_to_state_dict(args[0])
            out_q.put(("set", worker_id, time.time()))
        elif cmd == "form":
            members, port, gen = args
            member.form(G.GroupSpec(tuple(members), "127.0.0.1", port, gen), state_dict=pending, version=0 if pending is not None else None)
            pending = None
            out_q.put(("formed", worker_id, member.weights_source))
        elif cmd == "step":
            if member.is_leader:
                if state.step >= sampler.cfg.num_steps:
                    state = sampler.initial_state([1234])
                G.run_group_batch(member, sampler, state, cond, stop_at=state.step + 1)
            else:
                G.serve_batch(member)
            out_q.put(("stepped", worker_id, time.time()))
        elif cmd == "release":
            G.release_followers(member)
            out_q.put(("released", worker_id, time.time()))
        elif cmd == "serve":  # follower: wait for the leader's release
            G.serve_until_released(member)
            out_q.put(("served", worker_id, time.time()))
        elif cmd == "exit":
            member.leave()
            return


class Node:
    """Driver-side handle on the worker processes of one node."""

    def __init__(self, model_cfg: dict):
        self.ctx = mp.get_context("spawn")
        self.model_cfg = model_cfg
        self.procs: dict[str, tuple] = {}
        self.out = self.ctx.Queue()
        self.gen = 0

    def spawn(self, wid: str) -> None:
        q = self.ctx.Queue()
        p = self.ctx.Process(target=member_main, args=(wid, self.model_cfg, q, self.out, time.time()), daemon=True)
        p.start()
        self.procs[wid] = (p, q)

    def send(self, wid: str, *cmd) -> None:
        self.procs[wid][1].put(cmd)

    def wait(self, kind: str, n: int = 1, timeout_s: float = 900.0) -> list:
        got = []
        while len(got) < n:
            msg = self.out.get(timeout=timeout_s)
            if msg[0] == kind:
                got.append(msg)
        return got

    def form(self, members: list[str]) -> list:
        self.gen += 1
        port = _free_port()
        for m in members:
            self.send(m, "form", members, port, self.gen)
        return self.wait("formed", len(members))

    def step(self, members: list[str]) -> float:
        for m in members:
            self.send(m, "step")
        return max(t for _, _, t in self.wait("stepped", len(members)))

    def kill(self, wid: str) -> None:
        p, _ = self.procs.pop(wid)
        p.kill()
        p.join()

    def stop_all(self) -> None:
        for wid in list(self.procs):
            self.kill(wid)


def measure(args) -> dict:
    import torch

    from spotlight.config import ModelConfig
    from spotlight.models.dit import build_transformer
    from spotlight.tensor_wire import state_dict_to_bytes

    cfg = dict(BIG_MODEL, num_layers=args.num_layers)
    model = build_transformer(ModelConfig(**cfg))
    n_params = sum(p.numel() for p in model.parameters())
    blob = state_dict_to_bytes(model.state_dict())
    del model
    size_mb = len(blob) / 1e6
    print(f"model: {n_params / 1e6:.1f} M parameters, {size_mb:.0f} MB fp32 weights", flush=True)
    stop = threading.Event()
    ep: list = []
    threading.Thread(target=weights_server, args=(blob, ep, stop), daemon=True).start()
    while not ep:
        time.sleep(0.01)
    coord = ep[0]
    results = {"elastic_revoke_s": [], "restart_revoke_s": [], "elastic_add_s": [], "restart_add_s": []}
    a, b = "node/gpu0", "node/gpu1"
    for rep in range(args.repeats):
        # --- start: SP=2 group with weights (setup, not timed)
        node = Node(cfg)
        node.spawn(a)
        node.spawn(b)
        node.wait("ready", 2)
        node.send(a, "set", blob)
        node.wait("set")
        node.form([a, b])
        node.step([a, b])

        # --- elastic revocation: gpu1 revoked; survivor re-forms from memory, then steps
        t0 = time.time()
        node.send(a, "release")
        node.send(b, "serve")
        node.wait("released")
        node.wait("served")
        node.kill(b)
        node.form([a])
        t1 = node.step([a])
        results["elastic_revoke_s"].append(t1 - t0)

        # --- elastic addition: a new process joins and gets weights from its peer by broadcast
        t0 = time.time()
        node.spawn(b)
        node.wait("ready")
        formed = node.form([a, b])
        t1 = node.step([a, b])
        assert any(src == "broadcast" for _, w, src in formed if w == b), formed
        results["elastic_add_s"].append(t1 - t0)
        node.stop_all()

        # --- restart on revocation: kill the engine, start a fresh SP=1 one that loads remotely
        node = Node(cfg)
        t0 = time.time()
        node.spawn(a)
        node.wait("ready")
        node.send(a, "fetch", coord)
        node.wait("fetched")
        node.form([a])
        t1 = node.step([a])
        results["restart_revoke_s"].append(t1 - t0)
        node.stop_all()

        # --- restart on addition: kill the engine, start a fresh SP=2 one; both load remotely
        node = Node(cfg)
        t0 = time.time()
        node.spawn(a)
        node.spawn(b)
        node.wait("ready", 2)
        node.send(a, "fetch", coord)
        node.send(b, "fetch", coord)
        node.wait("fetched", 2)
        node.form([a, b])
        t1 = node.step([a, b])
        results["restart_add_s"].append(t1 - t0)
        node.stop_all()
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()), flush=True)
    stop.set()
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "model_params_m": n_params / 1e6,
        "weights_mb": size_mb,
        "repeats": args.repeats,
        "median_s": med,
        "raw_s": results,
        "ratio_revoke": med["restart_revoke_s"] / med["elastic_revoke_s"],
        "ratio_add": med["restart_add_s"] / med["elastic_add_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=3, help="transformer blocks (3 x 1024 wide = 430 MB fp32)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "reconfig.json"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = measure(args)
    m = res["median_s"]
    print(
        f"\nweights {res['weights_mb']:.0f} MB; median of {res['repeats']}:\n"
        f"  revocation (SP 2 -> 1): elastic {m['elastic_revoke_s']:.2f}s vs restart {m['restart_revoke_s']:.2f}s  -> {res['ratio_revoke']:.1f}x\n"
        f"  addition   (SP 1 -> 2): elastic {m['elastic_add_s']:.2f}s vs restart {m['restart_add_s']:.2f}s  -> {res['ratio_add']:.1f}x"
    )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
