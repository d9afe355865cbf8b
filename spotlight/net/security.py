"""Keys and authentication of the control plane: ZeroMQ CURVE with a ZAP allow-list.

Every connection to the coordinator — agents, trainers, ``spotlight status`` — is
encrypted and mutually authenticated with CurveZMQ (RFC 26, libsodium's Curve25519 box
inside pyzmq): the client proves it holds a secret key whose public half is on the
coordinator's allow-list, and the coordinator proves it holds the server secret the
client expects. The handshake uses fresh ephemeral keys, so a captured handshake or
message cannot be replayed, and every byte after it (all registration fields included)
is authenticated and encrypted. Threat model and provisioning: README "Security model",
docs/architecture.md §9.

A keys directory (``spotlight keys init DIR``) holds::

    DIR/server.key               coordinator public key: copy it to every client
    DIR/server.key_secret        coordinator secret key (reserved node only, mode 0600)
    DIR/clients/<role>.<name>.key    the allow-list: public keys of accepted clients
    DIR/<role>.<name>.key_secret     client secret keys (move each to its node, mode 0600)

The files are pyzmq/czmq certificate files (``zmq.auth.create_certificates``). A
client's *principal* is ``<role>.<name>``; its role decides what it may send:

* ``agent``    — a spot node's agent (REGISTER with ``is_spot=True`` and node traffic);
* ``reserved`` — the reserved node's own rollout agent (may register ``is_spot=False``);
* ``trainer``  — Train Workers (TRAIN_READY, TRAIN_DONE, WEIGHTS);
* ``status``   — read-only STATUS requests (``spotlight status``).

The module is torch-free: the agent daemon imports it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shlex
import threading

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from spotlight.errors import SpotlightError

ROLES = ("agent", "reserved", "trainer", "status")
"""Client roles, in the order ``spotlight keys list`` prints them."""

ZAP_DOMAIN = "spotlight"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class KeysError(SpotlightError):
    """A keys directory or key file that is missing, malformed or ambiguous."""


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who is on the other end of an authenticated connection."""

    role: str
    name: str
    ephemeral: bool = dataclasses.field(default=False, compare=False)
    """True for keys that live only in the coordinator's memory (its own Train Workers)."""

    @property
    def id(self) -> str:
        return f"{self.role}.{self.name}"

    @classmethod
    def parse(cls, text: str) -> "Principal":
        role, _, name = text.partition(".")
        if role not in ROLES or not _NAME.match(name):
            raise KeysError(f"bad principal {text!r}: expected <role>.<name> with role in {ROLES}")
        return cls(role, name)


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """What a client needs: the server's public key and its own key pair (z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes
    principal: Principal


@dataclasses.dataclass
class ServerKeys:
    """The coordinator's key pair and the allow-list ``{client public key (z85): Principal}``."""

    public: bytes
    secret: bytes
    allowed: dict[bytes, Principal]
    directory: pathlib.Path | None = None

    def allow(self, public: bytes, principal: Principal) -> None:
        self.allowed[bytes(public)] = principal


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise KeysError(
            f"bad key name {name!r}: use 1-64 letters, digits, '-' or '_' (starting with a letter or digit)"
        )
    return name


def _private(path: pathlib.Path) -> None:
    os.chmod(path, 0o600)


def _valid_z85_key(key: bytes | None) -> bool:
    """``key`` is a CurveZMQ key as a certificate file holds it: 40 Z85 characters (32 bytes)."""
    from zmq.utils import z85

    if not key or len(key) != 40 or any(c not in z85.Z85CHARS for c in key):
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, OverflowError):  # a 5-character group above 2**32
        return False


def read_public_key(path: str | os.PathLike) -> bytes:
    """The public key (Z85) of the certificate file ``path`` (``server.key``, an allow-list file
    ``clients/<role>.<name>.key``, a secret key file).

    Raises:
        KeysError: ``PATH: why``: the file cannot be read, holds no ``public-key`` line (an empty
            or corrupt file), or its key is no 40-character Z85 CurveZMQ key.
    """
    f = pathlib.Path(path)
    if f.is_dir():
        raise KeysError(f"{f}: a directory, not a key file")
    if not f.exists():
        raise KeysError(f"{f}: no such file")
    try:
        public, _ = zmq.auth.load_certificate(f)
    except OSError as exc:
        raise KeysError(f"{f}: {exc.strerror or exc}") from None
    except ValueError:  # pyzmq: "No public key found in PATH"
        raise KeysError(f"{f}: no public key in it (an empty or corrupt key file)") from None
    if not _valid_z85_key(public):
        raise KeysError(f"{f}: its public-key is not a CurveZMQ key (40 Z85 characters); the file is corrupt")
    return public


