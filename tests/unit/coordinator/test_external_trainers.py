"""Train Worker ranks launched by torchrun or srun (``spotlight up --external-trainers``), seen from
the coordinator: the TRAIN_HELLO → TRAIN_SETUP handshake, billing per host, waiting with a timeout,
heartbeats; and over real CurveZMQ sockets, that only an allow-listed trainer key is served."""

from __future__ import annotations

import pathlib
import threading

import pytest
import zmq

from spotlight import protocol as P
from spotlight.config import config_from_dict, dump_config
from spotlight.coordinator.control_plane import ControlPlane
from spotlight.coordinator.server import TRAINER, ControlServer, Rejected
from spotlight.coordinator.trainer_group import ExternalTrainers, LostRank, TrainerGroup
from spotlight.core.events import EventLog
from spotlight.core.instance_manager import InstanceManager
from spotlight.core.request_scheduler import RequestScheduler
from spotlight.net.security import add_client, apply_client, load_client_keys, load_server_keys
from spotlight.store.tensor_store import TensorStore
from spotlight.workers.train.launch import CoordinatorLink, Refused, handshake
from tests.factories import example_config, make_keys

WORLD = 4


class FakeServer:
    """Records what the group sends, per routing id."""

    trainer_endpoint = "tcp://0.0.0.0:7401"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send(self, channel, identity, msg, frames=None):
        assert channel == TRAINER
        self.sent.append((identity, msg))
        return True


def _group(tmp_path: pathlib.Path, **external) -> tuple[TrainerGroup, InstanceManager, list[str]]:
    cfg = example_config("jpeg-toy", {"train.num_train_workers": WORLD, "train.num_train_nodes": 2})
    dump_config(cfg, tmp_path / "config.toml")
    instances, said = InstanceManager(10.0), []
    group = TrainerGroup(
        cfg,
        tmp_path,
        TensorStore(tmp_path / "tensor_store"),
        EventLog(),
        phase=lambda: "starting",
        iteration=lambda: 0,
        external=ExternalTrainers("tcp://0.0.0.0:7401", **({"timeout_s": 100.0} | external)),
        instances=instances,
        say=said.append,
    )
    group.start(FakeServer(), keys=None, now=0.0)
    return group, instances, said


def hello(rank: int, *, host: str = "", gpu: int = -1, **kw) -> P.TrainHello:
    fields = dict(protocol_version=P.PROTOCOL_VERSION, rank=rank, world_size=WORLD, local_rank=rank % 2)
    fields |= dict(local_world_size=2, num_nodes=2, host=host or f"node-{rank // 2}", gpu=gpu)
    return P.TrainHello(**(fields | kw))


def _connect_all(group: TrainerGroup, now: float = 1.0) -> None:
    for r in range(WORLD):
        group.handle(b"id%d" % r, P.MsgType.TRAIN_HELLO, hello(r, gpu=r % 2), [], now)
    for r in range(WORLD):
        group.handle(b"id%d" % r, P.MsgType.TRAIN_READY, P.TrainReady(rank=r, world_size=WORLD, version=0), [], now)


def test_hello_is_answered_with_the_runs_setup_and_the_rank_is_billed_on_its_host(tmp_path):
    group, instances, said = _group(tmp_path)
    group.resume_version = 5
    group.handle(b"a", P.MsgType.TRAIN_HELLO, hello(2, gpu=6), [], 1.0)
    ((ident, setup),) = group.server.sent
    assert ident == b"a" and isinstance(setup, P.TrainSetup)
    assert config_from_dict(__import__("tomllib").loads(setup.config_toml)).train.num_train_workers == WORLD
    assert setup.resume_version == 5 and setup.checkpoint_dir.endswith("checkpoints/train") and setup.session
    assert instances.gpu_counts()["train"] == 1 and instances.billed_gpus()[False] == 1
    assert "train worker rank 2 on node-1 connected (1 of 4)" in said[-1]
    for r in (0, 1, 3):
        group.handle(b"id%d" % r, P.MsgType.TRAIN_HELLO, hello(r, gpu=r % 2), [], 1.0)
    # node-0: GPUs 0 and 1; node-1: GPUs 1 (rank 3) and 6 (rank 2): billed per host, 4 in all
    assert instances.gpu_counts()["train"] == 4
    assert said[-1].startswith("all 4 train worker ranks connected (2 × 2 ranks, 2 hosts)")
    group.release_holds(2.0)
    assert instances.gpu_counts()["train"] == 0


