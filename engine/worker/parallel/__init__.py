"""Running one engine's model over several devices (tensor_parallel.py)."""
