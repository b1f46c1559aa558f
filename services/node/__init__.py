"""The node agent (`python -m services.node --node NAME`): agent.py runs one node's workers, box.py
puts each job in a box of its own, output.py keeps what they print."""
