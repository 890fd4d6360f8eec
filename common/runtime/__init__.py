"""What runs the algorithm: KV caches, stage and draft runtimes, pipelines, model loading."""
