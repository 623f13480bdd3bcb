"""The CPU peers' runners (each run by cpu_peers.py in the peer's own venv) and what they
share with it (timing.py, standard library only)."""
