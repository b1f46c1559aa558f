"""Deployment: the embedded launcher, and later the Kubernetes manifests, compose file and images."""
