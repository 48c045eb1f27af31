"""The shape of a model family's Prometheus counters (engines report them; the server exposes them)."""

#: (name, help, label names, [(label values, value)]) per counter family
Metric = tuple[str, str, list[str], list[tuple[list[str], float]]]
