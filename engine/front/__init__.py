"""The front half of an engine (the server's process): its client of the engine core, and the
input and output processing around it (validation and tokenization, detokenization and stop
strings). It imports neither torch nor NIXL nor the model code."""
