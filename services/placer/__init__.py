"""The placer service: core.py decides, service.py moves messages."""
