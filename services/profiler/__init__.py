"""The profiler service (`python -m services.profiler`): service.py judges each stored submission
and bootstraps its profiles; measure.py profiles a job's own script on a node."""
