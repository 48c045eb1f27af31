"""Which prefill work one scheduler step takes, within ``prefill_chunk`` tokens (padding included)."""

from __future__ import annotations

from collections import deque

from chorus.engines.transformers.batch_rows import PrefillJob


def plan_prefills(
    queue: deque[PrefillJob], rows: int, budget: int, max_batch_size: int
) -> list[tuple[PrefillJob, int]]:
    """Either whole prompts that fit together (the cold ones in one padded forward, each prefix cache hit's rest in
    a forward of its own after its cached columns), or one chunk of a prompt too long for the budget (chunked
    prefill, one chunk per step); ``rows``: the rows already in the batch. Cancelled jobs leave the queue."""
    for job in [j for j in queue if j.cancelled]:
        queue.remove(job)
    longest, cold, hits = 0, 0, 0  # the cold group's widest prompt and size; the hits' tokens
    out: list[tuple[PrefillJob, int]] = []
    for job in queue:
        remaining = len(job.ids) - job.done
        if rows + len(job.sessions) > max_batch_size:
            break  # batch full: wait for a row to leave
        if remaining > budget or (job.done > 0 and job.seed is None):  # needs chunking: alone in its step
            if not out:
                out.append((job, min(budget, remaining)))
            break
        if job.seed is not None:
            if hits + remaining + cold * longest > budget:
                break
            hits += remaining
        else:
            if hits + (cold + 1) * max(longest, remaining) > budget:
                break
            longest, cold = max(longest, remaining), cold + 1
        out.append((job, remaining))
        rows += len(job.sessions)
    return out


def split_plan(jobs: list[tuple[PrefillJob, int]]) -> tuple[list[tuple[PrefillJob, int]], list[PrefillJob]]:
    """A step's prefill work as the chunks that run alone (a long prompt's chunk, each prefix cache hit's rest) and
    the cold whole prompts that share one forward."""
    alone = [(job, n) for job, n in jobs if job.done > 0 or job.seed is not None or n < len(job.ids)]
    together = [job for job, n in jobs if not (job.done > 0 or job.seed is not None or n < len(job.ids))]
    return alone, together
