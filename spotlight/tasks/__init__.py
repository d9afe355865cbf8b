"""Tasks: prompt sets and the embedded shapes task (world, reward, base model, evaluation)."""
