"""The target model: configuration, decoder layers, checkpoint loading, stage partition, GGUF."""
