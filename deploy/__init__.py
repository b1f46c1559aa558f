"""Deployment: the embedded launcher (nats.py, stack.py), the probe and live-run modules the
deployed stack runs (probe.py, live_run.py), the container images (docker/), the Kubernetes
manifests (k8s/) and the compose file (compose.yaml); docs/deploy.md says how to use them."""