def server_key_problem(directory: str | os.PathLike) -> str | None:
    """Why ``DIR/server.key`` (the coordinator's public key, copied to every client) could not be
    used by a client (None: it can): unreadable, corrupt, or another key than the coordinator's
    ``server.key_secret`` holds. A client with such a copy fails only when it joins."""
    d = pathlib.Path(directory)
    server = d / "server.key"
    secret = d / "server.key_secret"
    fix = (
        f"rewrite it from {secret} (the same file without its secret-key line)"
        if secret.is_file()
        else "copy it again from the coordinator's keys directory"
    )
    try:
        public = read_public_key(server)
    except KeysError as exc:
        return f"{exc}: clients given it could not connect; {fix}"
    if secret.is_file():
        try:
            own, _ = zmq.auth.load_certificate(secret)
        except (OSError, ValueError):
            return None  # the secret file's own problem: the coordinator reports it when it loads it
        if own != public:
            return (
                f"{server} holds another public key than the coordinator's {secret}: clients given it "
                f"could not connect; {fix}"
            )
    return None


def init_keys(directory: str | os.PathLike, *, exist_ok: bool = False) -> pathlib.Path:
    """Create ``DIR`` (mode 0700) with a coordinator key pair and an empty allow-list.

    Returns:
        The path of ``server.key`` (the public key to copy to clients).

    Raises:
        KeysError: ``DIR`` is a file, or already holds a server key and ``exist_ok`` is false.
    """
    d = pathlib.Path(directory)
    if d.exists() and not d.is_dir():
        raise KeysError(f"{d} is a file, not a keys directory")
    if (d / "server.key_secret").exists():
        if exist_ok:
            return d / "server.key"
        raise KeysError(f"{d} already holds a coordinator key (server.key_secret); refusing to overwrite it")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    (d / "clients").mkdir(exist_ok=True)
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(d, "server")
    finally:
        os.umask(old)
    _private(pathlib.Path(sec))
    os.chmod(pub, 0o644)
    return pathlib.Path(pub)


def add_client(directory: str | os.PathLike, role: str, name: str) -> pathlib.Path:
    """Create a client key pair ``<role>.<name>`` and put its public key on the allow-list.

    Returns:
        The secret key file ``DIR/<role>.<name>.key_secret`` (move it to the client's node).

    Raises:
        KeysError: unknown role, bad name, no ``server.key`` in ``DIR`` or one a client could not
            use (:func:`server_key_problem`), or the key exists.
    """
    if role not in ROLES:
        raise KeysError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    _check_name(name)
    d = pathlib.Path(directory)
    if not (d / "server.key").is_file():
        raise KeysError(f"{d} has no server.key: run `spotlight keys init {shlex.quote(str(d))}` first")
    problem = server_key_problem(d)  # the file the new client is told to copy
    if problem:
        raise KeysError(problem)
    pid = f"{role}.{name}"
    if (d / "clients" / f"{pid}.key").exists():
        raise KeysError(f"key {pid} already exists in {d / 'clients'}")
    (d / "clients").mkdir(exist_ok=True)
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(d, pid)
    finally:
        os.umask(old)
    _private(pathlib.Path(sec))
    os.replace(pub, d / "clients" / f"{pid}.key")
    os.chmod(d / "clients" / f"{pid}.key", 0o644)
    return pathlib.Path(sec)


def _require_keys_dir(d: pathlib.Path) -> None:
    """Raise KeysError when ``d`` is not a coordinator's keys directory: missing, a file, or no
    ``server.key`` in it (an allow-list read there would look empty, not wrong)."""
    init = shlex.join(["spotlight", "keys", "init", str(d)])
    if not d.exists():
        raise KeysError(f"{d}: no such directory (create keys with `{init}`)")
    if not d.is_dir():
        raise KeysError(f"{d} is a file, not a keys directory")
    if not (d / "server.key").is_file():
        raise KeysError(f"{d} is not a keys directory (no server.key): create one with `{init}`")


def revoke_client(directory: str | os.PathLike, principal: str) -> pathlib.Path | None:
    """Remove ``<role>.<name>`` from the allow-list (a running coordinator drops it on reload),
    and its secret key file from ``DIR`` where :func:`add_client` left it: a revoked key is
    never valid again (adding the name again makes a new pair), and a stale secret beside the
    others would make ``spotlight-agent join --keys DIR`` see several keys of its role.

    Returns:
        The secret key file removed, or None when ``DIR`` held none (it was moved to its node).

    Raises:
        KeysError: ``DIR`` is no keys directory, or no such key on the allow-list.
    """
    _require_keys_dir(pathlib.Path(directory))
    p = Principal.parse(principal)
    f = pathlib.Path(directory) / "clients" / f"{p.id}.key"
    if not f.is_file():
        raise KeysError(f"{p.id} is not on the allow-list of {directory}")
    f.unlink()
    secret = pathlib.Path(directory) / f"{p.id}.key_secret"
    if secret.is_file():
        secret.unlink()
        return secret
    return None


