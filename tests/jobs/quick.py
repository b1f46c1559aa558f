"""A good job for the bad-input test: the example MLP, 2 epochs."""

import sys

from examples.jobs.mlp_blobs import main

GOODPUT_JOB = True

if __name__ == "__main__":
    main(["--epochs", "2", *sys.argv[1:]])
