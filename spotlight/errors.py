class SpotlightError(Exception):
    """Base class for user-facing errors."""


def plural(n: int, word: str, words: str | None = None) -> str:
    """``"1 agent"``, ``"2 agents"``: a count and its noun, for user-facing messages."""
    return f"{n} {word if n == 1 else words or word + 's'}"
