"""What the front and the core both import: the typed messages between them and the plain
data both sides read (configuration, sampling parameters, errors, statistics, KV events,
block hashes, tokenizer files). Nothing here imports torch, NIXL or the model code."""