def list_keys(directory: str | os.PathLike, *, keep_bad: bool = False) -> list[dict]:
    """Allow-listed clients and local secret keys: ``[{principal, role, name, public, has_secret,
    problem}]`` (``problem``: None, or why an allow-list file cannot be read).

    Args:
        keep_bad: list an allow-list file that is no key of a client (a name that is no
            ``<role>.<name>.key``, an empty or corrupt file) as a row with its ``problem`` (its
            role and name as far as its name tells, else ``"?"``; ``public`` empty), after the
            good ones; without it such a file raises.

    Raises:
        KeysError: ``DIR`` is no keys directory; without ``keep_bad``, a bad allow-list file
            (named, as the coordinator names it when it loads the allow-list).
    """
    d = pathlib.Path(directory)
    _require_keys_dir(d)
    out = []
    for f in sorted((d / "clients").glob("*.key")):
        stem = f.name[: -len(".key")]
        role, _, name = stem.partition(".")
        try:
            p = Principal.parse(stem)
            pub = read_public_key(f)
        except KeysError as exc:
            why = str(exc).removeprefix(f"{f}: ")
            if not keep_bad:
                raise KeysError(f"allow-list file {f}: {why}") from None
            out.append(
                {
                    "principal": stem,
                    "role": role if role in ROLES else "?",
                    "name": name or stem,
                    "public": "",
                    "has_secret": (d / f"{stem}.key_secret").is_file(),
                    "problem": why,
                }
            )
            continue
        out.append(
            {
                "principal": p.id,
                "role": p.role,
                "name": p.name,
                "public": pub.decode(),
                "has_secret": (d / f"{p.id}.key_secret").is_file(),
                "problem": None,
            }
        )
    out.sort(key=lambda r: (r["problem"] is not None, ROLES.index(r["role"]) if r["role"] in ROLES else 0, r["name"]))
    return out


def load_server_keys(directory: str | os.PathLike) -> ServerKeys:
    """The coordinator's keys and allow-list from ``DIR``.

    Raises:
        KeysError: no ``server.key_secret``, or a malformed certificate file.
    """
    d = pathlib.Path(directory)
    sec_file = d / "server.key_secret"
    if not sec_file.is_file():
        raise KeysError(f"{d} has no server.key_secret: create keys with `spotlight keys init {shlex.quote(str(d))}`")
    try:
        pub, sec = zmq.auth.load_certificate(sec_file)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{sec_file}: {exc}") from None
    if not sec:
        raise KeysError(f"{sec_file} holds no secret key")
    keys = ServerKeys(pub, sec, {}, d)
    reload_allow_list(keys)
    return keys


def reload_allow_list(keys: ServerKeys) -> None:
    """Re-read the allow-list ``DIR/clients/*.key``; ephemeral (in-memory) keys are kept.

    Raises:
        KeysError: a malformed file name or certificate.
    """
    if keys.directory is None:
        return
    in_memory = {k: p for k, p in keys.allowed.items() if p.ephemeral}
    allowed: dict[bytes, Principal] = {}
    for f in sorted((keys.directory / "clients").glob("*.key")):
        try:
            principal = Principal.parse(f.name[: -len(".key")])
            pub = read_public_key(f)
        except KeysError as exc:
            raise KeysError(f"allow-list file {f}: {str(exc).removeprefix(f'{f}: ')}") from None
        allowed[pub] = principal
    allowed.update(in_memory)
    keys.allowed = allowed


