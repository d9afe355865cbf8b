# Sourced by scripts/test for the full suite (not --fast): a virtual environment of its own with
# SkyPilot, whose loader checks the SkyPilot recipes (tests/unit/deploy/test_recipes.py). Its own,
# because skypilot 0.14 pins click 8.1.x while huggingface-hub (under transformers and diffusers)
# needs click >= 8.4.2: the two cannot share .venv. Created once (~1 min on idle cores, 460 MB),
# re-created when the version below changes; SPOTLIGHT_SKY_VENV=DIR uses another one. If it cannot
# be created, the loader test is skipped and says so.
SKY_VENV="${SPOTLIGHT_SKY_VENV:-$ROOT/.venv-sky}"
SKYPILOT_VERSION="0.14.1"
if [ ! -x "$SKY_VENV/bin/python" ] || [ "$(cat "$SKY_VENV/.spotlight-skypilot" 2>/dev/null)" != "$SKYPILOT_VERSION" ]; then
  echo "creating $SKY_VENV with skypilot $SKYPILOT_VERSION (checks deploy/skypilot/; first run only)" >&2
  if "${PYTHON:-python3}" -m venv "$SKY_VENV" \
     && "$SKY_VENV/bin/python" -m pip install -q "skypilot==$SKYPILOT_VERSION" >&2; then
    echo "$SKYPILOT_VERSION" > "$SKY_VENV/.spotlight-skypilot"
  else
    echo "warning: could not install skypilot into $SKY_VENV; the SkyPilot loader test will be skipped" >&2
  fi
fi
if [ -f "$SKY_VENV/.spotlight-skypilot" ]; then
  export SPOTLIGHT_SKY_PYTHON="$SKY_VENV/bin/python"
fi
