"""The coordinator on the reserved node: the shell around the pure cores (sockets, trainer
processes, reward scoring, recording). Its dataflow is drawn in :mod:`spotlight.coordinator.coordinator`."""
