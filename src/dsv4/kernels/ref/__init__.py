"""Pure-PyTorch reference ops: the executable form of docs/model-spec.md."""
