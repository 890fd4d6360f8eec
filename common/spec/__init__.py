"""The speculative decoding algorithm: token tree, sampling, messages, options and the tree managers (no I/O)."""
