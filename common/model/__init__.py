"""The target model: config, decoder layers, checkpoint loading, stage partition, GGUF."""
