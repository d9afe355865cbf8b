"""End to end: `spotlight up --local` with 2 spot agents for 2 iterations, as a user runs it.

Real processes (coordinator, FSDP2 train worker, reserved + 2 spot agents, 3 rollout
workers) over real ZeroMQ TCP sockets on loopback.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from tests.integration.accounting import assert_each_request_ended_once

REPO = pathlib.Path(__file__).resolve().parents[2]


# the embedded default, with a smaller batch so the test stays quick on 2 cores
OVERRIDES = {
    "data.prompts_per_iteration": 8,
    "data.num_control_prompts": 4,
    "explore.planner": "fixed",
    "explore.num_candidates": 16,
    "eval.every": 1,  # held-out evaluation during training (docs/evaluation.md), on a small panel
    "eval.num_prompts": 6,
    "eval.num_seeds": 2,
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    from spotlight.config import dump_config, load_config

    rd = tmp_path_factory.mktemp("run")
    conf = rd.parent / "config.toml"
    dump_config(load_config(overrides=OVERRIDES), conf)
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "up",
        "--local",
        "--agents",
        "2",
        "--iterations",
        "2",
        "--config",
        str(conf),
        "--run-dir",
        str(rd),
        "--timeout-s",
        "900",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, f"spotlight up failed:\nSTDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-4000:]}"
    (rd.parent / "console.txt").write_text(proc.stdout + proc.stderr)
    return rd


def test_console_is_quiet(run_dir):
    """Only the coordinator's warnings and the progress lines reach the console."""
    console = (run_dir.parent / "console.txt").read_text()
    assert " INFO " not in console and "Traceback" not in console, console
    assert [line.split(" reward")[0] for line in console.splitlines() if line.startswith("iter ")] == [
        "iter 1/2",
        "iter 2/2",
    ]
    # what to do with the finished run (first putting `spotlight` on the PATH where it is not)
    assert re.search(r"next: (source \S+/bin/activate, then )?spotlight eval --run-dir", console.replace("\n", " "))
    assert re.search(r"held-out panel after iteration 2: strict \d\.\d{3} partial \d\.\d{3} \(base strict", console)


def _requests(rd: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (rd / "requests.jsonl").read_text().splitlines()]


def test_every_request_done_exactly_once(run_dir):
    reqs = _requests(run_dir)
    kinds = collections.Counter(r["kind"] for r in reqs)
    # 2 iterations x 8 prompts x 8 seeds rollouts; exploration of batch 1 (4 explored prompts x 16 candidates)
    assert kinds["rollout"] == 2 * 8 * 8
    # the 16 planned candidates of each explored prompt, plus extras streamed while training ran
    planned = [r for r in reqs if r["kind"] == "explore" and int(r["request_id"].split("-")[1]) < 4 * 16]
    assert len(planned) == 4 * 16 and kinds["explore"] >= 4 * 16
    assert_each_request_ended_once(reqs)
    assert all(r["status"] == "done" for r in planned)


def test_old_requests_leave_memory_and_checkpoints_for_the_log(run_dir):
    """Retention rule: the checkpoint after iteration 2 holds no finished request of
    iteration 1 (they were appended to requests.jsonl first, up to the byte count it
    records); the log still lists every request once."""
    from spotlight.store.checkpoint import latest_checkpoint, load_checkpoint

    n, path = latest_checkpoint(run_dir, cleanup=False)
    st = load_checkpoint(path)
    assert n == 1
    kept = st["scheduler"]["requests"]
    assert kept and not any(r["iteration"] == 0 and r["status"] in ("done", "cancelled") for r in kept)
    retired = [
        json.loads(line)
        for line in (run_dir / "requests.jsonl").read_bytes()[: st["requests_bytes"]].decode().splitlines()
    ]
    assert retired and {r["iteration"] for r in retired} == {0}
    ids = [r["request_id"] for r in _requests(run_dir)]
    assert len(ids) == len(set(ids)) and {r["request_id"] for r in retired} <= set(ids)
    assert not {r["request_id"] for r in retired} & {r["request_id"] for r in kept}


