"""The placer service (`python -m services.placer`): core.py picks physical GPUs for the policy's
allocations; service.py moves the messages."""
