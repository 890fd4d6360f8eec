"""The algorithm without I/O: token tree, sampling, options, the request controllers."""
