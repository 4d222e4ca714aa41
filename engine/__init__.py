"""Baton's engine, laid out by where each part runs (a server runs two processes per engine):

- `front/`   the front process: the client of the core, input processing (validation,
             tokenization), output processing (detokenization, stop strings).
- `core/`    the engine core process: its loop, the scheduler, the KV cache managers and tiers,
             the request state.
- `worker/`  what runs the model (inside the core with one device): the model runner, models
             and layers, sampler, loader, grammars, LoRA.
- `common/`  what both processes import: the typed messages between them, configuration,
             sampling parameters, errors, statistics, KV events, tokenizer files, block hashes.
- `offline/` the `LLM` class: front, core and worker in one process, no IPC.
"""
