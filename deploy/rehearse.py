"""Rehearse a deployment recipe on this machine: its own commands, coordinator and agents on localhost.

    python deploy/rehearse.py slurm|skypilot|kubernetes [--work-dir DIR] [--preempt] [--iterations 2]

(``deploy/<recipe>/rehearse.sh`` calls it.) The recipe's commands run as the cluster would run
them, with only what a laptop lacks swapped in: ``$HOME`` is ``DIR/home`` (keys made there by the
recipe's own ``spotlight keys`` commands), the coordinator's port is a free loopback port instead
of 7400 (bound on 127.0.0.1, not 0.0.0.0), GPUs are CPU slots (one per agent), Slurm's ``srun`` is
a shim that runs its command once per task with Slurm's task variables (``scontrol`` one that
names the job's nodes; the reserved job spans two "nodes", both localhost, so its Train Workers
are two ranks of the multi-node entry point on a 2-D HSDP mesh), SkyPilot's ``setup`` is skipped
(this checkout's virtual environment is used) and each SkyPilot spot node polls its own mock cloud metadata server
(``spotlight/cloud/mock_metadata.py``). The run is the embedded default (the shapes task) for
``--iterations`` iterations.

``--preempt`` rehearses the loss and replacement of one spot node the recipe's way while the run's
Train Workers are held (SIGSTOP, so the run cannot end meanwhile): SkyPilot, a mock AWS spot
notice (the agent drains and exits, joining again exits 75, the job waits for its VM to go, the
rehearsal takes the VM away and launches the replacement job, which joins with a new node id);
Slurm, SIGTERM to the batch script (``--signal``) and the job requeued with the next
``SLURM_RESTART_COUNT``; Kubernetes, SIGTERM to the pod and a replacement pod of a new name. It
records that the coordinator, the other agents and the Train Workers kept running throughout.

Writes ``DIR/rehearsal.json`` (the run directory, processes, node ids, what happened) and exits 0
when the run finished with every iteration recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
SRUN_SHIM = r"""#!/bin/bash
# srun for the rehearsal: run the command once per task (--ntasks, or --nodes x --ntasks-per-node),
# each with the task variables Slurm gives it; the other options (all --name=value) are dropped
nodes=1 ntasks="" per_node=""
while [[ "$1" == -* ]]; do
  case "$1" in
    --nodes=*) nodes="${1#*=}" ;;
    --ntasks=*) ntasks="${1#*=}" ;;
    --ntasks-per-node=*) per_node="${1#*=}" ;;
  esac
  shift
done
ntasks=${ntasks:-$(( ${per_node:-1} * nodes ))}
per_node=${per_node:-$(( ntasks / nodes ))}
export SLURM_NTASKS=$ntasks SLURM_NNODES=$nodes SLURM_STEP_TASKS_PER_NODE="$per_node(x$nodes)"
if [ "$ntasks" -eq 1 ]; then
  SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 exec "$@"
