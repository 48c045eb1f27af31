"""What the batching engine and the model families share at run time: the KV cache (growing per-row caches,
per-step slots), the per-request observers that build a family's trace, and the metrics they export. The
lowest layer of engines: it imports neither the engine modules nor the families."""
