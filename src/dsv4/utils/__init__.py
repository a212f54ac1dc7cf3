"""Small shared utilities (logging, ...) used across dsv4."""
