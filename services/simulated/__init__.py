"""The simulated executors: jobs on a virtual clock, as the executor service (`python -m services.simulated`)."""
