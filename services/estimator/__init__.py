"""The estimator service (`python -m services.estimator`): core.py fits each job's throughput and
gradient-noise models from profiles and observations; service.py moves the messages."""
