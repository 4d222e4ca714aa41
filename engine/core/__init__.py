"""The engine core (its own process in a server): the loop, the scheduler, the KV cache
managers and tiers, and the state of each request."""
