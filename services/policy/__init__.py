"""The policy service (`python -m services.policy`): rounds.py is the round loop (the simulator
drives it too), observer.py what it reports of each round (spans, records), wiring.py its stages
as requests to the services, lease.py the leadership, service.py the leader and its standbys."""
