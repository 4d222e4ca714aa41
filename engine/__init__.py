"""Baton's engine: request state, scheduler, paged KV cache, model runner, sampler."""
