"""RL lab runs on the shapes task (spotlight/studies/lab.py): one setting, or a sweep of settings
with several run seeds each, with held-out strict and partial scores.

    python benchmarks/rl_lab.py --iterations 20 --set train.learning_rate=3e-4 --seeds 0,1,2
    python benchmarks/rl_lab.py --sweep benchmarks/lab_sweeps/recipe.toml --out runs/lab
    python benchmarks/rl_lab.py --gradient-agreement 8 --set data.group_size=16

Each run writes ``OUT/<name>-s<seed>.json`` (rows and evaluations); the sweep ends with a table
(mean ± standard error over run seeds of the held-out gain over the base model).

``--gradient-agreement B`` learns nothing: it draws ``B`` independent batches (the run's first
``B`` iterations' prompts and seeds) at the initial weights, keeps each one's policy gradient
and reports how much of a batch gradient is signal (``spotlight.studies.lab.gradient_agreement``:
the mean pairwise cosine, and the fewest optimizer steps before an update's direction is as
much signal as noise), for the whole gradient and for each transformer block's and each
module's slice of it (where the signal is, if anywhere); it writes ``OUT/<name>-grad-s<seed>.json``
and ``OUT/gradients.md``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tomllib

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def run_gradients(name: str, overrides: dict, lab: dict, seed: int, out: pathlib.Path, batches: int) -> dict:
    """``batches`` independent policy gradients at the initial weights and their agreement."""
    from spotlight.config import load_config
    from spotlight.studies.lab import (
        LabSettings,
        cosine_matrix,
        gradient_agreement,
        gradient_agreement_by_part,
        run_lab,
    )

    explore = int(lab.get("explore", 0))
    # batch 0 is never explored (the lab explores batch n+1 while batch n trains): with
    # exploration one more batch runs and its gradient is left out
    unexplored = 1 if explore > 0 else 0
    ov = {"run.seed": seed, "data.shuffle_seed": seed, **overrides, "run.iterations": batches + unexplored}
    cfg = load_config(lab.get("config"), overrides=ov)
    settings = LabSettings(
        explore_candidates=explore, eval_every=0, threads=int(lab.get("threads", 1)), gradients_only=True
    )
    res = run_lab(cfg, settings, progress=lambda s: print(f"[{name} s{seed}] {s}", flush=True))
    gradients, rows = res.gradients[unexplored:], res.rows[unexplored:]
    doc = {
        "name": name,
        "seed": seed,
        "overrides": ov,
        "samples_per_batch": cfg.data.prompts_per_iteration * cfg.data.group_size,
        "window_steps": cfg.sampler.sde_window_size,
        "explore_candidates": explore,
        "agreement": finite_or_none(gradient_agreement(gradients)),
        "by_part": {
            part: finite_or_none(a) for part, a in gradient_agreement_by_part(gradients, res.gradient_layout).items()
        },
        "cosines": cosine_matrix(gradients).tolist(),
        "rewards": [r["reward/mean"] for r in rows],
        "seconds": res.seconds,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-grad-s{seed}.json").write_text(json.dumps(doc, indent=1))
    return doc


def finite_or_none(values: dict[str, float]) -> dict[str, float | None]:
    """NaN and infinity as JSON null (standard JSON has neither)."""
    return {k: (v if np.isfinite(v) else None) for k, v in values.items()}


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _steps(agreement: dict) -> str:
    if agreement["signal_share_upper"] == 0:
        return "inf"  # no signal within 2 standard errors
    return _fmt(agreement["steps_for_snr1_lower"], ".0f")


def summarise_gradients(docs: list[dict]) -> str:
    lines = [
        "| setting | batches × samples | pairwise cosine | halves cosine (expected) | steps for SNR 1, at least "
        "| s/batch |",
        "|---|---|---|---|---|---|",
    ]
    for d in docs:
        a = d["agreement"]
        explored = f" (explored, d = {d['explore_candidates']})" if d.get("explore_candidates") else ""
        lines.append(
            f"| {d['name']} s{d['seed']}{explored} | {int(a['num_gradients'])} × {d['samples_per_batch']} | "
            f"{a['pairwise_cos_mean']:+.4f} ± {_fmt(a['pairwise_cos_se'], '.4f')} | {a['halves_cos']:+.4f} "
            f"({_fmt(a['halves_cos_expected'], '+.4f')}) | "
            f"{_steps(a)} | "
            f"{d['seconds'] / max(a['num_gradients'], 1):.1f} |"
        )
    for d in docs:
        if not d.get("by_part"):
            continue
        lines += [
            "",
            f"{d['name']} s{d['seed']}, by block and by module (the LoRA parameters with a nonzero gradient):",
            "",
            "| part | values | share of the squared norm | pairwise cosine | halves cosine (expected) |",
            "|---|---|---|---|---|",
        ]
        for part, a in d["by_part"].items():
            lines.append(
                f"| {part} | {int(a['numel'])} | {_fmt(a['norm_share'], '.3f')} | "
                f"{a['pairwise_cos_mean']:+.4f} ± {_fmt(a['pairwise_cos_se'], '.4f')} | "
                f"{a['halves_cos']:+.3f} ({_fmt(a['halves_cos_expected'], '+.3f')}) |"
            )
    return "\n".join(lines)


LAB_KEYS = {"explore": 0, "eval_every": 0, "eval_seeds": 1, "config": None}
"""A sweep setting's keys that are the lab's, not the config's: the least each may be (None: a path)."""


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def read_sweep(path: pathlib.Path) -> dict[str, dict]:
    """The ``[setting.NAME]`` tables of a sweep file, checked.

    Raises:
        ValueError: an unreadable file, bad TOML, no ``[setting.NAME]`` table, a setting that is
            not a table, or a lab key (:data:`LAB_KEYS`) with a bad value; the message names
            the file (and the setting).
    """
    try:
        doc = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ValueError(f"--sweep {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--sweep {path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--sweep {path}: not valid TOML: {exc}") from None
    settings = doc.get("setting")
    if not isinstance(settings, dict) or not settings:
        raise ValueError(f"--sweep {path}: no settings; expected [setting.NAME] tables of dotted overrides")
    for name, table in settings.items():
        if not isinstance(table, dict):
            raise ValueError(f"--sweep {path}: setting.{name} must be a table ([setting.{name}]), not a value")
        for key, least in LAB_KEYS.items():
            if key not in table:
                continue
            value = table[key]
            ok = isinstance(value, str) if least is None else isinstance(value, int) and not isinstance(value, bool)
            if not ok or (least is not None and value < least):
                want = "a path" if least is None else f"a whole number >= {least}"
                raise ValueError(f"--sweep {path}: setting.{name}.{key} must be {want}, got {value!r}")
    return settings


