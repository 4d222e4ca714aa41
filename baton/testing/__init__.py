"""What the tests and benchmarks make for themselves (tiny checkpoints), installed with Baton so
`baton prepare-models` can write them too."""
