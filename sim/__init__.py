"""Simulators: the round-based cluster replay and the time-slicing event model."""
