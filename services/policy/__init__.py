"""The policy service: core.py decides, service.py moves messages."""
