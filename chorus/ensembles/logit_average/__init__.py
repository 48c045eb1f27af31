"""The ``logit_average`` strategy (docs/methods.md §1): token-level ensembles.

- ``strategy.py``: the strategy, ``params.py`` its parameters; it finds its parts through `registry.py`;
- ``mixing.py``: `Mixing`, the one frozen config of how a request's members combine (weights, space, mode,
  lead, gate, k, temperature), and `mix` itself;
- the alignments (``align:``): ``shared_vocab.py`` (`LogitAverage`, one vocabulary; itself an engine) and
  ``topk_union.py`` (`TopkUnion`, across vocabularies);
- the modes of a shared vocabulary (``mode:``), one session class each: ``full.py``, ``selective.py``,
  ``speculative.py``, over ``stepping.py`` (member sessions, failures, what a request's ensemble did).
"""
