"""The router: the public Generate API in front of prefill and decode instances."""
