"""Fault injection: a policy that fails one round, and the suite that disturbs a replay (docs/chaos.md)."""
