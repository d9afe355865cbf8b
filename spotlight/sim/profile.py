"""Simulation profiles: what a denoising step, a training iteration, a weight sync and a
reconfiguration cost on a given model and GPU, and how many iterations each policy needs.

A profile is a TOML file (see ``profiles/qwen-image-h100.toml``, which documents the source
of every number). :func:`load_profile` validates it into a :class:`SimProfile`; every
mistake is a :class:`ProfileError` naming the field.
"""

from __future__ import annotations

import math
import pathlib
import re
import tomllib
from dataclasses import dataclass, field

from spotlight.core.planner import StepOption
from spotlight.errors import SpotlightError
from spotlight.util.text import decode_utf8

__all__ = ["DEFAULT_PROFILE", "ProfileError", "SimProfile", "load_profile", "set_iterations_to_target"]

DEFAULT_PROFILE = pathlib.Path(__file__).resolve().parent / "profiles" / "qwen-image-h100.toml"
KNOWN_POLICIES = frozenset({"spotlight", "rlboost", "rlboost+explore", "verl-omni-spot", "reserved-only"})


class ProfileError(SpotlightError):
    """A simulation profile is missing a field or has an impossible value."""


@dataclass(frozen=True)
class SimProfile:
    """Costs and setup of one simulated job (units in the names; see the shipped TOML).

    ``step_gpu_s`` is GPU-seconds of one denoising step of one sequence on an ideal GPU; a
    worker of SP degree k takes ``step_gpu_s / (k * sp_efficiency[k])`` seconds per step.
    """

    name: str
    prompts_per_iteration: int
    group_size: int
    num_control_prompts: int
    num_steps: int
    batch_size: int
    step_gpu_s: float
    sp_efficiency: dict[int, float]
    cached_step_cost: float
    train_time_s: float
    train_gpus: int
    train_scaling_efficiency: float
    weight_sync_s: float
    engine_restart_s: float
    elastic_join_s: float
    elastic_revoke_s: float
    node_start_s: float
    commit_s: float
    reward_s: float
    step_options: list[StepOption]
    max_sequences: int
    sequence_step: int
    min_effective_steps: float
    min_exploration_accuracy: float
    beta: float
    best_of_n: int
    reserved_gpus: int
    reserved_sp: int
    spot_nodes: int
    gpus_per_spot_node: int
    spot_sp: int
    reserved_only_gpus: int
    notice_s: float
    spot_usd_per_gpu_hour: float
    reserved_usd_per_gpu_hour: float
    iterations_to_target: dict[str, int] = field(default_factory=dict)
    source: str = ""

    def step_s(self, sp: int) -> float:
        """Seconds per denoising step of one sequence on a worker of SP degree ``sp``.

        Raises:
            ProfileError: no efficiency for that degree.
        """
        eff = self.sp_efficiency.get(sp)
        if eff is None:
            raise ProfileError(f"{self.source}: timing.sp_efficiency has no entry for SP degree {sp}")
        return self.step_gpu_s / (sp * eff)

    def train_s(self, gpus: int) -> float:
        """Training time of one iteration on ``gpus`` reserved GPUs (linear scaling × efficiency)."""
        if gpus == self.train_gpus:
            return self.train_time_s
        return (
            self.train_time_s
            * self.train_gpus
            / gpus
            / (self.train_scaling_efficiency if gpus > self.train_gpus else 1.0)
        )

    def sequence_cost_steps(self, effective_steps: float) -> float:
        """Full-step equivalents of one sequence that computes ``effective_steps`` of
        ``num_steps`` steps (skipped steps cost ``cached_step_cost`` each)."""
        return effective_steps + self.cached_step_cost * max(0.0, self.num_steps - effective_steps)


