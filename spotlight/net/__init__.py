"""Transport and security: CURVE keys and allow-lists, the coordinator's ZeroMQ server,
HOST:PORT parsing, bounded HTTP reads, the agent's local control socket path."""
