"""Offline studies that feed the Planner and the paper's insights: step-time and cache profiling,
stale-weight seed ranking (Insight 1)."""
