"""Examples: workloads, clusters, and real training jobs (`examples.jobs`) that run on CPU slots."""
