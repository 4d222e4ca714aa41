"""The offline engine: `LLM`, with front, core and worker in one process (no IPC)."""