def check_runs(runs: list[tuple[str, dict, dict]], seeds: list[int], *, gradients: bool, sweep: bool = False) -> str:
    """Every setting's config, built before anything runs: the first problem, or "" (named by its
    setting when ``sweep``: a sweep file's table; the command line's own settings need no name)."""
    from spotlight.config import ConfigError, load_config

    for name, overrides, lab in runs:
        where = f"setting {name!r}: " if sweep else ""
        try:
            cfg = load_config(lab.get("config"), overrides={"run.seed": seeds[0], **overrides})
        except ConfigError as exc:
            return f"{where}{exc}"
        if gradients and cfg.train.steps_per_iteration != 1:
            return (
                f"{where}--gradient-agreement keeps one gradient per whole batch; "
                f"train.steps_per_iteration must be 1, not {cfg.train.steps_per_iteration}"
            )
    return ""


def run_one(name: str, overrides: dict, lab: dict, seed: int, out: pathlib.Path, reuse: bool) -> dict:
    from spotlight.config import load_config
    from spotlight.studies.lab import LabSettings, run_lab

    path = out / f"{name}-s{seed}.json"
    if reuse and path.is_file():
        return json.loads(path.read_text())
    ov = {"run.seed": seed, "data.shuffle_seed": seed, **overrides}
    cfg = load_config(lab.get("config"), overrides=ov)
    settings = LabSettings(
        explore_candidates=int(lab.get("explore", 0)),
        eval_every=int(lab.get("eval_every", 5)),
        eval_seeds=int(lab.get("eval_seeds", 16)),
        threads=int(lab.get("threads", 1)),
    )
    res = run_lab(cfg, settings, progress=lambda s: print(f"[{name} s{seed}] {s}", flush=True))
    doc = {
        "name": name,
        "seed": seed,
        "overrides": ov,
        "lab": lab,
        "rows": res.rows,
        "evals": res.evals,
        "seconds": res.seconds,
    }
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return doc


