"""Checkpoint creation: presets, tokenizer, writer for `dsv4 init`."""
