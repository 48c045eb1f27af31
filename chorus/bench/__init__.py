"""In-process benchmarks and tools: they load models and ensembles in this process (``chorus bench engine``,
``ensembles``, ``families``; ``chorus route calibrate``)."""
