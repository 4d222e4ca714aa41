"""The KV connector interface (and, later, its NIXL implementation)."""
