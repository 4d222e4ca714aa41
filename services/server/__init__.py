"""The engine server: one engine core behind the public Generate API, and, as a prefill or
decode tier, the internal calls between tiers."""
