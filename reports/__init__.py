"""Offline reports over the reference data."""
