"""Spot traces: file formats, replay plans, synthetic preemption cycles, the live trace driver."""
