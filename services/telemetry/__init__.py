"""Tracing (OpenTelemetry), metrics (Prometheus) and the terminal trace viewer."""
