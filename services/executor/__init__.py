"""The executor service: core.py decides, service.py moves messages."""
