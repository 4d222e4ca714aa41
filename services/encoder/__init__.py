"""The encoder tier (E/P/D): a vision-language model's image encoder alone, whose embeddings a
prefill reads over NIXL instead of reading and encoding the images itself."""