def test_metrics_and_outputs(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for key in (
        "reward/mean",
        "reward/std",
        "reward/control_std",
        "time/rollout_s",
        "time/train_s",
        "time/explore_s",
        "time/explore_critical_path_s",
        "spot/busy_fraction",
    ):
        assert key in rows[0], key
    # fresh samples, unchanged weights: Flow-GRPO's debug check (ratio exactly 1 on the first pass)
    assert rows[0]["train/ratio_max_dev"] == 0.0
    assert rows[0]["explore/num_requests"] >= 4 * 16
    assert rows[0]["explore/num_requests"] - rows[0]["explore/num_extra_requests"] == 4 * 16
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "samples" / "iter_0001.png").is_file()  # grids are named by the 1-based iteration, as on screen
    assert (run_dir / "reward_curve.png").is_file()


def test_tensorboard_events_and_log_files(run_dir):
    """Tracking is on by default (TensorBoard) and every process logs to <run_dir>/logs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]  # 1-based iterations
    assert [e.step for e in acc.Images("samples")]  # the sample grid(s)
    assert any(t.startswith("config") for t in acc.Tags()["tensors"])
    logs = {p.name for p in (run_dir / "logs").glob("*.log")}
    assert {
        "coordinator.log",
        "trainer-0.log",
        "agent-reserved-0.log",
        "agent-spot-0.log",
        "agent-spot-1.log",
    } <= logs, logs
    assert any(n.startswith("worker-spot-0-gpu0") for n in logs), logs


def _final_adapter(run_dir: pathlib.Path, folder: str = "final") -> dict[str, torch.Tensor]:
    """The LoRA adapter a run saved (the default trains one), in v0's key names."""
    from safetensors.torch import load_file

    saved = load_file(run_dir / folder / "pytorch_lora_weights.safetensors")  # diffusers' naming
    return {
        k.removeprefix("transformer.")
        .replace(".lora_A.", ".lora_A.default.")
        .replace(".lora_B.", ".lora_B.default."): v
        for k, v in saved.items()
    }


def test_training_changed_the_weights(run_dir):
    """The default trains a LoRA adapter: final/ holds it (diffusers format) and most of its
    lora_B matrices, zero in v0, have moved."""
    from safetensors.torch import load_file

    v0 = load_file(run_dir / "tensor_store" / "weights" / "v0.safetensors")
    final = _final_adapter(run_dir)
    assert set(final) == set(v0) and all("lora_" in k for k in v0)
    lora_b = [k for k in v0 if "lora_B" in k]
    assert all(not v0[k].any() for k in lora_b)
    assert sum(bool(final[k].any()) for k in lora_b) > len(lora_b) // 2


def test_default_is_the_shapes_task_from_the_shipped_base_model(run_dir):
    """The embedded default starts from the shipped pretrained checkpoint (the base under the
    adapter; v0 = a fresh adapter, so the v0 policy is the base model), scores with the
    GenEval-style reward, and draws grids with the prompt above each row."""
    from safetensors.torch import load_file

    from spotlight.config import load_config
    from spotlight.tasks.shapes.pretrain import SHIP_DIR

    cfg = load_config(run_dir / "config.toml")
    assert cfg.model.pretrained_dir.resolve() == SHIP_DIR.resolve() and cfg.train.lora_rank > 0
    v0 = load_file(run_dir / "tensor_store" / "weights" / "v0.safetensors")
    assert all(not v.any() for k, v in v0.items() if "lora_B" in k)  # the adapter adds nothing yet
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # partial-credit GenEval reward: a fraction of clauses per image
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    from PIL import Image

    grid = Image.open(run_dir / "samples" / "iter_0001.png")
    assert grid.width >= 8 * 32 * 4  # 8 seeds per row, upscaled 4x


