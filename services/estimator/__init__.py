"""The estimator service: core.py decides, service.py moves messages."""
