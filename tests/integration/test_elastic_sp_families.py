"""Elastic SP for the real families end to end: Qwen-Image (LoRA) and FLUX.1 (full fine-tuning)
from saved tiny checkpoints of their real classes, `spotlight up --local` with one spot agent of
2 GPUs at ``cluster.sp_degree = 2``, 2 iterations.

While the SP 2 group's leader is inside a rollout's denoising loop, its GPU is revoked: the
leader commits the batch's state (latents, step, SDE window so far), the surviving member
re-forms alone at SP 1 from the weights in its memory and resumes the committed requests; the
GPU is granted back and a new worker joins the survivor's group, receiving the version by
broadcast. Every request ends exactly once, and every resumed rollout equals an uninterrupted
single-worker run of its seed and prompt on its weights version bit for bit (window latents,
log-probs and image): SP 2 computes what one worker computes (:mod:`spotlight.workers.sp.invariant`).

The two runs split the four (family × fine-tuning) combinations between them; all four cross
SP 2 → 1 → 2 mid-denoising in tests/unit/workers/sp/test_group_families.py. No timing is assumed:
the revocation lands while the spot agent's processes are frozen (SIGSTOP) with the leader
mid-denoising, and the rollouts can only run on the spot group (the reserved node rolls out
nothing), so the run cannot end before the group served them.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
import tomli_w
import torch

from tests.integration.accounting import assert_each_request_ended_once
from tests.integration.runs import (
    agent_ctl,
    hold_training,
    read_jsonl,
    thaw,
    up_command,
    up_env,
    wait_on,
)
from tests.integration.test_families_up import _checkpoint, _config

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]
CASES = [("qwen-image", "lora"), ("flux", "full")]


def _elastic_config(family: str, mode: str, ckpt: pathlib.Path) -> dict:
    full = _config(family, mode, ckpt)
    # batches of one: every rollout of iteration 0 is a separate chance to catch the leader mid-batch
    full["cluster"].update(sp_degree=2, reserved_rollout_gpus=[], worker_batch_size=1)
    if family == "flux":  # 16 image tokens, 8 rows per rank at batch 1: the CPU GEMM needs 4 or more to
        full["model"]["image_size"] = 64  # round a row as one worker does (spotlight/workers/sp/invariant.py)
    full["eval"]["every"] = 0
    full["explore"]["enabled"] = False  # every request the revocation interrupts is a rollout
    full["run"].update(save_rollouts=True, keep_weight_versions=0, sample_grid_every=0)
    return full


def _freeze_leader_mid_denoising(events: pathlib.Path, max_step: int, alive, timeout_s: float = 600.0):
    """SIGSTOP the SP 2 leader inside a leased batch: as soon as its worker events
    (``$SPOTLIGHT_WORKER_EVENTS``) show a denoising step ``<= max_step`` done at SP 2 it is
    stopped, and kept stopped if its last event is still that step (it is then inside the next
    step of the batch; else it is let go and the next chance taken). The tiny models' steps take
    tens of milliseconds, so the file is followed, not polled with a whole process-tree freeze.
    Returns the frozen process and its worker id."""
    import time

    import psutil

    deadline, offset, buf = time.monotonic() + timeout_s, 0, b""

    def new_events():
        nonlocal offset, buf
        if not events.is_file():
            return []
        with open(events, "rb") as f:
            f.seek(offset)
            buf += f.read()
            offset = f.tell()
        *lines, buf = buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    while time.monotonic() < deadline and alive():
        for ev in new_events():
            if ev.get("event") != "step" or ev.get("sp") != 2 or ev.get("step", 99) > max_step:
                continue
            leader = psutil.Process(ev["pid"])
            leader.suspend()
            later = [e for e in new_events() if e.get("pid") == ev["pid"]]
            if not later:
                return leader, ev["worker"]
            leader.resume()  # it moved on while we looked: take the next chance
            break
        time.sleep(0.001)
    raise AssertionError("the SP 2 leader was never caught mid-batch at SP 2 (or the run ended)")


def _status(state: str) -> dict:
    return agent_ctl(state, "agent-status", "--node-id", "spot-0")


def _elastic_run(tmp: pathlib.Path, family: str, mode: str) -> pathlib.Path:
    ckpt = _checkpoint(family, tmp)
    conf = tmp / "config.toml"
    conf.write_text(tomli_w.dumps(_elastic_config(family, mode, ckpt)))
    rd, events = tmp / "run", tmp / "events.jsonl"
    log = open(tmp / "up.log", "w")
    args = ["--local", "--agents", "1", "--gpus-per-agent", "2", "--iterations", "2", "--config", str(conf)]
    proc = subprocess.Popen(
        up_command(*args, "--run-dir", str(rd), "--timeout-s", "900", "--log-level", "INFO"),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=up_env(SPOTLIGHT_WORKER_EVENTS=str(events)),
    )
    frozen, trainers = [], []
    try:
        listing = wait_on(
            lambda: (rd / "local_agents.json").is_file() and json.loads((rd / "local_agents.json").read_text()),
            300,
            "local_agents.json",
            proc,
        )
        state = listing["state_dir"]
        # training is held (Train Worker frozen after publishing v0) until the group has its GPU
        # back, so the run cannot end before the grown group served (iteration 0's rollouts
        # still run: they come before training)
        trainers = hold_training(rd, proc.pid, alive=lambda: proc.poll() is None)
        leader_proc, leader = _freeze_leader_mid_denoising(events, max_step=2, alive=lambda: proc.poll() is None)
        frozen = [leader_proc]
        gpu = int(leader.rsplit("/gpu", 1)[1].split(".")[0])
        assert agent_ctl(state, "revoke", "--gpu", str(gpu), "--node-id", "spot-0", "--grace-s", "30")["ok"]
        thaw(frozen)
        frozen = []
        wait_on(lambda: _status(state).get("gpus") == [1 - gpu], 120, "the revocation", proc)
        wait_on(
            lambda: (g := _status(state).get("groups")) and len(g) == 1 and len(g[0]["members"]) == 1,
            300,
            "the survivor alone at SP 1",
            proc,
        )
        assert agent_ctl(state, "add-gpu", "--gpu", str(gpu), "--node-id", "spot-0")["ok"]
        wait_on(
            lambda: (
                (g := _status(state).get("groups"))
                and len(g[0]["members"]) == 2
                and g[0]["generation"] >= 3
                and g[0]["serving"]
            ),
            600,
            "SP 2 again after the GPU came back",
            proc,
        )
        thaw(trainers)
        trainers = []
        assert proc.wait(timeout=900) == 0
    finally:
        thaw(frozen + trainers)
        if proc.poll() is None:
            proc.kill()
        log.close()
    return rd


def _resumed_rollouts_match_an_uninterrupted_run(rd: pathlib.Path, reqs: list[dict]) -> int:
    """Every rollout that was committed and resumed equals a single-worker run of its seed and
    prompt on its version, bit for bit (window latents, log-probs and decoded image). Returns how
    many were checked."""
    from safetensors.torch import load_file

    from spotlight import protocol as P
    from spotlight.cli.up import _cache_dir, load_prompts
    from spotlight.config import load_config
    from spotlight.models.families import cached_conditioning, get_family
    from spotlight.models.lora import lora_spec
    from spotlight.store.tensor_wire import unpack_tensors
    from spotlight.workers.rollout.worker import RolloutExecutor
    from tests.factories import make_lease_item

    c = load_config(rd / "config.toml")
    cond = cached_conditioning(get_family(c.model), load_prompts(c.data), _cache_dir())
    ex = RolloutExecutor(c.model, c.sampler, lora=lora_spec(c.train))
    resumed = [r for r in reqs if r["kind"] == "rollout" and any(h[0] == "recompute" for h in r["history"])]
    saved: dict[int, dict] = {}
    for r in resumed:
        n = r["iteration"]
        if n not in saved:
            saved[n] = load_file(rd / "rollouts" / f"iter_{n:04d}.safetensors")
            ex.add_version(n, load_file(rd / "tensor_store" / "weights" / f"v{n}.safetensors"))
        got = {k[len(r["request_id"]) + 1 :]: v for k, v in saved[n].items() if k.startswith(r["request_id"] + ".")}
        seed, pidx = int(got["seed"][0]), int(got["prompt_index"][0])
        item = make_lease_item(r["request_id"], iteration=n, prompt_index=pidx, seed=seed, weight_version=n)
        msg, frames = ex.run("ref", P.Leases(worker_id="ref", items=[item]), cond.index([pidx]).to_tensors()).result
        ref = unpack_tensors(msg.tensors, frames)
        for key, ref_key in (("window_latents", "window_latents"), ("log_probs", "log_probs"), ("image", "images")):
            diff = (got[key].double() - ref[ref_key][0].double()).abs().max().item()
            assert torch.equal(got[key], ref[ref_key][0]), (r["request_id"], key, diff)
    return len(resumed)


@pytest.mark.parametrize("family,mode", CASES)
def test_family_sp2_group_loses_a_gpu_mid_rollout_and_gets_it_back(tmp_path, family, mode):
    rd = _elastic_run(tmp_path, family, mode)
    text = (tmp_path / "up.log").read_text() + "".join(
        f.read_text(errors="replace") for f in sorted((rd / "logs").glob("*.log"))
    )
    assert "weights from memory" in text  # the survivor re-formed without reloading
    rejoined = "".join(f.read_text(errors="replace") for f in (rd / "logs").glob("worker-spot-0-gpu*.r1.log"))
    assert "weights from broadcast" in rejoined  # the granted GPU's worker got the version from its peer
    reqs = read_jsonl(rd / "requests.jsonl")
    assert_each_request_ended_once(reqs)
    assert _resumed_rollouts_match_an_uninterrupted_run(rd, reqs) > 0, "no rollout was committed and resumed"
    rows = read_jsonl(rd / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    # on-policy check: the trainer (SP 1) recomputes the SP-made log-probs to within the SP tolerance
    assert all(r["train/ratio_max_dev"] <= 1e-3 for r in rows), [r["train/ratio_max_dev"] for r in rows]
