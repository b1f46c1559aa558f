"""Pure logic and the contract shared by every goodput service."""
