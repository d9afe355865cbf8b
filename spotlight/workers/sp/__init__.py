"""Sequence-parallel Rollout Worker groups (paper §4.4.2): group members, the group worker
process, and the rendezvous they rebuild on every SP change."""
