"""GGUF models in-process through llama-cpp-python: the engine, the runner that batches sequences into one
llama_batch per step, ggml's thread pools, and the kind (options, readiness)."""
