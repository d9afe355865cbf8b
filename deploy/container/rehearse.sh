#!/bin/bash
# Rehearse the container recipe on this machine: build the CPU image and run the embedded default
# in it (2 iterations, coordinator and agents in one container, keys made inside it). Needs
# docker (or podman as `DOCKER=podman`) and the network for the build; without docker it says so
# and exits 0. The cluster recipes' rehearsals (deploy/{slurm,skypilot,kubernetes}/rehearse.sh)
# run the same commands without a container.
#   deploy/container/rehearse.sh [IMAGE_TAG]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DOCKER=${DOCKER:-docker}
TAG=${1:-spotlight:cpu-rehearsal}
if ! command -v "$DOCKER" >/dev/null; then
  echo "no $DOCKER on this machine: nothing rehearsed (set DOCKER=podman to use podman)"
  exit 0
fi
"$DOCKER" build -f "$ROOT/deploy/container/Dockerfile.cpu" -t "$TAG" "$ROOT"
"$DOCKER" run --rm "$TAG" python -c "import agent.main, spotlight.cli"  # both entry points import
"$DOCKER" run --rm "$TAG" spotlight up --local --iterations 2 --agents 1 --run-dir /var/lib/spotlight/run/rehearsal
echo "rehearsal of deploy/container: ok"
