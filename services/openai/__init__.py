"""The OpenAI-compatible HTTP front of a colocated server or the router."""
