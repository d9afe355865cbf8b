"""The Eval Worker: held-out evaluation of published weight versions during training (docs/evaluation.md)."""
