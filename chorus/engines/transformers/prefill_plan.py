"""Which prefill work one scheduler step takes, within ``prefill_chunk`` tokens (padding included)."""

from __future__ import annotations

from collections import deque

from chorus.engines.transformers.batch_rows import PrefillJob


def plan_prefills(
    queue: deque[PrefillJob], rows: int, budget: int, max_batch_size: int
) -> list[tuple[PrefillJob, int]]:
    """Either several whole prompts that fit together (one padded forward), or one chunk of a prompt too long
    for the budget (chunked prefill, one chunk per step); ``rows``: the rows already in the batch. Cancelled
    jobs leave the queue."""
    for job in [j for j in queue if j.cancelled]:
        queue.remove(job)
    longest = 0
    out: list[tuple[PrefillJob, int]] = []
    for job in queue:
        remaining = len(job.ids) - job.done
        if rows + len(job.sessions) > max_batch_size:
            break  # batch full: wait for a row to leave
        if job.done > 0 or remaining > budget:  # needs chunking: alone in its step
            if not out:
                out.append((job, min(budget, remaining)))
            break
        longest = max(longest, remaining)
        if (len(out) + 1) * longest > budget:
            break
        out.append((job, remaining))
        rows += len(job.sessions)
    return out
