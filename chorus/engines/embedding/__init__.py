"""Sentence-transformers embedding models for ``/v1/embeddings``: the engine and the kind."""