fi
pids=()
for ((i = 0; i < ntasks; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % per_node)) SLURM_NODEID=$((i / per_node)) "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
SCONTROL_SHIM = r"""#!/bin/bash
# scontrol for the rehearsal: only `scontrol show hostnames LIST` (LIST comma-separated)
[ "$1 $2" = "show hostnames" ] || { echo "scontrol shim: only 'show hostnames'" >&2; exit 2; }
tr ',' '\n' <<< "$3"
"""
DEPLOY = REPO / "deploy"
WAIT_S = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, what: str, timeout_s: float = WAIT_S, alive=None):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if alive is not None and not alive():
            got = pred()
            if got:
                return got
            raise SystemExit(f"rehearsal: a process it needs exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"rehearsal: timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


class Rehearsal:
    def __init__(self, recipe: str, work: pathlib.Path, iterations: int, agents: int):
        self.recipe, self.work, self.iterations, self.agents = recipe, work, iterations, agents
        # a $HOME of the rehearsal's own, for the recipes' ~/.spotlight and the agents' default state
        # dir (work/home links to it; a deep path is fine: spotlight.net.ipc shortens socket paths)
        self.home = pathlib.Path(tempfile.mkdtemp(prefix="sl-home-"))
        (work / "home").unlink(missing_ok=True)
        (work / "home").symlink_to(self.home)
        self.port = _free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.mocks: dict[str, object] = {}
        self.facts: dict = {"recipe": recipe, "port": self.port, "nodes": [], "preempted": None}
        self.env = dict(os.environ, HOME=str(self.home), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.env["PATH"] = f"{work / 'bin'}:{pathlib.Path(sys.executable).parent}:{self.env.get('PATH', '')}"
        for name in ("CUDA_VISIBLE_DEVICES", "SPOTLIGHT_AGENT_STATE", "SPOTLIGHT_KEYS", "SPOTLIGHT_VENV"):
            self.env.pop(name, None)
        self.state = self.home / ".local" / "state" / "spotlight-agent"  # the agents' default state dir
        self.config = work / "run.toml"
        self.config.write_text(f"[run]\niterations = {iterations}\nsample_grid_every = 0\ntrackers = []\n")

    # ------------------------------------------------------------ processes
    def start(self, name: str, argv: list[str], env: dict | None = None, cwd: pathlib.Path = REPO):
        log = open(self.work / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            argv, cwd=cwd, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self.procs[name]

    def log(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_group(self, name: str, sig=signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill_group(name, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_group(name)
                proc.wait()
        for mock in self.mocks.values():
            mock.stop()

    def agent_status(self, node_id: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "agent.main", "agent-status", "--node-id", node_id, "--state-dir", str(self.state)],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def serving(self, node_id: str) -> bool:
        st = self.agent_status(node_id)
        return bool(st.get("workers")) and set(st["workers"].values()) == {"ready"}

    # ------------------------------------------------------------ keys, with the recipe's own commands
    def keys(self) -> None:
        keys = self.home / ".spotlight" / "keys"
        for argv in (
            ["init", str(keys)],
            ["add", str(keys), "reserved", "reserved-0"],
            ["add", str(keys), "trainer", "reserved"],  # Slurm's trainer ranks (deploy/slurm/reserved.sbatch)
            ["add", str(keys), "agent", "pool"],
        ):
            subprocess.run(["spotlight", "keys", *argv], env=self.env, check=True, capture_output=True)
        agent_keys = self.home / ".spotlight" / "agent-keys"
        agent_keys.mkdir(mode=0o700, exist_ok=True)
        for f in ("server.key", "agent.pool.key_secret"):
            shutil.copy2(keys / f, agent_keys / f)
        self.keys_dir, self.agent_keys_dir = keys, agent_keys

    def localize(self, text: str) -> str:
        """The coordinator's address on this machine: a free loopback port instead of 7400."""
        text = text.replace("0.0.0.0:7400", f"127.0.0.1:{self.port}").replace(":7400", f":{self.port}")
        return text.replace("spotlight-coordinator:", "127.0.0.1:")  # the Kubernetes Service's name

    # ------------------------------------------------------------ recipes
    def start_reserved(self) -> None:
        getattr(self, f"_reserved_{self.recipe}")()

    def start_agent(self, index: int, restart: int = 0) -> str:
        node_id = getattr(self, f"_agent_{self.recipe}")(index, restart)
        self.facts["nodes"].append(node_id)
        return node_id

    def _run_dir(self) -> pathlib.Path:
        return {
            "slurm": self.work / "run",
            "skypilot": self.home / "spotlight-run",
            "kubernetes": self.work / "run",
        }[self.recipe]

    # Slurm: the batch scripts themselves, with srun and scontrol shims; the reserved job spans 2
    # "nodes" (localhost twice), so its Train Workers are two ranks of the multi-node entry point
    SLURM_TRAIN_NODES = 2

    def _reserved_slurm(self) -> None:
        bin_dir = self.work / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name, text in (("srun", SRUN_SHIM), ("scontrol", SCONTROL_SHIM)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        nodes = self.SLURM_TRAIN_NODES
        with self.config.open("a") as f:  # nodes × TRAIN_GPUS_PER_NODE (1) ranks
            f.write(f"\n[train]\nnum_train_workers = {nodes}\nnum_train_nodes = {nodes}\n")
        trainer_port, master_port = _free_port(), _free_port()
        env = {"CONFIG": str(self.config), "RUN_DIR": str(self._run_dir()), "PORT": str(self.port)}
        env |= {"TRAINER_PORT": str(trainer_port), "MASTER_PORT": str(master_port), "BIND": "127.0.0.1"}
        env |= {"TRAIN_GPUS_PER_NODE": "1", "ROLLOUT_GPUS": "1", "ADDRESS_FILE": str(self.work / "coordinator-address")}
        env |= {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes)}
        env |= {"SLURM_JOB_ID": "999"}
        self.facts["trainer_ranks"] = nodes
        self.start("reserved", ["bash", str(DEPLOY / "slurm" / "reserved.sbatch")], env)

    def _agent_slurm(self, index: int, restart: int) -> str:
        env = {"ADDRESS_FILE": str(self.work / "coordinator-address"), "SLURM_GPUS_ON_NODE": "1"}
        env |= {"SLURM_JOB_ID": "1000", "SLURM_ARRAY_TASK_ID": str(index), "SLURM_RESTART_COUNT": str(restart)}
        _wait(lambda: (self.work / "coordinator-address").exists(), "the coordinator's address file")
        self.start(f"agent-{index}", ["bash", str(DEPLOY / "slurm" / "agents.sbatch")], env)
        return f"spot-1000-{index}-r{restart}"

    # SkyPilot: the tasks' run sections with their envs (setup skipped: this venv is used)
    def _sky_task(self, name: str) -> dict:
        return yaml.safe_load((DEPLOY / "skypilot" / name).read_text())

    def _reserved_skypilot(self) -> None:
        task = self._sky_task("reserved.yaml")
        (self.home / ".spotlight").mkdir(exist_ok=True)
        env = {k: str(v) for k, v in task["envs"].items()} | {"CONFIG": str(self.config)}
        self.start("reserved", ["bash", "-c", self.localize(task["run"])], env)

    def _agent_skypilot(self, index: int, restart: int) -> str:
        from spotlight.cloud.mock_metadata import MockMetadataServer

        task = self._sky_task("agents.yaml")
        node_id = f"spot-vm{index}" + (f"r{restart}" if restart else "")  # a new VM: a new hostname, a new node id
        mock = self.mocks[node_id] = MockMetadataServer("aws").start()
        env = {k: str(v) for k, v in task["envs"].items()}
        env |= {"COORDINATOR": f"127.0.0.1:{self.port}", "METADATA_URL": mock.url, "SPOTLIGHT_NODE_ID": node_id}
        env |= {"SKYPILOT_NUM_GPUS_PER_NODE": "1", "REJOIN_WAIT_S": "1", "GRACE_S": "20"}
        self.start(f"agent-{index}", ["bash", "-c", task["run"]], env)
        return node_id

    # Kubernetes: the containers' args, with the Secret and ConfigMap volumes laid out as files
    def _k8s(self, name: str) -> list[dict]:
        return list(yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()))

    def _k8s_paths(self, argv: list[str], pod: dict, container: dict) -> list[str]:
        keys = self.work / f"k8s-{container['name']}-keys"
        vols = {v["name"]: v for v in pod["volumes"]}
        paths = {}
        for m in container.get("volumeMounts", []):
            vol = vols[m["name"]]
            if "secret" in vol:  # the Secret's files, as `kubectl create secret --from-file` took them
                keys.mkdir(mode=0o700, exist_ok=True)
                default = [{"key": k, "path": k} for k in ("server.key", "agent.pool.key_secret")]
                for item in vol["secret"].get("items") or default:
                    origin = self.keys_dir / item["key"]
                    if not origin.exists():
                        origin = self.keys_dir / "clients" / item["key"]
                    (keys / item["path"]).parent.mkdir(exist_ok=True)
                    shutil.copy2(origin, keys / item["path"])
                paths[m["mountPath"]] = str(keys)
            elif "configMap" in vol or "persistentVolumeClaim" in vol:  # run.toml; the run directory
                paths[m["mountPath"]] = str(self.work)
        out = []
        for a in argv:
            for mount, local in paths.items():
                a = local if a == mount else a.replace(mount + "/", local + "/")
            out.append(self.localize(a))
        if "--gpus" in out:  # one CPU slot per agent here
            out[out.index("--gpus") + 1] = "0"
        return out

    def _reserved_kubernetes(self) -> None:
        docs = self._k8s("coordinator.yaml")
        pod = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
        for c in pod["containers"]:
            self.start(c["name"], self._k8s_paths(c["args"], pod, c))

    def _agent_kubernetes(self, index: int, restart: int) -> str:
        pod = self._k8s("agents.yaml")[0]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        name = f"spotlight-agent-{index}x{restart}"  # a replacement pod has a new name
        argv = [re.sub(r"\$\(POD_NAME\)", name, a) for a in self._k8s_paths(c["args"], pod, c)]
        self.start(f"agent-{index}", argv, {"POD_NAME": name})
        return name

    # ------------------------------------------------------------ the run
    def coordinator(self) -> subprocess.Popen:
        return self.procs["coordinator" if self.recipe == "kubernetes" else "reserved"]

    def trainers(self) -> list[int]:
        import psutil

        out = []
        for p in psutil.Process(self.coordinator().pid).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                if "spotlight.workers.train.train_worker" in cmd or "spotlight.workers.train.launch" in cmd:
                    out.append(p.pid)
            except psutil.Error:
                pass
        return out

    KEY = {  # first match wins: a worker's command line names its agent's socket directory
        "rollout.worker": "worker",
        "train_worker": "trainer",
        "spotlight.workers.train.launch": "trainer",
        "spotlight up": "coordinator",
        "agent.main": "agent",
        "spotlight-agent": "agent",
    }

    def key_processes_except(self, victim: str) -> dict[int, str]:
        """The coordinator, Train Worker, agent and Rollout Worker processes (pid: what) of every
        started process but ``victim``."""
        import psutil

        out = {}
        for name, proc in self.procs.items():
            if name == victim:
                continue
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    cmd = " ".join(p.cmdline())
                    what = next((w for k, w in self.KEY.items() if k in cmd), None)
                    if what and p.status() != psutil.STATUS_ZOMBIE:
                        out[p.pid] = what
            except psutil.Error:
                pass
        return out

    def preempt(self, index: int) -> None:
        """Take spot node ``index`` away the recipe's way and start its replacement."""

        victim = self.facts["nodes"][index]
        rd = self._run_dir()
        _wait(lambda: (rd / "tensor_store" / "weights" / "v0.safetensors").exists(), "weights v0")
        _wait(lambda: all(self.serving(n) for n in self.facts["nodes"]), "every spot agent to serve")
        trainers = _wait(self.trainers, "the Train Workers")
        for pid in trainers:
            os.kill(pid, signal.SIGSTOP)  # hold the run: it cannot end while the node is swapped
        others = self.key_processes_except(f"agent-{index}")
        try:
            if self.recipe == "skypilot":
                from spotlight.cloud.mock_metadata import control

                control(self.mocks[victim].control_url, "notice", lead_time_s=30)
                log = f"agent-{index}"
                _wait(lambda: "waiting for it to go" in self.log(log), "the preempted job to wait for its VM")
                self.kill_group(log)  # the cloud reclaims the VM
            else:  # Slurm's --signal / the kubelet: SIGTERM to the batch script or the pod's process
                self.procs[f"agent-{index}"].send_signal(signal.SIGTERM)
            rc = self.procs[f"agent-{index}"].wait(120)
            self.facts["preempted"] = {"node": victim, "exit": rc}
            self.procs.pop(f"agent-{index}")
            new = self.start_agent(index, restart=1)
            _wait(lambda: self.serving(new), f"the replacement {new} to serve")
            self.facts["preempted"]["replacement"] = new
            now = self.key_processes_except(f"agent-{index}")
            gone = {pid: what for pid, what in others.items() if pid not in now}
            self.facts["kept_running"] = {"processes": others, "gone": gone, "all_alive": not gone and bool(others)}
        finally:
            for pid in trainers:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def run(self, preempt: bool) -> int:
        self.keys()
        self.start_reserved()
        for i in range(self.agents):
            self.start_agent(i)
        if preempt:
            self.preempt(0)
        coord = self.coordinator()
        rc = coord.wait(WAIT_S)
        rd = self._run_dir()
        self.facts |= {"run_dir": str(rd), "coordinator_exit": rc, "work_dir": str(self.work)}
        metrics = rd / "metrics.jsonl"
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        self.facts["iterations_done"] = len(rows)
        ok = rc == 0 and len(rows) == self.iterations
        if preempt:
            ok = ok and bool(self.facts.get("kept_running", {}).get("all_alive"))
        self.facts["ok"] = ok
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", choices=["slurm", "skypilot", "kubernetes"])
    ap.add_argument("--work-dir", type=pathlib.Path, default=None, help="default: a new temporary directory")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--agents", type=int, default=2, help="spot agents (one CPU slot each)")
    ap.add_argument("--preempt", action="store_true", help="take one spot node away mid-run and replace it")
    args = ap.parse_args(argv)
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix=f"spotlight-rehearse-{args.recipe}-"))
    work.mkdir(parents=True, exist_ok=True)
    r = Rehearsal(args.recipe, work.resolve(), args.iterations, args.agents)
    print(f"rehearsing deploy/{args.recipe} in {work} (logs: {work}/*.log)", flush=True)
    try:
        rc = r.run(args.preempt)
    finally:
        r.stop_all()
        (work / "rehearsal.json").write_text(json.dumps(r.facts, indent=2))
    print(json.dumps(r.facts, indent=2))
    print(f"rehearsal of deploy/{args.recipe}: {'ok' if rc == 0 else 'FAILED'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
