"""The user API: submit, look up, list and cancel jobs (`python -m services.api`)."""
