"""The in-process transformers engine: continuous batching over one model (engine, batching, batch rows, prefill
plan, forward passes, attention masks), the DUMA scorer it serves, how a GGUF or a derived family checkpoint is
prepared into a safetensors checkpoint (prepare), and the kind (options, readiness)."""
