#!/bin/sh
# The images' entrypoint: GOODPUT_SERVICE=<name> runs that service with the container's arguments;
# without it, the arguments are the command to run (e.g. `goodput submit job.yaml`).
# GOODPUT_SERVICE=executor with GOODPUT_EXECUTORS=simulated runs the simulated executors
# (`python -m services.simulated`: a whole simulated cluster on a virtual clock); GOODPUT_SERVICE=node
# runs a node agent (`python -m services.node`).
set -e
if [ -n "${GOODPUT_SERVICE:-}" ]; then
    case "$GOODPUT_SERVICE" in
        api|profiler|estimator|policy|placer|executor|node) ;;
        *) echo "entrypoint: GOODPUT_SERVICE=$GOODPUT_SERVICE is not a service (api, profiler, estimator, policy, placer, executor, node)" >&2
           exit 64 ;;
    esac
    if [ "$GOODPUT_SERVICE" = executor ] && [ "${GOODPUT_EXECUTORS:-}" = simulated ]; then
        exec python -m services.simulated "$@"
    fi
    exec python -m "services.$GOODPUT_SERVICE" "$@"
fi
if [ "$#" -eq 0 ]; then
    echo "entrypoint: set GOODPUT_SERVICE to api, profiler, estimator, policy, placer, executor or node, or give a command" >&2
    exit 64
fi
exec "$@"
