"""Training drafters from the shard store; `python -m draftflow.train` is the torchrun entry point."""