def test_eval_reports_base_and_final_per_task_kind(run_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "eval", "--run-dir", str(run_dir), "--num-seeds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run_dir / "eval.json").read_text())
    from spotlight.tasks.shapes.world import TASKS

    for name in ("base", "final"):
        assert set(report[name]["per_task"]) == set(TASKS)
        assert 0.0 <= report[name]["overall"] <= 1.0
    assert report["num_prompts"] == 46 and report["num_seeds"] == 1
    assert (run_dir / "eval_grid.png").is_file()
    assert "overall" in proc.stdout


def test_held_out_evaluation_during_training(run_dir):
    """The base model and every version are evaluated on the same panel, recorded in
    eval.jsonl with a comparable grid each; best/ is kept. The last metrics row carries the
    final weights' evaluation (the coordinator joins it before writing that row); which earlier
    row carries an earlier result depends on when its process finishes, so that is not asserted."""
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert sorted((e["iteration"], e["version"]) for e in evals) == [(-1, 0), (0, 1), (1, 2)]
    for e in evals:
        assert 0.0 <= e["eval/score"] <= 1.0 and 0.0 <= e["eval/strict"] <= 1.0 and e["eval/num_images"] == 12
    for name in ("iter_0000", "iter_0001", "iter_0002"):
        assert (run_dir / "eval" / f"{name}.png").is_file() and (run_dir / "eval" / f"{name}.json").is_file()
    assert (run_dir / "eval" / "first_vs_last.png").is_file()
    last_row = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    final = next(e for e in evals if e["iteration"] == 1)
    assert last_row["eval/iteration"] == 2 and last_row["eval/score"] == final["eval/score"]
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert best["eval/score"] == max(e["eval/score"] for e in evals)
    assert set(_final_adapter(run_dir, "best")) == set(_final_adapter(run_dir))  # final/'s layout (an adapter)


def test_status_shows_the_finished_run(run_dir):
    """`spotlight status RUN_DIR` after the run: read from the status.json the coordinator saved,
    with the agents' joins, both iterations and the weights in its event log."""
    proc = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "status", "--json", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["finished"] and snap["iteration"] == 2 and snap["iterations_done"] == 2 and snap["eta_s"] == 0.0
    kinds = [e["kind"] for e in snap["events"]]
    assert (
        kinds.count("join") >= 2 and kinds.count("iteration") == 2 and "weights" in kinds and kinds[-1] == "finish"
    ), kinds
    assert [e["detail"].split(" ")[0] for e in snap["events"] if e["kind"] == "iteration"] == ["1/2", "2/2"]
    assert len(snap["reward_curve"]) == 2 and snap["cost"]["total_usd"] > 0


def test_cost_bills_the_trainers_gpus_for_the_whole_run(run_dir):
    """The reserved Train Workers' GPUs are billed from the coordinator's start
    to its end (status.json: elapsed_s), besides the rollout workers; rows carry the cost split,
    cost per 1,000 requests and requests per second."""
    from spotlight.config import load_config

    cfg = load_config(run_dir / "config.toml")
    snap = json.loads((run_dir / "status.json").read_text())
    # elapsed_s is rounded to 0.1 s: the run lasted at least elapsed_s - 0.05 s
    trainer_usd = cfg.train.num_train_workers * (snap["elapsed_s"] - 0.05) / 3600 * cfg.cost.reserved_usd_per_gpu_hour
    assert snap["cost"]["reserved_usd"] >= trainer_usd * (1 - 1e-9)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reqs = _requests(run_dir)
    done = sum(r["status"] == "done" for r in reqs)
    assert sum(r["requests/completed"] for r in rows) == done
    for r in rows:
        assert (
            r["cost/usd"]
            >= cfg.train.num_train_workers
            * sum(x["time/iteration_s"] for x in rows[: r["iteration"] + 1])
            / 3600
            * cfg.cost.reserved_usd_per_gpu_hour
        )
        assert r["cost/usd"] == pytest.approx(r["cost/spot_usd"] + r["cost/reserved_usd"])
        assert r["throughput/requests_per_s"] == pytest.approx(r["requests/completed"] / r["time/iteration_s"])
    assert rows[-1]["cost/usd_per_1k_requests"] == pytest.approx(1000 * rows[-1]["cost/usd"] / done)
