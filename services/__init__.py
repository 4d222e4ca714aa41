"""Baton's services and CLI."""
