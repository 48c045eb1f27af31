"""The model forwards of the batching engine, all run on its one forward thread: one decode forward for every
row of the batch, a prefill chunk, several whole prompts in one padded forward, and one-off scoring (no cache
kept). Each family's observer sees every batched forward before and after it."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from chorus.engines.runtime.kv_cache import GrowingCache, cache_from
from chorus.engines.runtime.observer import FamilyObserver
from chorus.engines.transformers.attention_masks import AttentionMasks
from chorus.engines.transformers.batch_rows import BatchRows, PrefillJob
from chorus.engines.transformers.prefill_plan import split_plan
from chorus.engines.transformers.prefix_store import Layers, copy_layers


class ForwardPasses:
    def __init__(self, model: Any, observer: FamilyObserver) -> None:
        self.model = model
        self.observer = observer
        self.device = next(model.parameters()).device
        self.masks = AttentionMasks(model.config)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def step(self, batch: BatchRows, decode: list[tuple[int, list[int]]],
             jobs: list[tuple[PrefillJob, int]]) -> list[torch.Tensor]:
        """One decode forward for every row (row r feeds its tokens left-aligned in W columns; rows with fewer
        or none get masked padding columns) and this step's prefill work. Returns (n_r, V) logits per row."""
        out = self._decode(batch, decode) if decode else []
        alone, together = split_plan(jobs)
        for job, n in alone:
            self._prefill_chunk(job, n)
        if len(together) == 1:
            self._prefill_chunk(together[0], len(together[0].ids))
        elif together:
            self._prefill_group(together)
        return out

    def _decode(self, batch: BatchRows, decode: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        assert batch.cache is not None and batch.mask is not None
        b, w = len(batch.rows), max(len(t) for _, t in decode)
        ids_rows, lens = [[0] * w for _ in range(b)], [0] * b
        served: list[Any] = [None] * b
        for r, tokens in decode:
            ids_rows[r][: len(tokens)] = tokens
            lens[r] = len(tokens)
            served[r] = batch.rows[r]
        ids = torch.tensor(ids_rows, device=self.device)  # (B, W): one host-to-device copy
        col = (torch.arange(w)[None, :] < torch.tensor(lens)[:, None]).long().to(self.device)
        mask = torch.cat([batch.mask, col], 1)  # (B, T+W)
        pos = torch.tensor([[s.length] for s in batch.rows], device=self.device) + torch.arange(w, device=self.device)
        attn = self.masks.build(pos, mask.cumsum(1) - 1, mask.bool())  # real position of each column
        res = self._observed(served, lens, w, input_ids=ids, attention_mask=attn,
                             position_ids=pos, use_cache=True, **{self._cache_kw: batch.cache})
        batch.mask = mask
        rows = torch.tensor([r for r, _ in decode], device=self.device)
        logits = res.logits.index_select(0, rows).float().cpu()  # (R, W, V): one device-to-host copy
        return [logits[j, : len(tokens)] for j, (_, tokens) in enumerate(decode)]

    def _observed(self, rows: list[Any], lens: list[int], width: int, **inputs: Any) -> Any:
        """One model forward, with the model family's observer before and after it (the first session of a
        prefill stands for its n choices)."""
        self.observer.before(rows)
        res = self.model(**inputs)
        self.observer.after(rows, lens, width)
        return res

    def _prefill_chunk(self, job: PrefillJob, n: int) -> None:
        if job.seed is not None:  # a prefix cache hit: its columns are the cache this chunk extends
            layers, cached = job.seed
            job.cache, job.seed = cache_from([(k[:, :, :cached], v[:, :, :cached]) for k, v in layers]), None
        p = job.done
        ids = torch.tensor([job.ids[p : p + n]], device=self.device)  # (1, L)
        pos = torch.arange(p, p + n, device=self.device).unsqueeze(0)  # (1, L)
        attn = self.masks.build(pos, torch.arange(p + n, device=self.device).unsqueeze(0))
        res = self._observed([job.sessions[0]], [n], n, input_ids=ids, attention_mask=attn, position_ids=pos,
                             use_cache=True, logits_to_keep=1, **{self._cache_kw: job.cache})
        job.done += n
        if job.done == len(job.ids):
            job.logits = res.logits[0, -1, :].float().cpu()
            keep(job)

    def _prefill_group(self, jobs: list[PrefillJob]) -> None:
        """Several whole prompts in one right-padded forward; each then gets its own trimmed cache."""
        lens = torch.tensor([len(j.ids) for j in jobs], device=self.device)
        j, t = len(jobs), int(lens.max())
        ids = torch.zeros(j, t, dtype=torch.long, device=self.device)
        for row, job in enumerate(jobs):
            ids[row, : len(job.ids)] = torch.tensor(job.ids, device=self.device)
        ar = torch.arange(t, device=self.device)
        pos = ar.unsqueeze(0).expand(j, t)  # (J, T)
        attn = self.masks.build(pos, pos, ar.view(1, t) < lens.view(j, 1))  # right padding is not a key
        last = sorted({int(n) - 1 for n in lens})
        cache = GrowingCache()
        res = self._observed([job.sessions[0] for job in jobs], [len(job.ids) for job in jobs], t, input_ids=ids,
                             attention_mask=attn, position_ids=pos, use_cache=True,
                             logits_to_keep=torch.tensor(last, device=self.device), **{self._cache_kw: cache})
        for row, job in enumerate(jobs):
            n = len(job.ids)
            job.logits = res.logits[row, last.index(n - 1), :].float().cpu()
            # cache_from copies each slice into a buffer of its own
            job.cache = cache_from([(l.keys[row : row + 1, :, :n], l.values[row : row + 1, :, :n])
                                     for l in cache.growing])
            job.done = n
            keep(job)

    def score(self, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For positions 1.., the logprob of each token given the ones before it (L-1,), and the top ``k``
        logprobs (L-1, k) with their token ids. Only these leave the thread, not (L, V) logits."""
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)  # (1, L)
            logits = self.model(input_ids=x, use_cache=False).logits[0, :-1].float()  # (L-1, V)
            lp = torch.log_softmax(logits, dim=-1)
            del logits
            target = torch.tensor(ids[1:], device=lp.device)
            chosen = lp.gather(1, target[:, None])[:, 0]  # (L-1,)
            top_v, top_i = torch.topk(lp, k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            return chosen.cpu(), top_v.cpu(), top_i.cpu()

    def score_continuations(self, prefix: list[int], conts: list[list[int]], seed: tuple[Layers, int] | None = None,
                            keep: bool = False) -> tuple[list[list[float]], Layers | None]:
        """The prefix and every continuation packed into one sequence, each continuation attending to the prefix
        and to itself only (a tree mask; its positions restart after the prefix), logits only where a choice
        token is predicted: the prefix is read once, with no padding. ``seed``: a prefix cache hit (the entry's
        layers and how many of the prefix's tokens they hold): those columns are the cache the forward extends,
        and only the rest of the prefix is computed. ``keep``: also return a copy of the prefix's keys and values
        (for the prefix cache); else no cache is kept."""
        c = seed[1] if seed is not None else 0
        n = len(prefix)
        ids, pos, seg = list(prefix[c:]), list(range(c, n)), [-1] * (n - c)  # segment -1: seen by every choice
        keep_rows = [n - c - 1]  # positions whose logits are needed: the prefix's last predicts every first token
        rows: list[list[int]] = []  # per choice: for each of its tokens, the row of `keep_rows` that predicts it
        for i, cont in enumerate(conts):
            rows.append([0])
            for j, token in enumerate(cont[:-1]):
                ids.append(token)
                pos.append(n + j)
                seg.append(i)
                keep_rows.append(len(ids) - 1)
                rows[-1].append(len(keep_rows) - 1)
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)
            p = torch.tensor([pos], device=self.device)
            s = torch.tensor(seg, device=self.device)
            visible = (s[None, :] == -1) | (s[None, :] == s[:, None])  # (L, L): query row sees key column
            cache = None
            if seed is not None:
                cache = cache_from([(k[:, :, :c], v[:, :, :c]) for k, v in seed[0]])
                visible = torch.cat([visible.new_ones(len(ids), c), visible], 1)  # the cached prefix: seen by all
                kv_pos = torch.cat([torch.arange(c, device=self.device)[None], p], 1)
            elif keep:
                cache, kv_pos = GrowingCache(), p
            else:
                kv_pos = p
            mask = self.masks.build(p, kv_pos, allowed=visible[None])
            cache_kw = {self._cache_kw: cache, "use_cache": True} if cache is not None else {"use_cache": False}
            logits = self.model(input_ids=x, position_ids=p, attention_mask=mask, **cache_kw,
                                logits_to_keep=torch.tensor(keep_rows, device=self.device)).logits[0].float()  # (K, V)
            lp = torch.log_softmax(logits, dim=-1)
            del logits
            flat_rows = torch.tensor([r for per in rows for r in per], device=self.device)
            flat_tokens = torch.tensor([t for cont in conts for t in cont], device=self.device)
            chosen = lp[flat_rows, flat_tokens].cpu().tolist()
            kept = copy_layers([(l.keys, l.values) for l in cache.growing], n) if keep and cache is not None else None
        out, at = [], 0
        for cont in conts:
            out.append(chosen[at : at + len(cont)])
            at += len(cont)
        return out, kept


def keep(job: PrefillJob) -> None:
    """A finished prefill the prefix cache wants: a compact copy of its keys and values (stored on the event loop)."""
    if job.keep:
        job.kept = copy_layers([(l.keys, l.values) for l in job.cache.growing], len(job.ids))
