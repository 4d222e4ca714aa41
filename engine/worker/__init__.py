"""The worker half: what runs the model on a device (the model runner, models and layers,
the sampler, the checkpoint loader, grammars, LoRA). Inside the core process with one device."""
