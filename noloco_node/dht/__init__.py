"""hivemind DHT adapter: stage records, announce, lookup. Knows hivemind and pydantic, never grpc or torch."""
