"""Clients of the gateway: benchmarks, evaluation, chat."""
