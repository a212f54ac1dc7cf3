"""Training: data recipe, verifiable tasks and the training loop for small DeepSeek-V4 models."""
