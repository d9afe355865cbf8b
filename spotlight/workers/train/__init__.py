"""Train Workers: the Flow-GRPO update under FSDP2 on the reserved GPUs."""
