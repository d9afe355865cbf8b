"""Small helpers shared by every process: logging and child processes, plots, the CLI runner."""
