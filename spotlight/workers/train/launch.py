"""A Train Worker rank started by torch's own launcher or by Slurm, for a trainer that spans nodes.

``spotlight up --external-trainers`` starts no Train Workers: it waits for ranks started with
this entry point on the reserved nodes (README "Multi-node training", docs/deploy/slurm.md)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE --master-addr $HEAD --master-port 29500 \\
        -m spotlight.workers.train.launch --coordinator $HEAD:7401 --keys ~/.spotlight/trainer-keys
    srun --nodes 2 --ntasks-per-node 8 python -m spotlight.workers.train.launch ...   # MASTER_ADDR/PORT exported

Each rank:

1. reads its place from the launcher's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
   ``LOCAL_WORLD_SIZE``, … or Slurm's; :func:`spotlight.workers.train.launch_env.launch_env`) and
   sets the NCCL watchdog variables (:data:`~spotlight.workers.train.launch_env.NCCL_ENV`);
2. connects to the coordinator's trainer socket over CurveZMQ with a ``trainer`` key of its
   allow-list (``--keys DIR``: ``server.key`` and ``trainer.<name>.key_secret``; the coordinator
   serves no other key there), sends TRAIN_HELLO (rank, host, GPU: billed per node) and receives
   TRAIN_SETUP: the run's config, the checkpoint a resumed run loads, and where checkpoints go;
3. joins the process group (``env://``, NCCL bound to ``cuda:<LOCAL_RANK>`` with ``device_id``,
   gloo on the CPU), builds the trainer on a 2-D HSDP mesh when it spans nodes, starts its peer
   watch (:mod:`spotlight.workers.train.peer_watch`) and serves the coordinator exactly as a rank
   the coordinator spawned (:func:`spotlight.workers.train.train_worker.run_rank`).

Why each rank connects to the coordinator itself (rather than rank 0 relaying over the process
group): every rank gets its own TRAIN_BATCH of tensors, which the coordinator already addresses
per rank; the process group's transports (the c10d store, gloo, NCCL) are not authenticated, so
nothing from the coordinator travels over them; and the coordinator sees each rank's connection
end, which is how it learns that a rank on another node died.

Exit status: 0 after SHUTDOWN; 2 a refused start (bad launcher environment, keys, world size,
the coordinator's refusal, or no coordinator within ``--connect-timeout-s``); 3 the coordinator
was lost; :data:`~spotlight.workers.train.peer_watch.EXIT_PEER_LOST` another rank died.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

log = logging.getLogger("spotlight.train")

EXIT_REFUSED = 2
EXIT_COORDINATOR_LOST = 3


class Refused(Exception):
    """The rank cannot start: one line for the log, exit :data:`EXIT_REFUSED`."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from spotlight.util.cli_paths import nonempty_path_arg
    from spotlight.workers.train.train_worker import PEER_TIMEOUT_S

    ap = argparse.ArgumentParser(
        prog="python -m spotlight.workers.train.launch",
        description="A Train Worker rank under torchrun or srun, for `spotlight up --external-trainers`.",
    )
    ap.add_argument(
        "--coordinator",
        required=True,
        metavar="HOST:PORT",
        help="the coordinator's trainer address (`spotlight up --external-trainers` prints it; its --trainer-port)",
    )
    ap.add_argument(
        "--keys",
        default=os.environ.get("SPOTLIGHT_KEYS") or None,
        type=nonempty_path_arg,
        metavar="DIR",
        help="directory with the coordinator's server.key and a trainer.<name>.key_secret (`spotlight keys add KEYS "
        "trainer NAME`); default $SPOTLIGHT_KEYS",
    )
    ap.add_argument("--key", default=None, help="the trainer key's name when DIR holds several")
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        type=nonempty_path_arg,
        metavar="DIR",
        help="where the trainer checkpoints go (every rank must see the same directory: a shared file system); "
        "default: the coordinator's RUN_DIR/checkpoints/train",
    )
    ap.add_argument(
        "--spool-dir",
        default=None,
        type=nonempty_path_arg,
        metavar="DIR",
        help="rank 0's scratch for each version (default: temp dir)",
    )
    ap.add_argument(
        "--connect-timeout-s",
        type=float,
        default=900.0,
        help="how long to wait for the coordinator to answer (it may still be starting)",
    )
    ap.add_argument(
        "--coordinator-timeout-s",
        type=float,
        default=60.0,
        help="exit when the coordinator's connection has been down this long",
    )
    ap.add_argument(
        "--peer-timeout-s",
        type=float,
        default=PEER_TIMEOUT_S,
        help="a rank silent this long is taken as dead: the others abort their communicator and exit",
    )
    ap.add_argument(
        "--log-file",
        default=None,
        type=nonempty_path_arg,
        metavar="PATH",
        help="also log to PATH ({rank} is replaced by the rank)",
    )
    ap.add_argument("--text-dim", type=int, default=384, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag in ("connect_timeout_s", "coordinator_timeout_s", "peer_timeout_s"):
        if not getattr(args, flag) > 0:
            ap.error(f"--{flag.replace('_', '-')} must be > 0")
    if not args.keys:
        ap.error("--keys DIR is required (or set SPOTLIGHT_KEYS)")
    return args


class CoordinatorLink:
    """The state of the DEALER's connection to the coordinator, from its ZeroMQ monitor events
    (read whenever :meth:`alive` is asked; no thread).

    Args:
        sock: the DEALER (before ``connect``).
        timeout_s: :meth:`alive` turns False once the connection has been down this long.
    """

    def __init__(self, sock, timeout_s: float):
        import zmq

        events = (
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self.monitor = sock.get_monitor_socket(events)
        self.timeout_s = timeout_s
        self.connected = False
        self.ever_connected = False
        self.down_since = time.monotonic()
        self.auth_failed = False

    def poll_events(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = self.ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    self.down_since = time.monotonic()
                self.connected = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.auth_failed = True

    def alive(self) -> bool:
        self.poll_events()
        return self.connected or time.monotonic() - self.down_since <= self.timeout_s

    def close(self) -> None:
        self.monitor.close(linger=0)


class HeartbeatThread:
    """TRAIN_HEARTBEAT every ``interval_s`` on a connection of its own (the rank's main thread may
    be inside a step for minutes; a ZeroMQ socket belongs to one thread): how the coordinator
    knows this rank lives. An ERROR the coordinator answers is logged (once per code).

    Args:
        ctx: the process's ZeroMQ context.
        endpoint: the coordinator's trainer socket.
        keys: this rank's trainer keys.
        rank, session: what every heartbeat names (the session from TRAIN_SETUP).
    """

    def __init__(self, ctx, endpoint: str, keys, rank: int, session: str, interval_s: float):
        import threading

        self.ctx, self.endpoint, self.keys = ctx, endpoint, keys
        self.rank, self.session, self.interval_s = rank, session, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> HeartbeatThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        from spotlight import protocol as P
        from spotlight.coordinator.server import set_heartbeats
        from spotlight.net.security import apply_client

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        set_heartbeats(sock)
        apply_client(sock, self.keys)
        sock.connect(self.endpoint)
        frames = P.encode(P.TrainHeartbeat(rank=self.rank, session=self.session))
        said: set[str] = set()
        try:
            while True:
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:  # not connected (yet, or any more): the next beat tries again
                    pass
                while sock.poll(0):
                    try:
                        mtype, body, _ = P.decode(sock.recv_multipart())
                    except P.ProtocolError:
                        continue
                    if mtype == P.MsgType.ERROR and body.code not in said:
                        said.add(body.code)
                        log.error("the coordinator refused this rank's heartbeat: %s: %s", body.code, body.message)
                if self._stop.wait(self.interval_s):
                    return
        finally:
            sock.close(linger=0)


def _gpu(index: int) -> int:
    """The physical index of CUDA device ``index`` on this host (``CUDA_VISIBLE_DEVICES`` mapped;
    ``index`` itself when the list is not numeric), for billing per host."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def handshake(sock, link: CoordinatorLink, hello, timeout_s: float, endpoint: str):
    """Send TRAIN_HELLO and wait for TRAIN_SETUP (saying every 30 s that it waits).

    Raises:
        Refused: the coordinator refused the key or the rank (its ERROR), or did not answer within ``timeout_s``.
    """
    from spotlight import protocol as P

    sock.send_multipart(P.encode(hello))
    t0 = last_note = time.monotonic()
    while True:
        link.poll_events()
        if link.auth_failed:
            raise Refused(
                f"the coordinator at {endpoint} refused this rank's key: it is not a trainer key on its allow-list "
                "(create one with `spotlight keys add KEYS trainer NAME` on the coordinator's keys directory and copy "
                "server.key and trainer.NAME.key_secret to --keys)"
            )
        if sock.poll(500):
            try:
                mtype, body, _ = P.decode(sock.recv_multipart())
            except P.ProtocolError as exc:
                raise Refused(f"malformed answer from the coordinator: {exc}") from None
            if mtype == P.MsgType.TRAIN_SETUP:
                return body
            if mtype == P.MsgType.ERROR:
                raise Refused(f"the coordinator refused rank {hello.rank}: {body.code}: {body.message}")
            log.warning("ignoring %s before TRAIN_SETUP", mtype.name)
            continue
        now = time.monotonic()
        if now - t0 > timeout_s:
            how = "connected, but no answer" if link.ever_connected else "no connection"
            raise Refused(
                f"no answer from the coordinator at {endpoint} within {timeout_s:g} s ({how}): is `spotlight up "
                "--external-trainers` running there, with that --trainer-port?"
            )
        if now - last_note >= 30:
            last_note = now
            log.info("waiting for the coordinator at %s (%.0f s)", endpoint, now - t0)


def pick_device(env) -> tuple:
    """``(device, gpu)``: ``cuda:<i>`` for this rank (:func:`~spotlight.workers.train.launch_env.cuda_index`,
    made the current device) and its physical index on the host; the CPU and -1 without CUDA.

    Raises:
        LaunchError: the node's GPUs do not fit its ranks.
    """
    import torch

    from spotlight.workers.train.launch_env import cuda_index

    if not torch.cuda.is_available():
        return torch.device("cpu"), -1
    index = cuda_index(env.local_rank, env.local_world_size, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index), _gpu(index)


def join_process_group(env, device) -> None:
    """``init_process_group`` with the ``env://`` rendezvous of the launcher: NCCL bound to this
    rank's GPU (``device_id``) on CUDA, gloo on the CPU."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        device_id=device if cuda else None,
    )


def main(argv: list[str] | None = None) -> int:
    import tomllib

    import torch
    import zmq

    from spotlight import protocol as P
    from spotlight.config import ConfigError, config_from_dict
    from spotlight.coordinator.server import set_heartbeats
    from spotlight.net.endpoints import parse_host_port
    from spotlight.net.security import KeysError, apply_client, load_client_keys
    from spotlight.util.procs import configure_logging
    from spotlight.workers.train import train_worker as tw
    from spotlight.workers.train.launch_env import LaunchError, launch_env, nccl_env

    args = _parse(argv)
    try:
        env = launch_env(os.environ)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    log_file = args.log_file.replace("{rank}", str(env.rank)) if args.log_file else None
    configure_logging(f"trainer-{env.rank}", log_file=log_file)
    updates, notes = nccl_env(os.environ)
    os.environ.update(updates)  # read when the NCCL process group is made
    for note in notes:
        log.info("%s", note)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    link = None
    try:
        try:
            host, port = parse_host_port(args.coordinator, flag="--coordinator")
            keys = load_client_keys(args.keys, name=args.key, role="trainer")
            device, gpu = pick_device(env)
        except (ValueError, KeysError, LaunchError) as exc:
            raise Refused(str(exc)) from None
        endpoint = f"tcp://{host}:{port}"
        sock.setsockopt(zmq.LINGER, 10_000)
        set_heartbeats(sock)
        apply_client(sock, keys)
        link = CoordinatorLink(sock, args.coordinator_timeout_s)
        sock.connect(endpoint)
        hello = P.TrainHello(
            protocol_version=P.PROTOCOL_VERSION,
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            local_world_size=env.local_world_size,
            num_nodes=env.num_nodes,
            host=socket.gethostname()[:255],
            gpu=gpu,
            pid=os.getpid(),
        )
        log.info(
            "rank %d of %d (node %d of %d, local rank %d, %s, %s) connecting to %s as %s",
            env.rank,
            env.world_size,
            env.node_rank,
            env.num_nodes,
            env.local_rank,
            device,
            env.launcher,
            endpoint,
            keys.principal.id,
        )
        setup = handshake(sock, link, hello, args.connect_timeout_s, f"{host}:{port}")
        try:
            cfg = config_from_dict(tomllib.loads(setup.config_toml))
        except (ConfigError, tomllib.TOMLDecodeError) as exc:
            raise Refused(f"the coordinator's config does not load here: {exc}") from None
    except Refused as exc:
        log.error("%s", exc)
        if link is not None:
            link.close()
        sock.close(linger=0)
        ctx.term()
        return EXIT_REFUSED
    heartbeat = HeartbeatThread(ctx, endpoint, keys, env.rank, setup.session, setup.heartbeat_interval_s).start()
    torch.set_num_threads(max(1, cfg.cluster.torch_threads))
    rank_args = argparse.Namespace(
        rank=env.rank,
        world_size=env.world_size,
        num_nodes=env.num_nodes,
        text_dim=args.text_dim,
        checkpoint_dir=args.checkpoint_dir or setup.checkpoint_dir or None,
        resume_version=setup.resume_version if setup.resume_version >= 0 else None,
        spool_dir=args.spool_dir,
        # a collapse-guard rollback may return to the base model: its checkpoint is saved too
        checkpoint_initial=cfg.guard.enabled and cfg.guard.action == "rollback",
    )
    join_process_group(env, device)
    watch = tw.start_peer_watch(env.master_addr, env.master_port, env.rank, env.world_size, args.peer_timeout_s)
    try:
        rc = tw.run_rank(rank_args, cfg, device, sock, watch=watch, alive=link.alive)
        if rc == EXIT_COORDINATOR_LOST:
            log.error("lost the coordinator at %s for more than %g s", endpoint, args.coordinator_timeout_s)
        return rc
    finally:
        heartbeat.stop()
        if watch is not None:
            watch.stop()
        link.close()
        sock.close()
        ctx.term()
        tw.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
