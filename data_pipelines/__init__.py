"""Offline builders: sources -> img2dataset-layout WebDataset shards + stats.

Nothing here imports the training code; the flow is one way, shards are the interface.
"""
