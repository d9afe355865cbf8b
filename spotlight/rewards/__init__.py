"""Reward service: the built-in scorers and the HTTP client (:mod:`.reward_fn`), and the
HTTP reward server (:mod:`.server`)."""
