"""Generated protobuf and gRPC code for the baton.v1 API (./dev proto); do not edit."""
