"""The algorithm: model slices, KV cache, token tree, stage runtime, decoding loops."""
