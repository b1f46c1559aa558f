"""A job that only tells what it was given: its environment as JSON on stderr (its log), then its
outcome (the security test reads the log: no NATS credential may be there)."""

import json
import os
import sys

from goodput_train.protocol import OUTCOME_PREFIX

GOODPUT_JOB = True

if __name__ == "__main__":
    print(json.dumps(dict(os.environ)), file=sys.stderr, flush=True)
    print(OUTCOME_PREFIX + json.dumps({"stopped": False}), flush=True)
