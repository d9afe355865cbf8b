"""Rollout Workers (paper §4.4): one GPU worker process denoising leased requests, and the
warm spare that becomes one."""
