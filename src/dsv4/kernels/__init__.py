"""Compute ops used by the model. `ref/` holds the pure-PyTorch specifications (readable, tested
against transformers); fast Triton versions with the same signatures live in `triton/`."""
