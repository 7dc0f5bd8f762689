"""A model shipped into search: embeddings of a shard set, the FAISS index, the searcher, and the
HTTP server with its page.
"""
