"""What runs the algorithm: KV caches, stage and draft runtimes, pipelines, lockstep decoding, loading."""
