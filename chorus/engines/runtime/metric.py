"""The shape of a model family's Prometheus counters (engines report them; the server exposes them)."""

#: (name, help, label names, [(label values, value)]) per metric family; a name ending in ``_total`` is a
#: counter, any other a gauge (the server adds the ``model`` label)
Metric = tuple[str, str, list[str], list[tuple[list[str], float]]]
