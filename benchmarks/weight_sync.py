"""Weight sync at link speed: publish one version to N agents vs loopback capacity.

Everything runs on this machine over loopback TCP, each side in its own process, through
the real code:

* **coordinator** — a real :class:`spotlight.coordinator.coordinator.Coordinator` (CURVE ControlServer
  with its ZAP allow-list, Tensor Store, the ``on_trainer`` / ``on_fetch_weights``
  handlers), served by the same poll → ``handle`` loop as ``Coordinator.serve``, with
  ``cluster.weight_memory_max_bytes = 0`` so the version is only ever on disk;
* **trainer** — :func:`spotlight.store.weight_sync.send_version` on a trainer-keyed DEALER (what
  trainer rank 0 runs after ``save_version``): the upload into the Tensor Store;
* **agents** — N processes, each registering with its own agent key and fetching the
  version with :class:`agent.weight_cache.WeightCache` and the handlers of
  ``agent/main.py`` (``recv_multipart`` as the daemon does, a bounded window of chunks,
  file cache, digest check);
* **loopback capacity**, side by side in the same run, the same bytes in the same chunk
  size between two processes: a raw TCP socket (``sendall``/``recv_into``, no framing), a
  ZeroMQ PUSH/PULL stream without encryption, and the same with CURVE (what the link
  costs once it is encrypted). The ratio is measured against the CURVE stream: the
  coordinator's public socket is always encrypted (docs/architecture.md §9);
* a **worker load** (``mmap_state_dict`` + ``load_state_dict`` into a model of the same size).

Memory is sampled every 5 ms from ``/proc/<pid>/status`` of each process: ``RssAnon``
(private heap: what "a copy in memory" means) and total RSS (also counts the page-cache
pages of mapped files, which are shared with every other reader and reclaimable). Growth is
the peak during the measured step minus the value just before it.

Usage::

    python benchmarks/weight_sync.py                    # 1 GiB, N = 1, 2, 4, 4 MiB chunks, 3 rounds
    python benchmarks/weight_sync.py --size-mib 256 --agents 1,2 --chunk-mib 16 --window 8 --repeat 1

A 40 GB (full Qwen-Image, bf16) version needs 40 GB of disk per holder and time, not memory;
this 2-core, 24 GiB VM runs 1 GiB (every agent's cache file and the store's file on one disk).
GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

MIB = 1 << 20


# ---------------------------------------------------------------- memory sampling


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


class MemSampler:
    """Peak RssAnon / VmRSS of this process since :meth:`reset` (a thread sampling every 5 ms)."""

    def __init__(self):
        self.base = self.peak = _status()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.wait(0.005):
            s = _status()
            self.peak = {k: max(self.peak[k], s[k]) for k in s}

    def reset(self) -> None:
        self.base = self.peak = _status()

    def growth(self) -> dict[str, int]:
        s = _status()
        peak = {k: max(self.peak[k], s[k]) for k in s}
        return {"anon": peak["RssAnon"] - self.base["RssAnon"], "rss": peak["VmRSS"] - self.base["VmRSS"]}


# ---------------------------------------------------------------- the version file


def make_version(path: pathlib.Path, size_bytes: int) -> tuple[int, str]:
    """A safetensors file of about ``size_bytes``: one uint8 tensor of random bytes."""
    from spotlight.store.weight_sync import file_digest

    n = size_bytes - 8 - 64
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode().ljust(64)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        block = os.urandom(16 * MIB)
        left = n
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k
    return path.stat().st_size, file_digest(path)


# ---------------------------------------------------------------- coordinator process


def coordinator_proc(conn, workdir: str, keys_dir: str, chunk_bytes: int, window: int) -> None:
    import torch

    from spotlight.config import EXAMPLES_DIR, load_config
    from spotlight.coordinator.coordinator import Coordinator
    from spotlight.net.security import ephemeral_client, load_server_keys, write_client_file

    torch.set_num_threads(1)
    cfg = load_config(
        EXAMPLES_DIR / "jpeg-toy" / "config.toml",
        overrides={
            "cluster.weight_chunk_bytes": chunk_bytes,
            "cluster.weight_window_chunks": window,
            "cluster.weight_memory_max_bytes": 0,
            "cluster.heartbeat_timeout_s": 3600.0,
        },
    )
    coord = Coordinator(
        cfg,
        pathlib.Path(workdir) / "run",
        bind="tcp://127.0.0.1:0",
        keys=load_server_keys(keys_dir),
        prompts=["p0", "p1"],
        embeds=torch.zeros(2, 4, 384),
        mask=torch.ones(2, 4, dtype=torch.long),
        progress=lambda s: None,
    ).start()
    write_client_file(pathlib.Path(workdir) / "trainer.json", ephemeral_client(coord.keys, "trainer", "bench"))
    mem = MemSampler()
    cpu0, main0 = time.process_time(), time.thread_time()
    conn.send({"endpoint": coord.endpoint, "trainer_endpoint": coord.server.trainer_endpoint})
    while True:
        coord.control.serve_once(5)
        if conn.poll():
            cmd = conn.recv()
            if cmd == "reset":
                mem.reset()
                cpu0, main0 = time.process_time(), time.thread_time()
                conn.send("ok")
            elif cmd == "report":
                conn.send(
                    {
                        "mem": mem.growth(),
                        "cpu_s": time.process_time() - cpu0,
                        "main_cpu_s": time.thread_time() - main0,
                        "latest_version": coord.store.latest_version,
                        "rejected": coord.control.rejected,
                        "dropped_sends": coord.server.dropped_sends,
                        "in_memory": coord.store.stats()["weights_in_memory"],
                    }
                )
            elif cmd == "stop":
                break
    coord.close()


def trainer_proc(trainer_endpoint: str, creds_file: str, path: str, digest: str, chunk_bytes: int, cmds, out) -> None:
    """One trainer connection for the whole run: publishes the version number it gets from
    ``cmds`` (None ends it) and puts the time it started streaming on ``out``."""
    import zmq

    from spotlight import protocol as P
    from spotlight.net.security import apply_client, read_client_file
    from spotlight.store.weight_sync import send_version

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 60_000)
    apply_client(s, read_client_file(creds_file))
    s.connect(trainer_endpoint)
    s.send_multipart(P.encode(P.TrainReady(rank=0, world_size=1, version=0)))
    while (version := cmds.get()) is not None:
        t0 = time.perf_counter()
        send_version(s, version, path, digest, chunk_bytes)
        out.put(t0)
    s.close()
    ctx.term()


# ---------------------------------------------------------------- agent processes


def agent_proc(
    i: int, n: int, version: int, endpoint: str, keys_dir: str, cache_dir: str, window: int, ready, start, out
) -> None:
    import zmq

    from agent.weight_cache import WeightCache
    from spotlight import protocol as P
    from spotlight.net.security import apply_client, load_client_keys

    node = f"bench-r{version}-n{n}-{i}"
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    apply_client(s, load_client_keys(keys_dir, name=f"bench-{i}", role="agent"))
    s.connect(endpoint)
    s.send_multipart(P.encode(P.Register(protocol_version=P.PROTOCOL_VERSION, node_id=node, gpus=[0])))
    mtype, body, _ = P.decode(s.recv_multipart())
    assert mtype == P.MsgType.REGISTERED, body
    session = body.session
    cache = WeightCache(cache_dir, window_chunks=body.weight_window_chunks)

    def to_coord(reqs):
        for q in reqs:
            q.node_id, q.session = node, session
            s.send_multipart(P.encode(q), flags=zmq.NOBLOCK)

    mem = MemSampler()
    ready.put(i)
    start.wait()
    mem.reset()
    cpu0, main0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    to_coord(cache.fetch(version, time.monotonic()))
    done = None
    while done is None:
        # agent/main.py: AgentDaemon.run → on_coordinator (recv_multipart, copy=False)
        if not s.poll(1000):
            to_coord(cache.overdue(time.monotonic()))
            continue
        mtype, body, payload = P.decode(s.recv_multipart(zmq.NOBLOCK, copy=False))
        if mtype == P.MsgType.WEIGHTS:
            reqs, not_found = cache.on_weights(body, time.monotonic())
            assert not not_found
            to_coord(reqs)
        elif mtype == P.MsgType.WEIGHTS_CHUNK:
            reqs, done = cache.on_chunk(body, payload[0], time.monotonic())
            to_coord(reqs)
    seconds = time.perf_counter() - t0
    out.put(
        {
            "agent": i,
            "t0": t0,
            "seconds": seconds,
            "end": t0 + seconds,
            "mem": mem.growth(),
            "size": done.size_bytes,
            "cpu_s": time.process_time() - cpu0,
            "main_cpu_s": time.thread_time() - main0,
        }
    )
    s.close()
    ctx.term()


# ---------------------------------------------------------------- loopback baselines


def _stream_sender(kind: str, port_q, path: str, chunk_bytes: int, keys) -> None:
    import zmq

    from spotlight.store.weight_sync import MappedFile, chunk_span, num_chunks

    mapped = MappedFile(path)
    size = mapped.size_bytes
    chunks = [mapped.chunk(*chunk_span(i, size, chunk_bytes)) for i in range(num_chunks(size, chunk_bytes))]
    cpu0 = time.process_time()
    if kind == "tcp":
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        for c in chunks:
            conn.sendall(c)
        conn.recv(1)
        conn.close()
        port_q.put(time.process_time() - cpu0)
        return
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 60_000)
    s.setsockopt(zmq.SNDHWM, 4)
    if kind == "curve":
        s.curve_server = True
        s.curve_secretkey = keys[1]
    port_q.put(s.bind_to_random_port("tcp://127.0.0.1"))
    for c in chunks:
        s.send(c, copy=False)
    s.close()
    ctx.term()  # waits (LINGER) until everything is sent
    port_q.put(time.process_time() - cpu0)


def stream_loopback(kind: str, path: str, size: int, chunk_bytes: int) -> dict:
    """Seconds to move ``size`` bytes from one process to another (``kind``: tcp, zmq, curve,
    curve_file), timed at the receiver from the first byte to the last; the receiver discards
    them, except with ``curve_file``, where it writes them into a new file (what any receiver
    that keeps a version must do at least)."""
    import zmq

    keys = zmq.curve_keypair()
    port_q = mp.Queue()
    to_file = kind == "curve_file"
    kind = "curve" if to_file else kind
    p = mp.Process(target=_stream_sender, args=(kind, port_q, path, chunk_bytes, keys))
    p.start()
    port = port_q.get()
    got = 0
    cpu0 = time.process_time()
    if kind == "tcp":
        c = socket.create_connection(("127.0.0.1", port))
        buf = bytearray(chunk_bytes)
        t0 = None
        while got < size:
            n = c.recv_into(buf)
            t0 = t0 or time.perf_counter()
            got += n
        seconds = time.perf_counter() - t0
        c.send(b"k")
        c.close()
    else:
        ctx = zmq.Context()
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVHWM, 4)
        if kind == "curve":
            pub, sec = zmq.curve_keypair()
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys[0], pub, sec
        s.connect(f"tcp://127.0.0.1:{port}")
        fd = os.open(path + ".copy", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if to_file else -1
        t0 = None
        while got < size:
            f = s.recv(copy=False)
            t0 = t0 or time.perf_counter()
            if to_file:
                os.pwrite(fd, f.buffer, got)
            got += len(f)
        seconds = time.perf_counter() - t0
        if to_file:
            os.close(fd)
            os.unlink(path + ".copy")
        s.close()
        ctx.term()
    recv_cpu = time.process_time() - cpu0
    send_cpu = port_q.get()
    p.join()
    # the first chunk's own transfer is not in the timed span: count the bytes after it
    return {
        "kind": "curve_file" if to_file else kind,
        "seconds": seconds,
        "gbps": (size - min(size, chunk_bytes)) / seconds / 1e9,
        "cpu_s_per_gb": {"sender": send_cpu / size * 1e9, "receiver": recv_cpu / size * 1e9},
    }


def cpu_costs(path: str, size_cap: int = 512 * MIB) -> dict:
    """Single-core GB/s of the receiver's other work: sha256, blake2b, pwrite into the page cache."""
    import hashlib

    from spotlight.store.weight_sync import MappedFile

    mapped = MappedFile(path)
    n = min(mapped.size_bytes, size_cap)
    view = mapped.chunk(0, n)
    bytes(view[: 64 * MIB])  # fault the pages in
    out = {}
    for algo in ("sha256", "blake2b"):
        h = hashlib.new(algo)
        t = time.perf_counter()
        h.update(view)
        out[algo] = n / (time.perf_counter() - t) / 1e9
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path)) as f:
        t = time.perf_counter()
        pos = 0
        while pos < n:
            pos += os.pwrite(f.fileno(), view[pos : pos + 16 * MIB], pos)
        out["pwrite"] = n / (time.perf_counter() - t) / 1e9
    return out


