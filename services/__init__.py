"""goodput services, one package each: core.py (pure), service.py (NATS shell)."""
