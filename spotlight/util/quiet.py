"""Keep library loading bars off a console that shows the product's own progress lines."""

from __future__ import annotations

import os


def hide_loading_bars() -> None:
    """Turn off the progress bars that huggingface_hub, transformers ("Loading weights") and
    diffusers draw while loading a model: a console that prints the product's own progress
    lines would otherwise interleave them. Also set for child processes started after this
    call, unless the caller's environment chose otherwise."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass
    try:
        import diffusers

        diffusers.utils.logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass
