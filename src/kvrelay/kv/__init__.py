"""KVPayload, its pure transforms, and the kvrelay/1 wire format."""
