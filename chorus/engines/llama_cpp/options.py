"""The options of ``engine: llama_cpp`` (``llama_cpp: {threads: 2, n_batch: 512}`` in a model's entry)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LlamaCppOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_ctx: int | None = Field(default=None, ge=16, description="KV cells of all sequences together (default: "
                              "the served context, max_model_len, times max_batch_size)")
    n_batch: int = Field(default=512, ge=1, description="tokens per llama_decode call (and per micro-batch)")
    threads: int | None = Field(default=None, ge=1, description="decode threads (default: every core)")
    threads_batch: int | None = Field(default=None, ge=1, description="prefill threads (default: threads)")
    poll: int = Field(default=50, ge=0, le=100, strict=True,
                      description="how long ggml's idle threads spin before they sleep (0-100, llama.cpp's level)")
    prefix_cache_slots: int = Field(default=4, ge=0, le=64, description="finished prefixes kept for reuse, each in "
                                    "a sequence of its own (max_model_len KV cells); 0 turns the prefix cache off")
    prefix_cache_min_tokens: int = Field(default=32, ge=1, description="the shortest prefix worth keeping or "
                                         "reusing (a copy costs a stream's KV bytes, a few milliseconds)")
