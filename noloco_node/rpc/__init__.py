"""gRPC transport (grpc.aio): knows messages and tensors, never models, optimizers or the DHT."""
