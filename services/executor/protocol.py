"""What the executor (and the profiler) and a job's processes tell each other, besides torchrun's
environment: the variables they set for the job, and the lines the job prints for them. Kept apart
from the training library so the services can read it without importing PyTorch."""

JOB_ENV = "GOODPUT_JOB_ID"
GPU_TYPE_ENV = "GOODPUT_GPU_TYPE"
REPORT_ENV = "GOODPUT_REPORT_S"          # seconds: print JobStats that often
REPORT_EVERY_S = 30.0                    # the default for that
ADAPTIVE_ENV = "GOODPUT_ADAPTIVE"        # "0": keep the batch (a rigid job, or a policy that does not adapt)
CHECKPOINT_ENV = "GOODPUT_CHECKPOINT_S"   # seconds between periodic checkpoints (the executor's choice)
PROFILE_ENV = "GOODPUT_PROFILE"          # set: profile instead of training (services.executor.profiling)
SLOT_MEMORY_ENV = "GOODPUT_SLOT_MEMORY_MB"   # a CPU slot's memory, for the profiling run

# Lines on the job's stdout: the prefix, then a schema message as base64 msgpack (it keeps NaN).
STATS_PREFIX = "goodput-stats "          # JobStats, from rank 0
PROFILE_PREFIX = "goodput-profile "      # ProfileRun
OUTCOME_PREFIX = "goodput-outcome "      # then JSON: how the run ended ({"stopped": true} on SIGTERM)
