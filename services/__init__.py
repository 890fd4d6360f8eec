"""Network shells around the engine: gRPC services, hidden-state transport, client SDK."""