def _get(d: dict, section: str, key: str, kind, where: str, *, positive: bool = True):
    sec = d.get(section)
    if not isinstance(sec, dict) or key not in sec:
        raise ProfileError(f"{where}: missing [{section}] {key}")
    v = sec[key]
    if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
        raise ProfileError(f"{where}: [{section}] {key} must be an integer, got {v!r}")
    if kind is float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ProfileError(f"{where}: [{section}] {key} must be a finite number, got {v!r}")
        v = float(v)
    if positive and kind in (int, float) and v <= 0:
        raise ProfileError(f"{where}: [{section}] {key} must be > 0, got {v!r}")
    if not positive and kind in (int, float) and v < 0:
        raise ProfileError(f"{where}: [{section}] {key} must be >= 0, got {v!r}")
    return v


PROFILE_KEYS = {
    "workload": ("prompts_per_iteration", "group_size", "num_control_prompts", "num_steps", "batch_size"),
    "timing": (
        "step_gpu_s",
        "sp_efficiency",
        "cached_step_cost",
        "train_time_s",
        "train_gpus",
        "train_scaling_efficiency",
        "weight_sync_s",
        "engine_restart_s",
        "elastic_join_s",
        "elastic_revoke_s",
        "node_start_s",
        "commit_s",
        "reward_s",
    ),
    "exploration": (
        "step_options",
        "max_sequences",
        "sequence_step",
        "min_effective_steps",
        "min_exploration_accuracy",
        "beta",
        "best_of_n",
    ),
    "cluster": (
        "reserved_gpus",
        "reserved_sp",
        "spot_nodes",
        "gpus_per_spot_node",
        "spot_sp",
        "reserved_only_gpus",
        "notice_s",
    ),
    "prices": ("spot_usd_per_gpu_hour", "reserved_usd_per_gpu_hour"),
}  # every key of these sections is required and no other is read

PROFILE_SECTIONS = (
    "workload",
    "timing",
    "exploration",
    "cluster",
    "prices",
)  # required; [iterations_to_target] optional


def _check_sections(d: dict, where: str) -> None:
    """A file with tables a profile does not have (a run config's [model], [run], ...) or
    without a profile's sections is not a simulation profile: say so, not which key is off."""
    known = (*PROFILE_SECTIONS, "iterations_to_target")
    unknown = [k for k, v in d.items() if isinstance(v, dict) and k not in known]
    missing = [k for k in PROFILE_SECTIONS if k not in d]
    if not unknown and not missing:
        return
    what = "; ".join(
        part
        for part in (
            f"unknown section(s) {', '.join(f'[{k}]' for k in unknown)}" if unknown else "",
            f"missing section(s) {', '.join(f'[{k}]' for k in missing)}" if missing else "",
        )
        if part
    )
    hint = (
        " (a run config? --profile takes a simulation profile such as spotlight/sim/profiles/qwen-image-h100.toml)"
        if {"model", "run", "train", "sampler"} & set(unknown)
        else ""
    )
    raise ProfileError(f"{where}: not a simulation profile: {what}{hint}")