def test_a_gpu_shared_with_a_reserved_agent_on_the_same_host_is_billed_once(tmp_path):
    group, instances, _ = _group(tmp_path)
    group.handle(b"a", P.MsgType.TRAIN_HELLO, hello(0, host="head", gpu=0), [], 1.0)
    instances.register("reserved-0", "s", [0, 1], False, 1.0, host="head")
    assert instances.billed_gpus()[False] == 2


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (hello(0, world_size=8), "bad_request", "this run has 4 train workers"),
        (hello(4, world_size=4), "bad_request", "this run has 4 train workers"),
        (hello(1, num_nodes=3), "bad_request", "3 nodes × 2 ranks per node is not 4 ranks"),
        # one node of 4: each GPU would hold half the share the memory plan of 2 nodes × 2 counted
        (hello(1, num_nodes=1, local_world_size=4, local_rank=1), "bad_request", "set it to 1 in the run config"),
        (hello(1, protocol_version=P.PROTOCOL_VERSION + 1), "protocol", "same Spotlight version"),
    ],
)
def test_a_rank_that_does_not_fit_the_run_is_refused_and_changes_nothing(tmp_path, body, code, words):
    group, instances, _ = _group(tmp_path)
    with pytest.raises(Rejected, match=words) as info:
        group.handle(b"a", P.MsgType.TRAIN_HELLO, body, [], 1.0)
    assert info.value.code == code
    assert not group.hellos and not group.ids and instances.gpu_counts()["train"] == 0 and not group.server.sent


def test_a_second_launcher_of_the_same_rank_and_ready_before_hello_are_refused(tmp_path):
    group, _, _ = _group(tmp_path)
    group.handle(b"a", P.MsgType.TRAIN_HELLO, hello(1), [], 1.0)
    with pytest.raises(Rejected, match="already connected"):
        group.handle(b"b", P.MsgType.TRAIN_HELLO, hello(1), [], 1.0)
    with pytest.raises(Rejected, match="before its TRAIN_HELLO"):
        group.handle(b"c", P.MsgType.TRAIN_READY, P.TrainReady(rank=2, world_size=WORLD, version=0), [], 1.0)
    with pytest.raises(Rejected, match="sent no TRAIN_READY"):  # said hello, not ready: cannot publish yet
        group.handle(b"a", P.MsgType.TRAIN_DONE, P.TrainDone(rank=1, iteration=0, new_version=1), [], 1.0)


def test_a_coordinator_that_starts_its_own_trainers_refuses_hello(tmp_path):
    cfg = example_config("jpeg-toy")
    group = TrainerGroup(cfg, tmp_path, TensorStore(tmp_path / "ts"), EventLog(), phase=str, iteration=int)
    with pytest.raises(Rejected, match="--external-trainers") as info:
        group.handle(b"a", P.MsgType.TRAIN_HELLO, hello(0, world_size=1, num_nodes=1, local_world_size=1), [], 0.0)
    assert info.value.code == "forbidden"


def test_waiting_says_who_is_missing_and_times_out_with_a_clear_error(tmp_path):
    group, _, said = _group(tmp_path, timeout_s=100.0)
    group.handle(b"a", P.MsgType.TRAIN_HELLO, hello(0), [], 1.0)
    group.housekeeping(30.0)
    assert len(said) == 1  # no reminder yet
    group.housekeeping(61.0)
    assert said[-1] == "still waiting for train worker ranks 1, 2, 3 (1 of 4 connected, 61 s of 100 s)"
    beat = P.TrainHeartbeat(rank=0, session=group.sessions[0])
    group.handle(b"hb", P.MsgType.TRAIN_HEARTBEAT, beat, [], 50.0)
    assert group.failed(99.0) is None
    lost = group.failed(101.0)
    assert isinstance(lost, LostRank)
    assert "1 of 4 train worker ranks connected within 100 s (missing: ranks 1, 2, 3)" in lost.summary
    assert f"--coordinator {__import__('socket').gethostname()}:7401" in lost.summary


