#!/bin/bash
# Rehearse this recipe on this machine: its own commands, coordinator and agents on localhost,
# 2 iterations of the embedded default (deploy/rehearse.py says what is swapped in).
#   deploy/skypilot/rehearse.sh [--preempt] [--work-dir DIR] [--iterations N]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/_venv.sh"
exec python "$ROOT/deploy/rehearse.py" skypilot "$@"