def worker_load(path: str) -> dict:
    """A worker loading the cached version: map the file, copy it into a model of the same size."""
    code = (
        "import sys, time, torch; sys.path.insert(0, %r)\n"
        "from benchmarks.weight_sync import MemSampler\n"
        "from spotlight.store.tensor_wire import mmap_state_dict\n"
        "torch.set_num_threads(1)\n"
        "meta = mmap_state_dict(%r)\n"
        "model = torch.nn.ParameterDict({'w': torch.nn.Parameter(torch.zeros_like(meta['w']), requires_grad=False)})\n"
        "model['w'].data.fill_(1); del meta\n"
        "mem = MemSampler(); t = time.perf_counter()\n"
        "sd = mmap_state_dict(%r); model.load_state_dict(sd)\n"
        "s = time.perf_counter() - t; assert torch.equal(model['w'], sd['w'])\n"
        "import json; print(json.dumps({'seconds': s, 'mem': mem.growth()}))\n"
    ) % (str(pathlib.Path(__file__).resolve().parent.parent), path, path)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="version size in MiB (default 1024)")
    ap.add_argument("--agents", default="1,2,4", help="comma-separated agent counts N (default 1,2,4)")
    ap.add_argument(
        "--chunk-mib", type=float, default=4, help="cluster.weight_chunk_bytes in MiB (default 4, the config default)"
    )
    ap.add_argument("--window", type=int, default=4, help="cluster.weight_window_chunks (default 4)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds; each measures the loopback streams, then every N (default 3; medians reported)",
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir in /var/tmp)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    from spotlight.net.security import add_client, init_keys

    ns = [int(x) for x in args.agents.split(",")]
    chunk = int(args.chunk_mib * MIB)
    root = pathlib.Path(tempfile.mkdtemp(prefix="wsync-bench-", dir=args.dir or "/var/tmp"))
    results: dict = {
        "size_mib": args.size_mib,
        "chunk_bytes": chunk,
        "window": args.window,
        "repeat": args.repeat,
        "load_avg_start": os.getloadavg(),
        "loopback": {},
        "upload": [],
        "fetch": {n: [] for n in ns},
    }
    try:
        src = root / "version.safetensors"
        size, digest = make_version(src, args.size_mib * MIB)
        results["size_bytes"] = size
        print(
            f"version: {size:,} bytes ({digest[:23]}…), chunks of {chunk:,} B, window {args.window}, "
            f"load avg {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        results["cpu"] = cpu_costs(str(src))
        print("single core: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in results["cpu"].items()), flush=True)

        keys_dir = root / "keys"
        init_keys(keys_dir)
        for i in range(max(ns)):
            add_client(keys_dir, "agent", f"bench-{i}")
        parent, child = mp.Pipe()
        cp = mp.Process(target=coordinator_proc, args=(child, str(root), str(keys_dir), chunk, args.window))
        cp.start()
        eps = parent.recv()

        def ask(cmd):
            parent.send(cmd)
            return parent.recv()

        q, cmds = mp.Queue(), mp.Queue()
        tp = mp.Process(
            target=trainer_proc,
            args=(eps["trainer_endpoint"], str(root / "trainer.json"), str(src), digest, chunk, cmds, q),
        )
        tp.start()

        for r in range(args.repeat):
            # loopback capacity, measured in every round next to the fetches it is compared with
            loop = {}
            for kind in ("tcp", "zmq", "curve", "curve_file"):
                loop[kind] = stream_loopback(kind, str(src), size, chunk)
                results["loopback"].setdefault(kind, []).append(loop[kind]["gbps"])
                results.setdefault("loopback_cpu", {}).setdefault(kind, []).append(loop[kind]["cpu_s_per_gb"])
            print(
                f"round {r + 1}: loopback " + ", ".join(f"{k} {v['gbps']:.3f}" for k, v in loop.items()) + " GB/s",
                flush=True,
            )

            # upload: trainer rank 0 → coordinator Tensor Store (version r)
            ask("reset")
            cmds.put(r)
            t0 = q.get(timeout=600)
            while (rep := ask("report"))["latest_version"] != r:
                if rep["rejected"] or time.perf_counter() - t0 > 600:
                    raise SystemExit(f"the upload failed: {rep}")
                time.sleep(0.01)
            up_s = time.perf_counter() - t0
            rep = ask("report")
            results["upload"].append({"seconds": up_s, "gbps": size / up_s / 1e9, "coordinator_mem": rep["mem"]})
            print(
                f"  upload trainer→coordinator: {up_s:.2f}s {size / up_s / 1e9:.3f} GB/s; "
                f"coordinator growth anon {rep['mem']['anon'] / MIB:.0f} MiB, rss {rep['mem']['rss'] / MIB:.0f} MiB",
                flush=True,
            )

            # fetch: coordinator → N agents at once
            for n in ns:
                subprocess.run(["sync"], check=False)
                ready, out, start = mp.Queue(), mp.Queue(), mp.Event()
                procs = [
                    mp.Process(
                        target=agent_proc,
                        args=(
                            i,
                            n,
                            r,
                            eps["endpoint"],
                            str(keys_dir),
                            str(root / f"cache-n{n}-{i}"),
                            args.window,
                            ready,
                            start,
                            out,
                        ),
                    )
                    for i in range(n)
                ]
                for p in procs:
                    p.start()
                for _ in procs:
                    ready.get()
                ask("reset")
                start.set()
                res = [out.get() for _ in procs]
                for p in procs:
                    p.join()
                rep = ask("report")
                span = max(x["end"] for x in res) - min(x["t0"] for x in res)
                gbps = n * size / span / 1e9
                row = {
                    "n": n,
                    "bytes": n * size,
                    "seconds": span,
                    "gbps": gbps,
                    "coordinator_cpu_s_per_gb": rep["cpu_s"] / (n * size) * 1e9,
                    "coordinator_main_cpu_s_per_gb": rep["main_cpu_s"] / (n * size) * 1e9,
                    "agent_cpu_s_per_gb": sum(x["cpu_s"] for x in res) / (n * size) * 1e9,
                    "agent_main_cpu_s_per_gb": sum(x["main_cpu_s"] for x in res) / (n * size) * 1e9,
                    "ratio": gbps / loop["curve"]["gbps"],
                    "ratio_file": gbps / loop["curve_file"]["gbps"],
                    "agents": res,
                    "coordinator_mem": rep["mem"],
                    "dropped_sends": rep["dropped_sends"],
                    "rejected": rep["rejected"],
                }
                results["fetch"][n].append(row)
                print(
                    f"  N={n}: {n * size:,} B in {span:.2f}s = {gbps:.3f} GB/s ({row['ratio']:.0%} of the CURVE "
                    f"stream, {row['ratio_file']:.0%} of it into a file); "
                    f"CPU s/GB coordinator {row['coordinator_cpu_s_per_gb']:.1f} (main thread "
                    f"{row['coordinator_main_cpu_s_per_gb']:.1f}) "
                    f"agents {row['agent_cpu_s_per_gb']:.1f} (main threads {row['agent_main_cpu_s_per_gb']:.1f}); "
                    f"coordinator growth anon {rep['mem']['anon'] / MIB:.0f} MiB rss {rep['mem']['rss'] / MIB:.0f} "
                    f"MiB; agent growth anon ≤ {max(x['mem']['anon'] for x in res) / MIB:.0f} MiB rss ≤ "
                    f"{max(x['mem']['rss'] for x in res) / MIB:.0f} MiB",
                    flush=True,
                )
                for i in range(n):
                    for f in (root / f"cache-n{n}-{i}").glob("*"):
                        f.unlink()
        cmds.put(None)
        tp.join()
        rep = ask("report")
        assert rep["in_memory"] == [] and rep["rejected"] == 0, rep
        results["coordinator_dropped_sends"] = rep["dropped_sends"]
        parent.send("stop")
        cp.join(30)
        results["worker_load"] = worker_load(str(src))
        wl = results["worker_load"]
        print(
            f"worker load (mmap + load_state_dict): {wl['seconds']:.2f}s, "
            f"anon growth {wl['mem']['anon'] / MIB:.0f} MiB, rss growth {wl['mem']['rss'] / MIB:.0f} MiB",
            flush=True,
        )
        results["load_avg_end"] = os.getloadavg()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _med(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs)


def _cpu(r: dict, kind: str) -> str:
    c = r["loopback_cpu"][kind]
    return f"CPU s per GB: sender {_med([x['sender'] for x in c]):.1f}, receiver {_med([x['receiver'] for x in c]):.1f}"


def table(r: dict) -> str:
    """The Markdown tables of ``benchmarks/RESULTS.md`` (medians over the rounds, [min–max])."""
    size = r["size_bytes"]
    curve = r["loopback"]["curve"]
    lines = [
        "| N agents | bytes delivered | seconds | achieved GB/s | loopback GB/s (CURVE stream) "
        "| ratio | ratio to the CURVE stream into a file | CPU s per GB: "
        "coordinator / agents | coordinator peak growth: anon / RSS | agent peak growth: anon / RSS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, rows in r["fetch"].items():
        g = [x["gbps"] for x in rows]
        ca = max(x["coordinator_mem"]["anon"] for x in rows) / MIB
        cr = max(x["coordinator_mem"]["rss"] for x in rows) / MIB
        aa = max(a["mem"]["anon"] for x in rows for a in x["agents"]) / MIB
        ar = max(a["mem"]["rss"] for x in rows for a in x["agents"]) / MIB
        lines.append(
            f"| {n} | {n * size:,} | {_med([x['seconds'] for x in rows]):.2f} | {_med(g):.3f} "
            f"[{min(g):.3f}–{max(g):.3f}] | {_med(curve):.3f} [{min(curve):.3f}–{max(curve):.3f}] "
            f"| {_med([x['ratio'] for x in rows]):.0%} | {_med([x['ratio_file'] for x in rows]):.0%} | "
            f"{_med([x['coordinator_cpu_s_per_gb'] for x in rows]):.1f} / "
            f"{_med([x['agent_cpu_s_per_gb'] for x in rows]):.1f} "
            f"| {ca:.0f} / {cr:.0f} MiB | {aa:.0f} / {ar:.0f} MiB |"
        )
    up = r["upload"]
    ug = [x["gbps"] for x in up]
    lines += [
        "",
        "| step | GB/s | notes |",
        "|---|---|---|",
        f"| loopback: raw TCP socket | {_med(r['loopback']['tcp']):.3f} | `sendall` / `recv_into`, no framing, "
        f"no encryption; {_cpu(r, 'tcp')} |",
        f"| loopback: ZeroMQ PUSH/PULL, no CURVE | {_med(r['loopback']['zmq']):.3f} | zero-copy frames from the mmap; "
        f"{_cpu(r, 'zmq')} |",
        f"| loopback: ZeroMQ PUSH/PULL, CURVE | {_med(curve):.3f} | the link the coordinator's sockets use; "
        f"{_cpu(r, 'curve')} |",
        f"| loopback: ZeroMQ PUSH/PULL, CURVE, written to a new file | {_med(r['loopback']['curve_file']):.3f} | the "
        f"least a receiver that keeps the version does (no digest); {_cpu(r, 'curve_file')} |",
        "| upload trainer → coordinator (1 version, CURVE) "
        f"| {_med(ug):.3f} | {_med([x['seconds'] for x in up]):.2f} s; "
        f"coordinator peak growth anon {max(x['coordinator_mem']['anon'] for x in up) / MIB:.0f} MiB, "
        f"RSS {max(x['coordinator_mem']['rss'] for x in up) / MIB:.0f} MiB |",
        f"| sha256, one core | {r['cpu']['sha256']:.2f} | the receiver's digest (default) |",
        f"| blake2b, one core | {r['cpu']['blake2b']:.2f} | the alternative digest |",
        f"| pwrite into the page cache, one core | {r['cpu']['pwrite']:.2f} | the receiver's file write (new pages) |",
        f"| worker load: mmap + load_state_dict | {size / r['worker_load']['seconds'] / 1e9:.2f} | "
        f"{r['worker_load']['seconds']:.2f} s; anon growth {r['worker_load']['mem']['anon'] / MIB:.0f} MiB (the model "
        f"was allocated before), RSS {r['worker_load']['mem']['rss'] / MIB:.0f} MiB |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    mp.set_start_method("spawn")
    sys.exit(main())
