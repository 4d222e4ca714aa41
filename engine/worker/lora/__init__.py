"""LoRA adapters: many fine-tunes of one base model served together, in one batch."""