def summarise(docs: list[dict]) -> str:
    by = {}
    for d in docs:
        by.setdefault(d["name"], []).append(d)
    lines = [
        "| setting | runs | base strict | Δ strict | Δ partial | final speckle | min/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ds in by.items():
        ds_ = [d for d in ds if d["evals"]]
        if not ds_:
            continue
        base = np.array([d["evals"][0]["strict"] for d in ds_])
        ds_strict = np.array([d["evals"][-1]["strict"] - d["evals"][0]["strict"] for d in ds_])
        ds_partial = np.array([d["evals"][-1]["partial"] - d["evals"][0]["partial"] for d in ds_])
        speck = np.array([d["evals"][-1].get("image/speckle", np.nan) for d in ds_])
        mins = np.mean([d["seconds"] for d in ds_]) / 60
        se = lambda a: a.std(ddof=1) / np.sqrt(len(a)) if len(a) > 1 else float("nan")  # noqa: E731
        lines.append(
            f"| {name} | {len(ds_)} | {base.mean():.3f} | {ds_strict.mean():+.3f} ± {se(ds_strict):.3f} | "
            f"{ds_partial.mean():+.3f} ± {se(ds_partial):.3f} | {speck.mean():.3f} | {mins:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--iterations", type=_int_at_least(1), default=20)
    ap.add_argument("--set", action="append", default=[], help="dotted config override KEY=VALUE (TOML value)")
    ap.add_argument("--explore", type=_int_at_least(0), default=0, help="candidates per explored prompt (0: none)")
    ap.add_argument("--eval-every", type=_int_at_least(0), default=5)
    ap.add_argument("--eval-seeds", type=_int_at_least(1), default=16)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--name", default="run")
    ap.add_argument("--sweep", default="", help="TOML: [setting.NAME] tables of dotted overrides (+ lab keys)")
    ap.add_argument("--out", default="runs/lab")
    ap.add_argument("--threads", type=_int_at_least(1), default=1)
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument(
        "--gradient-agreement",
        type=int,
        default=None,
        metavar="B",
        help="learn nothing: B independent batch gradients at the initial weights and how much of each is signal",
    )
    args = ap.parse_args()
    if args.gradient_agreement is not None and args.gradient_agreement < 4:
        ap.error(f"--gradient-agreement needs at least 4 batches (two halves of 2), got {args.gradient_agreement}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        ap.error(f"--seeds {args.seeds}: expected run seeds >= 0 separated by commas, e.g. --seeds 0,1,2")
    out = pathlib.Path(args.out)
    from spotlight.util.quiet import hide_loading_bars

    hide_loading_bars()  # the lab's own progress lines only
    base_ov = {"run.iterations": args.iterations}
    for item in args.set:
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            ap.error(f"--set {item}: expected KEY=VALUE, e.g. --set train.learning_rate=1e-3")
        base_ov[key.strip()] = parse_value(val)
    lab = {
        "config": args.config,
        "explore": args.explore,
        "eval_every": args.eval_every,
        "eval_seeds": args.eval_seeds,
        "threads": args.threads,
    }
    settings = {args.name: {}}
    if args.sweep:
        try:
            settings = read_sweep(pathlib.Path(args.sweep))
        except ValueError as exc:
            print(f"rl_lab.py: error: {exc}", file=sys.stderr)
            return 2
    runs = []
    for name, ov in settings.items():
        ov = dict(ov)
        lab_ov = {k: ov.pop(k) for k in list(ov) if k in LAB_KEYS}
        runs.append((name, {**base_ov, **ov}, {**lab, **lab_ov}))
    problem = check_runs(runs, seeds, gradients=args.gradient_agreement is not None, sweep=bool(args.sweep))
    if problem:
        print(f"rl_lab.py: error: {problem}", file=sys.stderr)
        return 2
    try:  # before hours of runs, not after them
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"rl_lab.py: error: --out {out}: not a writable directory ({exc.strerror or exc})", file=sys.stderr)
        return 2
    docs = []
    for name, ov, lab_ov in runs:
        for seed in seeds:
            if args.gradient_agreement is not None:
                docs.append(run_gradients(name, ov, lab_ov, seed, out, args.gradient_agreement))
            else:
                docs.append(run_one(name, ov, lab_ov, seed, out, args.reuse))
    if args.gradient_agreement is not None:
        table = summarise_gradients(docs)
        print(table)
        (out / "gradients.md").write_text(table + "\n")
        return 0
    table = summarise(docs)
    print(table)
    (out / "summary.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
