# Sourced by scripts/run-local and scripts/test: create (once) and reuse .venv in the repo.
# Re-installs only when pyproject.toml changes. Torch is pinned to the CPU wheel that
# these machines carry (pip install torch==2.13.0); a GPU machine may pre-install its own
# CUDA torch >= 2.6 in .venv first, and this script leaves it alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPOTLIGHT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.spotlight-installed"
# the stamp names the checkout too: a venv shared between clones re-points at this one
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $ROOT"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing Spotlight and its dependencies into $VENV (first run only)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2 || true
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2
  echo "$WANT" > "$STAMP"
fi
# the caller's PATH, before the venv joins it: `spotlight up` tells a user whose shell lacks the
# venv's `spotlight` to activate it first (spotlight.cli.up.activate_hint)
export SPOTLIGHT_CALLER_PATH="${SPOTLIGHT_CALLER_PATH:-$PATH}"
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"
