"""Streaming data: shard reading, transforms, tokenizers, the training loader."""
