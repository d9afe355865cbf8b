"""The systemd units in scripts/systemd/ run unprivileged and hardened, and the agent's stop
time fits its TimeoutStopSec."""

from __future__ import annotations

import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

from agent.main import EXIT_NODE_ID_IN_USE, EXIT_NODE_PREEMPTED, SHUTDOWN_BOUND_S

UNITS = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "systemd"
COORD_EXEC = (
    "/opt/spotlight/.venv/bin/spotlight up --config /etc/spotlight/run.toml --reserved 0.0.0.0:7400 "
    "--keys /etc/spotlight/keys --run-dir /var/lib/spotlight/run --resume-existing"
)


def parse_unit(path: pathlib.Path) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}``; comments dropped, repeated keys kept (systemd
    semantics: an empty assignment resets the list)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        values = section.setdefault(key.strip(), [])
        if value.strip() == "":
            values.clear()
        values.append(value.strip())
    return out


def one(svc: dict, key: str) -> str:
    assert key in svc, f"{key}= missing"
    return svc[key][-1]


@pytest.mark.parametrize("name", ["spotlight-agent.service", "spotlight-coordinator.service"])
def test_unit_is_unprivileged_and_hardened(name):
    svc = parse_unit(UNITS / name)["Service"]
    assert one(svc, "User") == "spotlight" and one(svc, "Group") == "spotlight"
    assert svc.get("DynamicUser", ["no"])[-1] == "no"
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "RestrictNamespaces",
        "LockPersonality",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "RestrictSUIDSGID",
        "RestrictRealtime",
    ):
        assert one(svc, key) == "yes", key
    assert one(svc, "ProtectSystem") == "strict"
    state = "/var/lib/spotlight-agent" if "agent" in name else "/var/lib/spotlight"
    assert state in one(svc, "ReadWritePaths").split()
    assert set(one(svc, "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert "@system-service" in svc["SystemCallFilter"]
    assert one(svc, "CapabilityBoundingSet") == "" and len(svc["CapabilityBoundingSet"]) == 1
    assert svc.get("PrivateDevices", ["no"])[-1] == "no"  # GPUs: DeviceAllow instead
    assert one(svc, "DevicePolicy") == "closed" and "/dev/nvidiactl rw" in svc["DeviceAllow"]
    assert one(svc, "MemoryDenyWriteExecute") == "no"  # torch JIT/Triton/CUDA need W+X (commented)
    assert "EnvironmentFile" not in svc and "SPOTLIGHT_SECRET" not in (UNITS / name).read_text().split("[Service]")[1]
    assert "--keys /etc/spotlight/keys" in one(svc, "ExecStart")


def test_agent_stop_time_fits_timeout_and_preempted_exit_is_not_restarted():
    svc = parse_unit(UNITS / "spotlight-agent.service")["Service"]
    argv = shlex.split(one(svc, "ExecStart"))
    grace = float(argv[argv.index("--grace-s") + 1])
    timeout = float(one(svc, "TimeoutStopSec"))
    assert grace + SHUTDOWN_BOUND_S < timeout <= 30  # GCP: 30 s from soft-off to hard-off
    assert str(EXIT_NODE_PREEMPTED) in one(svc, "RestartPreventExitStatus").split()
    assert (
        str(EXIT_NODE_ID_IN_USE) in one(svc, "RestartPreventExitStatus").split()
    )  # a second agent with a node id in use
    assert one(svc, "Restart") == "always" and one(svc, "KillMode") == "mixed"


def test_coordinator_resumes_its_run_dir():
    svc = parse_unit(UNITS / "spotlight-coordinator.service")["Service"]
    assert one(svc, "ExecStart") == COORD_EXEC
    assert one(svc, "Restart") == "on-failure"


@pytest.mark.procs
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["spotlight-agent.service", "spotlight-coordinator.service"])
def test_systemd_analyze_exposure_at_most_4(name):
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(UNITS / name)], capture_output=True, text=True, timeout=60
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    if m is None and "--offline" in out.stderr:
        pytest.skip("this systemd-analyze has no --offline")
    assert m is not None, out.stdout[-500:] + out.stderr[-500:]
    assert float(m.group(1)) <= 4.0
