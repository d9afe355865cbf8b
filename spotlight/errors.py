class SpotlightError(Exception):
    """Base class for user-facing errors."""


class InputError(SpotlightError, ValueError):
    """Input refused as invalid -- a prompt that fits no template, malformed prompt metadata, a
    text-rendering prompt with nothing quoted: the caller's error, not a crash of the code that
    refuses it. The reward server answers it with HTTP 400 (a scorer that crashes is a 500).
    A ``ValueError`` too, so callers that catch ``ValueError`` keep working."""


def plural(n: int, word: str, words: str | None = None) -> str:
    """``"1 agent"``, ``"2 agents"``: a count and its noun, for user-facing messages."""
    return f"{n} {word if n == 1 else words or word + 's'}"