def test_heartbeats_keep_ranks_alive_and_a_silent_one_stops_a_complete_group(tmp_path):
    group, _, said = _group(tmp_path)
    _connect_all(group)
    assert group.complete and group.all_ready
    sessions = dict(group.sessions)
    with pytest.raises(Rejected, match="another session"):
        group.handle(b"hb", P.MsgType.TRAIN_HEARTBEAT, P.TrainHeartbeat(rank=0, session=sessions[1]), [], 30.0)
    for r in (0, 1, 3):  # rank 2 falls silent
        group.handle(b"hb%d" % r, P.MsgType.TRAIN_HEARTBEAT, P.TrainHeartbeat(rank=r, session=sessions[r]), [], 40.0)
    assert group.failed(60.0) is None
    lost = group.failed(62.0)
    assert isinstance(lost, LostRank) and lost.summary.startswith("train worker rank 2 on node-1 sent no heartbeat")
    assert lost.report() == lost.summary


def test_a_rank_silent_before_the_group_is_complete_is_forgotten_and_may_come_back(tmp_path):
    group, instances, said = _group(tmp_path)
    group.handle(b"a", P.MsgType.TRAIN_HELLO, hello(1, gpu=1), [], 1.0)
    assert instances.gpu_counts()["train"] == 1
    assert group.failed(62.0) is None  # silent for 61 s: forgotten, not a failure
    assert 1 not in group.hellos and instances.gpu_counts()["train"] == 0
    assert "went silent before every rank was ready" in said[-1]
    group.handle(b"b", P.MsgType.TRAIN_HELLO, hello(1, gpu=1), [], 63.0)  # torchrun restarted it
    assert group.ids[1] == b"b"


def test_ranks_leaving_after_shutdown_are_expected(tmp_path):
    group, _, _ = _group(tmp_path)
    _connect_all(group)
    group.shutdown("run finished")
    assert group.failed(1000.0) is None


# ---------------------------------------------------------------- over CurveZMQ


@pytest.fixture
def served(tmp_path):
    """A control plane with external trainers on a real CURVE trainer socket, served on a thread."""
    keys_dir = make_keys(tmp_path / "keys", agents=["spot"])
    add_client(keys_dir, "trainer", "pool")
    cfg = example_config("jpeg-toy", {"train.num_train_workers": 2, "train.num_train_nodes": 2})
    dump_config(cfg, tmp_path / "config.toml")
    keys = load_server_keys(keys_dir)
    parts = (RequestScheduler(60.0), InstanceManager(10.0), TensorStore(tmp_path / "ts"), EventLog())
    group = TrainerGroup(
        cfg,
        tmp_path,
        parts[2],
        parts[3],
        phase=lambda: "starting",
        iteration=lambda: 0,
        external=ExternalTrainers("tcp://127.0.0.1:0"),
        instances=parts[1],
    )
    server = ControlServer("tcp://127.0.0.1:0", keys, trainer_bind="tcp://127.0.0.1:0")
    control = ControlPlane(cfg, *parts, run=None, workers=None, keys=keys, trainers=group)
    control.attach(server)
    group.start(server, keys, now=0.0)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            control.serve_once(20)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield keys_dir, server.trainer_endpoint, group
    stop.set()
    thread.join(10)
    server.close(linger_ms=0)


def _dealer(ctx, endpoint: str, keys) -> tuple[zmq.Socket, CoordinatorLink]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    apply_client(sock, keys)
    link = CoordinatorLink(sock, 60.0)
    sock.connect(endpoint)
    return sock, link


