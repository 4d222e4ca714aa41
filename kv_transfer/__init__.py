"""KV transfer between engines: the connector seam (base.py, which imports nothing of the
engine) and its NIXL implementation (nixl_scheduler.py, nixl_connector.py, reachability.py)."""
