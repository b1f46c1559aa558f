"""Deployment: the probe the deployed services run (probe.py), the container images (docker/), the
Kubernetes manifests (k8s/) and the compose file (compose.yaml); docs/deploy.md says how to use
them. The process launcher behind `goodput up` is `launcher/`."""
