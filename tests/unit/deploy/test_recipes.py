"""The deployment recipes (deploy/): SkyPilot tasks, Kubernetes manifests and Slurm batch scripts
check out offline, with the fields Spotlight relies on.

Kubernetes manifests go through the kubernetes client's typed models (unknown fields, wrong types
and missing required fields fail; the round trip must give the manifest back, so a misspelt field
cannot be dropped silently). SkyPilot tasks go through SkyPilot's own loader (run from ``.venv-sky``, which
``./scripts/test`` creates: skypilot's click pin conflicts with huggingface-hub's, so it cannot join
the test extra; no cloud credentials needed), and always through the structural checks here.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from agent.main import SHUTDOWN_BOUND_S
from tests.unit.deploy.recipes import DEPLOY, manifest_commands, shell_commands

PORT = 7400


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# ---------------------------------------------------------------- Kubernetes
def _deserialize(doc: dict):
    from kubernetes import client

    api = client.ApiClient()
    kind = "V1" + doc["kind"]
    try:  # kubernetes >= 35: (text, type, content type)
        obj = api.deserialize(json.dumps(doc), kind, "application/json")
    except TypeError:  # older: a response object with .data

        class _Response:
            data = json.dumps(doc)

        obj = api.deserialize(_Response(), kind)
    return api.sanitize_for_serialization(obj)


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()))


@pytest.mark.parametrize("name", ["coordinator.yaml", "agents.yaml"])
def test_kubernetes_manifests_are_valid_objects(name):
    pytest.importorskip("kubernetes")
    for doc in _docs(name):
        assert _deserialize(doc) == doc, f"{name}: {doc['kind']} has fields the API does not know"


def test_kubernetes_model_check_is_not_vacuous():
    pytest.importorskip("kubernetes")
    doc = _docs("agents.yaml")[0]
    doc["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30  # misspelt
    assert _deserialize(doc) != doc
    del doc["spec"]["selector"]  # required
    with pytest.raises(Exception):
        _deserialize(doc)


def _pod(docs: list[dict], kind: str) -> dict:
    (obj,) = [d for d in docs if d["kind"] == kind]
    return obj["spec"]["template"]["spec"]


def test_kubernetes_coordinator_keeps_its_run_directory_and_opens_its_port():
    docs = _docs("coordinator.yaml")
    pod = _pod(docs, "StatefulSet")
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    up = next(c for c in pod["containers"] if c["args"][:2] == ["spotlight", "up"])
    assert "--resume-existing" in up["args"] and _opt(up["args"], "--reserved") == f"0.0.0.0:{PORT}"
    run_dir = _opt(up["args"], "--run-dir")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in up["volumeMounts"]}
    run_mount = next(p for p in mounts if run_dir.startswith(p + "/"))
    assert volumes[mounts[run_mount]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [PORT]
    assert up["ports"][0]["containerPort"] == PORT
    assert int(up["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    keys = _opt(up["args"], "--keys")
    assert "secret" in volumes[mounts[keys]]
    agent = next(c for c in pod["containers"] if c["args"][:2] == ["spotlight-agent", "join"])
    assert len(_opt(agent["args"], "--gpus").split(",")) == int(agent["resources"]["limits"]["nvidia.com/gpu"])


def test_kubernetes_agents_drain_within_the_pod_grace_period():
    docs = _docs("agents.yaml")
    pod = _pod(docs, "Deployment")
    (argv,) = manifest_commands(docs)
    (c,) = pod["containers"]
    grace_s = float(_opt(argv, "--grace-s"))
    assert pod["terminationGracePeriodSeconds"] >= grace_s + SHUTDOWN_BOUND_S
    assert len(_opt(argv, "--gpus").split(",")) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert _opt(argv, "--coordinator") == f"spotlight-coordinator:{PORT}"  # the Service
    assert _opt(argv, "--node-id") == "0"  # $(POD_NAME): a replacement pod is a new node
    assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    volumes = {v["name"]: v for v in pod["volumes"]}
    keys = next(m for m in c["volumeMounts"] if m["mountPath"] == _opt(argv, "--keys"))
    assert "secret" in volumes[keys["name"]] and keys["readOnly"]
    assert pod["securityContext"]["runAsNonRoot"] is True


# ---------------------------------------------------------------- SkyPilot
def _task(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "skypilot" / name).read_text())


def _sky_python() -> str | None:
    """An interpreter with SkyPilot: ``$SPOTLIGHT_SKY_PYTHON`` (``./scripts/test`` sets it to
    ``.venv-sky``'s, scripts/_sky_venv.sh), else this one when it imports ``sky``, else None."""
    import importlib.util
    import os
    import sys

    if os.environ.get("SPOTLIGHT_SKY_PYTHON"):
        return os.environ["SPOTLIGHT_SKY_PYTHON"]
    return sys.executable if importlib.util.find_spec("sky") else None


@pytest.mark.procs
def test_skypilot_tasks_load_with_skypilots_own_loader():
    """``sky.Task.from_yaml`` (SkyPilot's schema validation and parsing, no cloud) accepts both
    tasks, with their setup, run and resources (the port, the spot choice). SkyPilot lives in a
    venv of its own (its click pin conflicts with huggingface-hub's), run as a subprocess."""
    import subprocess

    python = _sky_python()
    if python is None:
        pytest.skip("no SkyPilot: ./scripts/test creates .venv-sky for it (scripts/_sky_venv.sh)")
    script = (
        "import json, sys, sky\n"
        "out = {}\n"
        "for path in sys.argv[1:]:\n"
        "    t = sky.Task.from_yaml(path)\n"
        "    (r,) = t.resources\n"
        "    out[path] = {'run': bool(t.run), 'setup': bool(t.setup), 'ports': r.ports, 'spot': r.use_spot}\n"
        "print(json.dumps(out))\n"
    )
    paths = [str(DEPLOY / "skypilot" / name) for name in ("reserved.yaml", "agents.yaml")]
    proc = subprocess.run([python, "-c", script, *paths], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    reserved, agents = (got[p] for p in paths)
    assert all(t["run"] and t["setup"] for t in (reserved, agents))
    assert reserved["ports"] == [str(PORT)] and reserved["spot"] is False and agents["spot"] is True


def test_skypilot_reserved_opens_the_port_and_mounts_the_keys():
    t = _task("reserved.yaml")
    assert str(t["resources"]["ports"]) == str(PORT) and t["resources"]["use_spot"] is False
    cmds = shell_commands(t["run"], t["envs"])
    (up,) = [a for a in cmds if a[:2] == ["spotlight", "up"]]
    assert _opt(up, "--reserved") == f"0.0.0.0:{PORT}" and "--resume-existing" in up
    assert _opt(up, "--keys") in t["file_mounts"]


def test_skypilot_agents_are_a_spot_job_that_rejoins_and_waits_out_a_preempted_vm():
    t = _task("agents.yaml")
    assert t["resources"]["use_spot"] is True and t["resources"]["job_recovery"]["strategy"]
    (join,) = shell_commands(t["run"], t["envs"])
    assert join[:2] == ["spotlight-agent", "join"] and _opt(join, "--keys") in t["file_mounts"]
    assert _opt(join, "--cloud") in ("aws", "gcp", "azure")
    # exit 75 (the VM has an active notice) waits for the VM to go, so SkyPilot recovers the job
    assert re.search(r"75\)[^;]*;\s*sleep infinity", t["run"])


# ---------------------------------------------------------------- Slurm
def _directives(name: str) -> dict[str, str]:
    out = {}
    for line in (DEPLOY / "slurm" / name).read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH ") :].partition("=")
            out[key.strip()] = value.strip()
    return out


def test_slurm_agents_get_sigterm_in_time_and_are_requeued():
    d = _directives("agents.sbatch")
    text = (DEPLOY / "slurm" / "agents.sbatch").read_text()
    m = re.fullmatch(r"B:TERM@(\d+)", d["--signal"])
    assert m, d["--signal"]  # B: the batch shell, which is the agent (exec): not its workers
    grace_s = float(re.search(r"GRACE_S=\$\{GRACE_S:-(\d+)\}", text).group(1))
    assert int(m.group(1)) >= grace_s + SHUTDOWN_BOUND_S
    assert "--requeue" in d and d["--partition"] and d["--gres"].startswith("gpu:")
    (join,) = shell_commands(text)
    assert re.search(r"^exec spotlight-agent join", text, re.M)


def test_slurm_reserved_runs_the_coordinator_and_trainer_ranks_across_nodes_under_srun():
    """The coordinator waits for external trainers; the trainer step spans every node of the job,
    one rank per GPU, with the multi-node entry point, connecting to the coordinator's trainer port
    with a trainer key; the env:// rendezvous is exported on the first node."""
    text = (DEPLOY / "slurm" / "reserved.sbatch").read_text()
    d = _directives("reserved.sbatch")
    assert "--requeue" not in d and d["--gres"].startswith("gpu:") and int(d["--nodes"]) >= 2
    (up,) = [a for a in shell_commands(text) if a[:2] == ["spotlight", "up"]]
    assert "--external-trainers" in up and "--trainer-port" in up and "--resume-existing" in up
    (trainers,) = re.findall(r"^srun (.*) python -m spotlight\.workers\.train\.launch (.*) &$", text, re.M)
    srun_opts, launch_args = trainers
    assert '--nodes="$TRAIN_NODES"' in srun_opts and '--ntasks-per-node="$TRAIN_GPUS_PER_NODE"' in srun_opts
    assert '--gres=gpu:"$TRAIN_GPUS_PER_NODE"' in srun_opts
    assert '--coordinator "$HEAD:$TRAINER_PORT"' in launch_args and "--keys" in launch_args
    assert re.search(r"^export MASTER_ADDR=\$HEAD MASTER_PORT=", text, re.M)
    assert re.search(r"^srun .* spotlight-agent join ", text, re.M)