def load_profile(path: str | pathlib.Path = DEFAULT_PROFILE) -> SimProfile:
    """Read and validate a simulation profile TOML.

    Raises:
        ProfileError: unreadable file, bad TOML, a missing field or an impossible value.
    """
    path = pathlib.Path(path)
    where = str(path)
    try:
        d = tomllib.loads(decode_utf8(path.read_bytes(), where))  # a byte-order mark is dropped, as in configs
    except OSError as exc:
        raise ProfileError(f"cannot read profile {where}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{where}: not valid TOML: {exc}") from None
    except ValueError as exc:  # not UTF-8 (decode_utf8 names the line)
        raise ProfileError(f"{exc}; TOML files are UTF-8") from None
    for section in ("workload", "timing", "exploration", "cluster", "prices", "iterations_to_target"):
        if section in d and not isinstance(d[section], dict):
            raise ProfileError(f"{where}: [{section}] must be a table, got {type(d[section]).__name__}")
    _check_sections(d, where)
    _check_keys(d, where)
    g = lambda s, k, kind=float, positive=True: _get(d, s, k, kind, where, positive=positive)
    eff = _sp_efficiency(d, where)
    opts = _step_options(d, where)
    its = _iterations_to_target(d, where)
    p = SimProfile(
        name=str(d.get("name", path.stem)),
        prompts_per_iteration=g("workload", "prompts_per_iteration", int),
        group_size=g("workload", "group_size", int),
        num_control_prompts=g("workload", "num_control_prompts", int, positive=False),
        num_steps=g("workload", "num_steps", int),
        batch_size=g("workload", "batch_size", int),
        step_gpu_s=g("timing", "step_gpu_s"),
        sp_efficiency=eff,
        cached_step_cost=g("timing", "cached_step_cost", positive=False),
        train_time_s=g("timing", "train_time_s"),
        train_gpus=g("timing", "train_gpus", int),
        train_scaling_efficiency=g("timing", "train_scaling_efficiency"),
        weight_sync_s=g("timing", "weight_sync_s", positive=False),
        engine_restart_s=g("timing", "engine_restart_s", positive=False),
        elastic_join_s=g("timing", "elastic_join_s", positive=False),
        elastic_revoke_s=g("timing", "elastic_revoke_s", positive=False),
        node_start_s=g("timing", "node_start_s", positive=False),
        commit_s=g("timing", "commit_s", positive=False),
        reward_s=g("timing", "reward_s", positive=False),
        step_options=opts,
        max_sequences=g("exploration", "max_sequences", int),
        sequence_step=g("exploration", "sequence_step", int),
        min_effective_steps=g("exploration", "min_effective_steps"),
        min_exploration_accuracy=g("exploration", "min_exploration_accuracy", positive=False),
        beta=g("exploration", "beta", positive=False),
        best_of_n=g("exploration", "best_of_n", int),
        reserved_gpus=g("cluster", "reserved_gpus", int),
        reserved_sp=g("cluster", "reserved_sp", int),
        spot_nodes=g("cluster", "spot_nodes", int),
        gpus_per_spot_node=g("cluster", "gpus_per_spot_node", int),
        spot_sp=g("cluster", "spot_sp", int),
        reserved_only_gpus=g("cluster", "reserved_only_gpus", int),
        notice_s=g("cluster", "notice_s", positive=False),
        spot_usd_per_gpu_hour=g("prices", "spot_usd_per_gpu_hour"),
        reserved_usd_per_gpu_hour=g("prices", "reserved_usd_per_gpu_hour"),
        iterations_to_target=its,
        source=where,
    )
    _check_profile(p, where)
    return p


def _unknown_key_hint(key: str, keys: tuple[str, ...]) -> str:
    """What to say after an unknown ``key`` of a table whose keys are ``keys``: the key it was
    probably meant to be, else the keys there are."""
    import difflib

    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return f"; did you mean {near[0]}?" if near else f" (the keys are {', '.join(keys)})"


def _check_keys(d: dict, where: str) -> None:
    """A key the simulator does not read (a misspelling, a key in the wrong section, a key that
    TOML put in the table above it) is refused, naming the key it was probably meant to be,
    instead of being ignored."""

    def owner(key: str) -> str | None:
        return next((s for s, ks in PROFILE_KEYS.items() if key in ks), None)

    for key in d:
        if key != "name" and not isinstance(d[key], dict):
            hint = f"; it belongs in [{owner(key)}]" if owner(key) else ' (only name = "..." and tables)'
            raise ProfileError(f"{where}: unknown top-level key {key!r}{hint}")
    for key in d.get("iterations_to_target", {}):
        if owner(key) or key == "name":
            home = f"[{owner(key)}]" if owner(key) else "the top of the file"
            raise ProfileError(
                f"{where}: [iterations_to_target] has {key!r}, which belongs in {home}: a key written below "
                "the [iterations_to_target] header is part of that table"
            )
    for section, keys in PROFILE_KEYS.items():
        for key in d[section]:
            if key in keys:
                continue
            hint = f"; it belongs in [{owner(key)}]" if owner(key) else _unknown_key_hint(key, keys)
            raise ProfileError(f"{where}: [{section}] unknown key {key!r}{hint}")


