"""Paper Table 2: the example configs of the paper's four setups (``examples/paper/*.toml``),
loaded through ``spotlight.config.load_config`` (so every value is the one a run would use) and
printed as the table: model, resolution, denoising steps, SDE window, learning rate, weight
decay, group size (#Seqs), prompts per iteration, β.

    python benchmarks/table2_configs.py            # < 10 s, CPU

Real scale: ``spotlight up --config examples/paper/<setup>.toml`` on a cluster's reserved node
(set ``model.pretrained_path`` and ``data.prompts_path`` to local copies first).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _provenance import provenance, provenance_line  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    # no options: --help prints the docstring and anything else is refused before the table is
    # written (before, ``--bogus`` rewrote results/table2_configs.json with it in its provenance)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from spotlight.config import EXAMPLES_DIR, load_config

    rows = []
    for path in sorted((EXAMPLES_DIR / "paper").glob("*.toml")):
        cfg = load_config(path)
        rows.append(
            {
                "setup": path.stem,
                "model": cfg.model.family,
                "resolution": cfg.model.image_size,
                "steps": cfg.sampler.num_steps,
                "sde_window": list(cfg.sampler.sde_window_range),
                "learning_rate": cfg.train.learning_rate,
                "weight_decay": cfg.train.weight_decay,
                "group_size": cfg.data.group_size,
                "prompts_per_iteration": cfg.data.prompts_per_iteration,
                "beta": cfg.planner.beta,
            }
        )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(provenance_line())
    out = REPO / "benchmarks" / "results" / "table2_configs.json"
    out.write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
