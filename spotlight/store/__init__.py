"""The Tensor Store (paper §4.5) and the formats it moves: weight versions in chunks, tensors
as raw frames, run and trainer checkpoints."""