def _sp_efficiency(d: dict, where: str) -> dict[int, float]:
    """``[timing] sp_efficiency``: SP degree → parallel efficiency in (0, 1]."""
    eff_raw = d.get("timing", {}).get("sp_efficiency")
    if not isinstance(eff_raw, dict) or not eff_raw:
        raise ProfileError(f"{where}: [timing] sp_efficiency must be a table like {{ 1 = 1.0, 2 = 0.9 }}")
    try:
        pairs = [(int(k), float(v)) for k, v in eff_raw.items()]
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: [timing] sp_efficiency keys must be SP degrees and values numbers") from None
    eff = dict(pairs)
    if len(eff) < len(pairs):  # "2" and "02" are one degree: which one counts would be silent
        twice = next(k for k, _ in pairs if sum(1 for j, _ in pairs if j == k) > 1)
        raise ProfileError(f"{where}: [timing] sp_efficiency gives SP degree {twice} twice")
    if any(k < 1 or not (0 < v <= 1.0) for k, v in eff.items()):
        raise ProfileError(f"{where}: [timing] sp_efficiency: degrees >= 1 and efficiencies in (0, 1]")
    return eff


def _step_options(d: dict, where: str) -> list[StepOption]:
    """``[exploration] step_options``: the Planner's cache thresholds, a non-empty list."""
    opts_raw = d.get("exploration", {}).get("step_options")
    if not isinstance(opts_raw, list) or not opts_raw:
        raise ProfileError(f"{where}: [exploration] step_options must be a non-empty list")
    fields = ("cache_threshold", "effective_steps", "accuracy")
    for i, o in enumerate(opts_raw):
        extra = sorted(set(o) - set(fields)) if isinstance(o, dict) else []
        if extra:
            hint = _unknown_key_hint(extra[0], fields)
            raise ProfileError(f"{where}: [exploration] step_options entry {i + 1}: unknown key {extra[0]!r}{hint}")
    try:
        opts = [
            StepOption(float(o["cache_threshold"]), float(o["effective_steps"]), float(o["accuracy"])) for o in opts_raw
        ]
    except KeyError as exc:
        raise ProfileError(
            f"{where}: [exploration] step_options: every entry needs cache_threshold, effective_steps "
            f"and accuracy (missing {exc})"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{where}: [exploration] step_options: each entry is a table of numbers ({exc})") from None
    return opts


def _iterations_to_target(d: dict, where: str) -> dict[str, int]:
    """``[iterations_to_target]``: policy → iterations (integers >= 1); may be absent."""
    its_raw = d.get("iterations_to_target", {})
    if not isinstance(its_raw, dict):
        raise ProfileError(f"{where}: [iterations_to_target] must be a table policy = iterations")
    its = {}
    for k, v in its_raw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ProfileError(f"{where}: [iterations_to_target] {k} must be an integer >= 1, got {v!r}")
        its[k] = v
    return its


_HEADER = re.compile(r"\s*\[\s*iterations_to_target\s*\]\s*(#.*)?")
_KEY_LINE = re.compile(r'\s*("?)([A-Za-z0-9_+\-]+)\1\s*=')


def set_iterations_to_target(text: str, values: dict[str, tuple[int, str]], comments: list[str], mark: str) -> str:
    """A profile's text with ``[iterations_to_target]`` set to ``values`` (``{policy:
    (iterations, note)}``, the note becoming the line's comment) and ``comments`` (lines without
    ``#``) at the top of the table, each starting ``# {mark}``. Earlier comment lines that start
    ``# {mark}`` are dropped, so rewriting twice leaves one set; the table's other lines and every
    other section stay byte for byte. A profile without the table gets one at the end. Pure.

    Raises:
        ProfileError: an unknown policy, or a value that is not an integer >= 1.
    """
    for policy, (n, _) in values.items():
        if policy not in KNOWN_POLICIES:
            raise ProfileError(f"[iterations_to_target]: unknown policy {policy!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ProfileError(f"[iterations_to_target] {policy} must be an integer >= 1, got {n!r}")
    nl = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)

    def key(policy: str) -> str:
        return policy if re.fullmatch(r"[A-Za-z0-9_\-]+", policy) else f'"{policy}"'

    def entry(policy: str) -> str:
        n, note = values[policy]
        return f"{f'{key(policy)} = {n}':<24}# {note}{nl}" if note else f"{key(policy)} = {n}{nl}"

    notes = [f"# {mark}{c}{nl}" for c in comments]
    head = next((i for i, line in enumerate(lines) if _HEADER.fullmatch(line.rstrip("\r\n"))), None)
    if head is None:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += nl
        return "".join([*lines, nl, f"[iterations_to_target]{nl}", *notes, *(entry(p) for p in values)])
    if not lines[head].endswith("\n"):
        lines[head] += nl
    end = next((i for i in range(head + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    body = [line for line in lines[head + 1 : end] if not line.lstrip().startswith(f"# {mark}")]
    seen, keyed = set(), []
    for i, line in enumerate(body):
        m = _KEY_LINE.match(line)
        if m:
            keyed.append(i)
            if m.group(2) in values:
                seen.add(m.group(2))
                ending = line[len(line.rstrip("\r\n")) :] or nl
                body[i] = entry(m.group(2)).rstrip("\r\n") + ending
    last = keyed[-1] + 1 if keyed else len(body)
    if last and not body[last - 1].endswith("\n"):
        body[last - 1] += nl
    first = keyed[0] if keyed else last
    body[last:last] = [entry(p) for p in values if p not in seen]
    body[first:first] = notes
    return "".join([*lines[: head + 1], *body, *lines[end:]])


def _check_profile(p: SimProfile, where: str) -> None:
    """The checks that relate fields of a built profile to each other."""
    if p.num_control_prompts >= p.prompts_per_iteration:
        raise ProfileError(f"{where}: [workload] num_control_prompts must be < prompts_per_iteration")
    if p.group_size % 2:
        raise ProfileError(f"{where}: [workload] group_size must be even (top/bottom K/2 selection)")
    if p.cached_step_cost > 1:
        raise ProfileError(f"{where}: [timing] cached_step_cost is a fraction of a full step (<= 1)")
    for sp in {p.reserved_sp, p.spot_sp, 1}:
        p.step_s(sp)
    if p.reserved_gpus % p.reserved_sp or p.reserved_only_gpus % p.reserved_sp:
        raise ProfileError(f"{where}: [cluster] reserved_gpus and reserved_only_gpus must be multiples of reserved_sp")
    check_cluster(p)
    if any(o.effective_steps > p.num_steps for o in p.step_options):
        raise ProfileError(
            f"{where}: [exploration] step_options: effective_steps cannot exceed [workload] num_steps = {p.num_steps}"
        )
    if not any(
        o.effective_steps >= p.min_effective_steps and o.accuracy >= p.min_exploration_accuracy for o in p.step_options
    ):
        raise ProfileError(
            f"{where}: [exploration] no step option has effective_steps >= min_effective_steps "
            "and accuracy >= min_exploration_accuracy"
        )
    if p.max_sequences <= p.group_size:
        raise ProfileError(f"{where}: [exploration] max_sequences must be > group_size (d <= K selects nothing)")
    if p.best_of_n <= p.group_size:
        raise ProfileError(
            f"{where}: [exploration] best_of_n must be > group_size ({p.group_size}): best-of-N keeps K of N candidates"
        )
    unknown = sorted(set(p.iterations_to_target) - KNOWN_POLICIES)
    if unknown:
        raise ProfileError(
            f"{where}: [iterations_to_target] unknown policy {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(KNOWN_POLICIES))}"
        )


def check_cluster(p: SimProfile) -> None:
    """The spot layout can host its SP groups.

    Raises:
        ProfileError: ``spot_sp`` larger than ``gpus_per_spot_node``.
    """
    if p.spot_sp > p.gpus_per_spot_node:
        raise ProfileError(
            f"{p.source}: SP degree {p.spot_sp} needs at least {p.spot_sp} GPUs per spot node "
            f"(got {p.gpus_per_spot_node})"
        )
