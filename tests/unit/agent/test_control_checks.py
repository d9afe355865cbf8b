"""`spotlight-agent revoke` / `add-gpu`: a request naming GPUs the node does not hold (or
already holds, or negative ids) is refused before anything changes."""

import pytest

from agent.main import control_gpus_error


def test_revoke_of_a_gpu_not_on_the_node_names_the_nodes_gpus():
    err = control_gpus_error("revoke", [7], [0, 1])
    assert err is not None and "[7]" in err and "[0, 1]" in err and "nothing revoked" in err


def test_revoke_of_a_held_gpu_is_accepted():
    assert control_gpus_error("revoke", [1], [0, 1]) is None


def test_add_of_a_gpu_already_present_is_refused():
    err = control_gpus_error("add", [1], [0, 1])
    assert err is not None and "already on this node" in err


def test_add_of_a_new_gpu_is_accepted():
    assert control_gpus_error("add", [2], [0, 1]) is None
    assert control_gpus_error("add", [1], [0]) is None


def test_negative_and_repeated_ids_are_refused():
    assert "0 or more" in control_gpus_error("add", [-1], [0])
    assert "0 or more" in control_gpus_error("revoke", [-1], [0])
    assert "repeated" in control_gpus_error("add", [2, 2], [0])
    assert control_gpus_error("revoke", [], [0]) == "no GPU given"


class _FakeSocket:
    def __init__(self, request: dict):
        import json

        self._request = json.dumps(request).encode()
        self.sent: list[dict] = []

    def recv(self) -> bytes:
        return self._request

    def send(self, data: bytes) -> None:
        import json

        self.sent.append(json.loads(data))


class _FakeAgent:
    """What AgentDaemon.on_control touches, recording whatever would change state."""

    def __init__(self, request: dict, gpus: list[int], visible_devices: str | None = None):
        self.control = _FakeSocket(request)
        self.gpus = list(gpus)
        self.visible_devices = visible_devices
        self.grace_s = 10.0
        self.notices: list = []
        self.added: list = []

    def on_notice(self, notice) -> None:  # would tell the coordinator and stop workers
        self.notices.append(notice)

    def add_gpus(self, gpus):  # would start workers
        self.added.append(gpus)
        return []


def test_on_control_refuses_a_revocation_of_an_absent_gpu_before_anything_happens():
    from agent.main import AgentDaemon

    fake = _FakeAgent({"cmd": "revoke", "gpus": [7], "grace_s": 1.0}, [0, 1])
    AgentDaemon.on_control(fake)
    (reply,) = fake.control.sent
    assert reply["ok"] is False and "[7]" in reply["error"] and "[0, 1]" in reply["error"]
    assert fake.notices == [] and fake.gpus == [0, 1]  # no notice: nothing logged as a revocation
    fake = _FakeAgent({"cmd": "revoke", "gpus": [1], "grace_s": 1.0}, [0, 1])
    AgentDaemon.on_control(fake)
    assert fake.control.sent[0]["ok"] is True and len(fake.notices) == 1


def test_on_control_refuses_adding_a_present_gpu():
    from agent.main import AgentDaemon

    fake = _FakeAgent({"cmd": "add", "gpus": [0]}, [0, 1])
    AgentDaemon.on_control(fake)
    assert fake.control.sent[0]["ok"] is False and fake.added == []
    fake = _FakeAgent({"cmd": "add", "gpus": [-1]}, [0])
    AgentDaemon.on_control(fake)
    assert fake.control.sent[0]["ok"] is False and fake.added == []
    fake = _FakeAgent({"cmd": "add", "gpus": [2]}, [0], visible_devices="4,5")  # the agent sees two GPUs
    AgentDaemon.on_control(fake)
    assert fake.control.sent[0]["ok"] is False and "outside" in fake.control.sent[0]["error"] and fake.added == []


def _cli(*args: str):
    from typer.testing import CliRunner

    from agent.main import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("cmd", [["agent-status"], ["add-gpu", "--gpu", "1"], ["revoke", "--gpu", "1"]])
def test_a_missing_state_dir_is_reported_not_created(tmp_path, cmd):
    """Was: agent-status / add-gpu --state-dir /tmp/none-such created the directory."""
    missing = tmp_path / "none-such"
    res = _cli(*cmd, "--node-id", "spot-0", "--state-dir", str(missing))
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"spotlight-agent: error: --state-dir {missing}: no such directory", res.output
    assert not missing.exists()
    missing.mkdir()
    res = _cli(*cmd, "--node-id", "spot-0", "--state-dir", str(missing))
    assert res.exit_code == 2 and "no agent 'spot-0'" in res.output, res.output
    assert list(missing.iterdir()) == []


@pytest.mark.parametrize("cmd", ["revoke", "add-gpu"])
def test_bad_gpu_ids_are_refused_before_contacting_the_agent(tmp_path, cmd, monkeypatch):
    import agent.main as m

    monkeypatch.setattr(m, "_control", lambda *a, **k: pytest.fail("contacted the agent"))
    for gpus, why in ((["-1"], "GPU ids are 0 or more, got [-1]"), (["2", "2"], "GPU ids repeated: [2, 2]")):
        res = _cli(cmd, *[a for g in gpus for a in ("--gpu", g)], "--node-id", "spot-0", "--state-dir", str(tmp_path))
        assert res.exit_code == 2, res.output
        assert res.output.strip() == f"spotlight-agent: error: --gpu: {why}", res.output


@pytest.mark.parametrize("cmd", ["revoke", "add-gpu"])
def test_a_refusal_is_an_error_line_and_a_success_is_json(tmp_path, cmd, monkeypatch):
    import json

    import agent.main as m

    monkeypatch.setattr(
        m, "_control", lambda *a, **k: {"ok": False, "error": "GPU(s) [7] not on this node", "gpus": [0]}
    )
    res = _cli(cmd, "--gpu", "7", "--node-id", "spot-0")
    assert res.exit_code == 1, res.output
    assert res.output.strip() == "spotlight-agent: error: GPU(s) [7] not on this node", res.output
    monkeypatch.setattr(m, "_control", lambda *a, **k: {"ok": True, "gpus": [0, 1]})
    res = _cli(cmd, "--gpu", "1", "--node-id", "spot-0")
    assert res.exit_code == 0 and json.loads(res.output) == {"ok": True, "gpus": [0, 1]}, res.output
