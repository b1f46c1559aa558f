"""The profiler service: core.py decides, service.py moves messages."""