def load_client_keys(directory: str | os.PathLike, *, name: str | None = None, role: str | None = None) -> ClientKeys:
    """A client's keys from ``DIR``: ``server.key`` plus one ``<role>.<name>.key_secret``.

    Args:
        name: the principal (``agent.spot-7``) or just its name; needed when ``DIR`` holds
            several client secrets of the wanted role.
        role: only consider secrets of this role.

    Raises:
        KeysError: no server key, no matching secret, or several and no ``name``.
    """
    d = pathlib.Path(directory)
    server = d / "server.key"
    if not server.is_file():
        raise KeysError(
            f"{d} has no server.key (the coordinator's public key): copy it from the coordinator's keys directory"
        )
    secrets_ = [f for f in sorted(d.glob("*.key_secret")) if f.name != "server.key_secret"]
    cands, other_roles = [], []
    for f in secrets_:
        try:
            p = Principal.parse(f.name[: -len(".key_secret")])
        except KeysError:
            continue
        if name is not None and name not in (p.id, p.name):
            continue
        if role is not None and p.role != role:
            if name is not None:  # the key asked for by name exists, for another role
                other_roles.append(p)
            continue
        cands.append((p, f))
    want = f" of role {role!r}" if role else ""
    if not cands and other_roles:  # the named key exists, for another role
        found = other_roles[0]
        can = {
            "agent": "it joins as a spot agent (without --reserved)",
            "reserved": "it joins as the reserved agent (with --reserved)",
            "status": "a status key only reads a run's status (spotlight status); it cannot join",
            "trainer": "a trainer key is for Train Workers (--external-trainers); it cannot join",
        }.get(found.role, f"its role is {found.role!r}")
        raise KeysError(f"{d}: {found.id} is a key of role {found.role!r}, not {role!r}: {can}")
    if not cands:
        hint = f" named {name!r}" if name else ""
        r = role or "agent"
        if (d / "server.key_secret").is_file():  # the coordinator's own keys directory
            how = f"create one with `spotlight keys add {shlex.quote(str(d))} {r} NAME` (it writes the secret here)"
        else:  # a client's: keys are made where the coordinator's keys live
            how = (
                f"create one on the coordinator's machine with `spotlight keys add COORDINATOR_KEYS {r} NAME` "
                "(COORDINATOR_KEYS: the "
                "coordinator's keys directory, the one holding server.key_secret; it does not work on this one) "
                f"and copy the {r}.NAME.key_secret it prints here"
            )
        raise KeysError(f"{d} holds no client secret key{want}{hint} (<role>.<name>.key_secret): {how}")
    if len(cands) > 1:
        raise KeysError(
            f"{d} holds several client keys{want} ({', '.join(p.id for p, _ in cands)}): choose one with --key"
        )
    principal, f = cands[0]
    spub = read_public_key(server)  # a corrupt copy named as such, not as the client's key
    try:
        pub, sec = zmq.auth.load_certificate(f)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{f}: {exc}") from None
    if not sec:
        raise KeysError(f"{f} holds no secret key")
    return ClientKeys(spub, pub, sec, principal)


def ephemeral_client(keys: ServerKeys, role: str, name: str) -> ClientKeys:
    """A key pair that exists only in this process's memory, allow-listed on ``keys``
    (the coordinator's own Train Workers get one per run, passed through a 0600 file)."""
    pub, sec = zmq.curve_keypair()
    principal = Principal(role, _check_name(name), ephemeral=True)
    keys.allowed[pub] = principal
    return ClientKeys(keys.public, pub, sec, principal)


def write_client_file(path: pathlib.Path, ck: ClientKeys) -> None:
    """Write ``ck`` as ``{"server": z85, "public": z85, "secret": z85, "principal": id}`` (mode 0600)."""
    import json

    old = os.umask(0o077)
    try:
        path.write_text(
            json.dumps(
                {
                    "server": ck.server_public.decode(),
                    "public": ck.public.decode(),
                    "secret": ck.secret.decode(),
                    "principal": ck.principal.id,
                }
            )
        )
    finally:
        os.umask(old)
    _private(path)


def read_client_file(path: str | os.PathLike) -> ClientKeys:
    """Inverse of :func:`write_client_file`.

    Raises:
        KeysError: missing or malformed file.
    """
    import json

    try:
        d = json.loads(pathlib.Path(path).read_text())
        return ClientKeys(
            d["server"].encode(), d["public"].encode(), d["secret"].encode(), Principal.parse(d["principal"])
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeysError(f"client key file {path}: {exc}") from None


def apply_client(sock: zmq.Socket, ck: ClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server ``ck.server_public`` (before ``connect``)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, ck.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, ck.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, ck.secret)


def apply_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make ``sock`` a CURVE server checked by the ZAP handler (before ``bind``)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


class _AllowList:
    """ZAP credentials provider: a client key is accepted iff it is on the allow-list."""

    def __init__(self, keys: ServerKeys):
        self.keys = keys
        self.denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = bytes(key) in self.keys.allowed
        if not ok:
            with self._lock:
                self.denied += 1
        return ok


class Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler thread (RFC 27) with Spotlight's allow-list.

    Accepted connections carry the client's principal (``<role>.<name>``) as the ZMTP
    ``User-Id`` of every message they send, which the coordinator reads to authorize.
    """

    def __init__(self, context: zmq.Context, keys: ServerKeys):
        super().__init__(context)
        self.keys = keys
        self.provider = _AllowList(keys)

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.provider)

    def curve_user_id(self, client_public_key: bytes) -> str:
        p = self.keys.allowed.get(zmq.utils.z85.encode(client_public_key))
        return p.id if p is not None else "unknown"
