"""The executor service over real jobs (`python -m services.executor`): real.py answers the round's
requests, local.py keeps each job's workers on the node agents, progress.py tells a job's progress."""