def test_only_an_allow_listed_trainer_key_gets_a_setup(served):
    keys_dir, endpoint, group = served
    ctx = zmq.Context()
    socks = []
    try:
        trainer = load_client_keys(keys_dir, role="trainer")
        sock, link = _dealer(ctx, endpoint, trainer)
        socks += [sock, link.monitor]
        body = hello(0, world_size=2, num_nodes=2, local_world_size=1, local_rank=0)
        setup = handshake(sock, link, body, 60.0, endpoint)
        assert isinstance(setup, P.TrainSetup) and group.hellos[0].host == "node-0"

        agent = load_client_keys(keys_dir, role="agent")  # allow-listed, but not a trainer
        sock, link = _dealer(ctx, endpoint, agent)
        socks += [sock, link.monitor]
        with pytest.raises(Refused, match="forbidden: agent.spot may not send TRAIN_HELLO"):
            handshake(sock, link, hello(1, world_size=2, num_nodes=2, local_world_size=1, local_rank=0), 60.0, endpoint)

        pub, sec = zmq.curve_keypair()  # a key the coordinator never allow-listed
        stranger = type(trainer)(trainer.server_public, pub, sec, trainer.principal)
        sock, link = _dealer(ctx, endpoint, stranger)
        socks += [sock, link.monitor]
        with pytest.raises(Refused, match="refused this rank's key"):
            handshake(sock, link, hello(1, world_size=2, num_nodes=2, local_world_size=1, local_rank=0), 60.0, endpoint)
        assert set(group.hellos) == {0}  # neither of them is a rank
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def test_ranks_the_coordinator_starts_get_the_nccl_watchdog_settings(tmp_path, monkeypatch):
    from spotlight.coordinator import trainer_group
    from spotlight.workers.train.launch_env import NCCL_ENV

    spawned = []
    monkeypatch.setattr(trainer_group, "spawn_logged", lambda cmd, name, env: spawned.append(env))
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "1")  # the user's choice is kept
    cfg = example_config("jpeg-toy", {"train.num_train_workers": 2})
    group = TrainerGroup(cfg, tmp_path, TensorStore(tmp_path / "ts"), EventLog(), phase=str, iteration=int)
    group.start(FakeServer(), load_server_keys(make_keys(tmp_path / "keys")))
    assert len(spawned) == 2
    for env in spawned:
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"


def test_a_rank_notices_that_the_coordinator_is_gone():
    """The rank's connection monitor: alive while connected, and once the coordinator's socket has
    been gone for the timeout, not (the rank then exits with status 3)."""
    from tests.integration.waiting import wait_until

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    link = CoordinatorLink(dealer, timeout_s=0.5)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        wait_until(lambda: link.alive() and link.connected, "the connection", timeout_s=60)
        router.close(linger=0)
        wait_until(lambda: not link.alive(), "the rank to give the coordinator up", timeout_s=60)
        assert link.ever_connected and not link.auth_failed
    finally:
        link.close()
        dealer.close(linger=0)
        ctx.term()


def test_the_rank_that_died_is_reported_before_the_peer_that_stopped_because_of_it(tmp_path):
    from spotlight.workers.train.peer_watch import EXIT_PEER_LOST

    class Exited:
        def __init__(self, code):
            self.returncode = code

        def poll(self):
            return self.returncode

    cfg = example_config("jpeg-toy", {"train.num_train_workers": 2})
    group = TrainerGroup(cfg, tmp_path, TensorStore(tmp_path / "ts"), EventLog(), phase=str, iteration=int)
    group.procs, group.logs = [Exited(EXIT_PEER_LOST), Exited(-9)], [None, None]
    assert group.failed(0.0).summary == "train worker rank 1 was killed by SIGKILL"
    group.procs = [Exited(EXIT_PEER_LOST), Exited(EXIT_PEER_LOST)]
    assert group.failed(0.0).summary.startswith("train worker rank 0 exited with code 4")
