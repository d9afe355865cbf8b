class SpotlightError(Exception):
    """Base class for user-facing errors."""
