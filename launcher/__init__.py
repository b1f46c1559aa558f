"""The launcher: a NATS server of its own, the storage set up, the services as processes, a replay driven."""
