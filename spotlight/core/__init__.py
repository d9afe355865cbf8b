"""Pure decision cores (paper §4): Request Scheduler, Planner, Instance Manager, seed bank,
iteration machine, event log, run modes. No sockets, threads, subprocesses, clocks or torch:
each takes observations and ``now`` and returns decisions (docs/architecture.md)."""
