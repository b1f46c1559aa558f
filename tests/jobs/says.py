"""A job that prints: a line on its stdout and one on its stderr, then it trains (the example MLP,
2 epochs). Its output is what `goodput logs` shows."""

import sys

from examples.jobs.mlp_blobs import main

GOODPUT_JOB = True

if __name__ == "__main__":
    print("hello from says", flush=True)
    print("a warning from says", file=sys.stderr, flush=True)
    main(["--epochs", "2", *sys.argv[1:]])
