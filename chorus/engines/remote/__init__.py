"""Models on OpenAI-compatible workers (vLLM, a chorus worker): the engine, its replica pool with failover, the
OpenAI wire (logit bias, top logprobs) and the chorus session wire, and the kind (options)."""
