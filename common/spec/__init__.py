"""The algorithm without I/O: token tree, sampling, messages, options, tree managers."""
