"""The `goodput` command line."""
