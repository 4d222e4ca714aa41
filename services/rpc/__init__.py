"""What every Baton gRPC service shares (engine servers and the router): the API's names,
serving and draining, health checks, TLS, typed failures, n-completion fan-out. Torch-free."""
