"""Models named by hub id: ``hf:ORG/REPO`` sources, fetched through huggingface_hub (its cache, ``HF_HOME``,
``HF_HUB_CACHE``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``; its progress bars), read at each call.

The forms of a source (a model entry's ``source``, one of its mirrors, or a remote model's ``tokenizer``):

- ``hf:ORG/REPO``: a checkpoint repository (transformers: its safetensors, config and tokenizer files; an
  embedding model: a sentence-transformers repository; a remote model: its tokenizer files). For llama.cpp,
  the repository's one GGUF, or its Q4_K_M GGUF where it holds several (llama-server's default);
- ``hf:ORG/REPO:QUANT``: the repository's GGUF whose file name carries QUANT (``Q4_K_M``, any case);
- ``hf:ORG/REPO/PATH.gguf``: that file.

The entry's ``revision`` (a branch, tag or commit) pins what is fetched. huggingface_hub checks sizes, not
bytes: every large (LFS) file fetched here is hashed and compared with the sha256 the hub announced for it (its
cache names the blob by it); a mismatch removes the file from the cache (a retry fetches it again) and refuses
it. A GGUF is then checked against the entry's pin (``gguf: {sha256}``, engines/core/sources.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from chorus.errors import EngineUnavailable

PREFIX = "hf:"
_FORM = re.compile(r"^hf:(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[A-Za-z0-9_.-]+)|/(?P<file>[^:@]+))?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: llama-server's choice among a repository's GGUFs when the source names none
DEFAULT_QUANT = "Q4_K_M"

#: what each use of a checkpoint repository fetches (never ONNX, TensorFlow, Flax or .bin twins)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt", "*.model",
                   "chat_template*", "config.json", "generation_config.json"]


@dataclass(frozen=True)
class HubSource:
    """A parsed ``hf:`` source."""

    repo: str
    quant: str | None = None
    file: str | None = None

    @property
    def names_file(self) -> bool:
        """The source names one GGUF (by quantization or path), not a checkpoint repository."""
        return self.quant is not None or self.file is not None

    def __str__(self) -> str:
        return PREFIX + self.repo + (f":{self.quant}" if self.quant else f"/{self.file}" if self.file else "")


def is_hub(source: str | None) -> bool:
    return source is not None and source.startswith(PREFIX)


def repository(source: str | None) -> HubSource | None:
    """The parsed source when it names a whole repository (``hf:ORG/REPO``), not one GGUF; else ``None``."""
    if not is_hub(source):
        return None
    ref = parse(str(source))
    return None if ref.names_file else ref


def parse(source: str) -> HubSource:
    """``hf:ORG/REPO[:QUANT | /PATH.gguf]``; a malformed one is an error that shows the forms."""
    m = _FORM.match(source)
    if m is None or (m["file"] is not None and not m["file"].endswith(".gguf")):
        raise ValueError(f"bad hub source {source!r}; expected hf:ORG/REPO, hf:ORG/REPO:QUANT (a GGUF by its "
                         "quantization, e.g. :Q4_K_M) or hf:ORG/REPO/FILE.gguf")
    return HubSource(m["repo"], m["quant"], m["file"])


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _local_only() -> bool:
    """Read only the hub cache: HF_HUB_OFFLINE is set, or the hub's host name does not resolve (asked of the
    resolver first: huggingface_hub retries a failed name for about 23 s before giving up, at every source)."""
    if _offline():
        return True
    host = urlsplit(_settings()["endpoint"] or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return True
    return False


def _settings() -> dict[str, Any]:
    """huggingface_hub's settings as the environment says now (its own constants are read once, at import)."""
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "huggingface")
    return {"cache_dir": os.environ.get("HF_HUB_CACHE") or str(home / "hub"),
            "endpoint": os.environ.get("HF_ENDPOINT") or None,
            "token": os.environ.get("HF_TOKEN") or None}


@contextmanager
def _explained(src: HubSource, revision: str | None) -> Iterator[None]:
    """huggingface_hub's errors, said in terms of the model entry."""
    from huggingface_hub import errors

    at = f" at revision {revision!r}" if revision else ""
    try:
        yield
    except errors.GatedRepoError:
        raise EngineUnavailable(f"{src.repo} is gated (401): accept its terms on the hub, then set HF_TOKEN to a "
                                "token of the account that did") from None
    except errors.RevisionNotFoundError:
        raise EngineUnavailable(f"{src.repo} has no revision {revision!r}") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):  # (before EntryNotFound: a kind)
        why = "HF_HUB_OFFLINE is set" if _offline() else f"the hub ({_settings()['endpoint'] or 'huggingface.co'}) " \
            "is unreachable"
        raise EngineUnavailable(f"{src}{at} is not in the hub cache and {why}; fetch it where the hub is reachable "
                                "(chorus models pull NAME), or give another source") from None
    except errors.EntryNotFoundError as exc:
        raise EngineUnavailable(f"{src}: no such file in {src.repo}{at} ({_first_line(exc)})") from None
    except errors.RepositoryNotFoundError:
        raise EngineUnavailable(f"{src.repo}: no such repository on the hub, or a private one (set HF_TOKEN)") \
            from None
    except errors.HfHubHTTPError as exc:
        raise EngineUnavailable(f"{src}: the hub answered {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, what: str) -> str | None:
    """Hash a fetched file whose blob the hub named by its sha256 (an LFS file); a mismatch removes it from the
    cache and refuses it. The sha256 when it was computed (small git-stored files are named by their git hash,
    which huggingface_hub does not compute, and are left alone)."""
    blob = path.resolve()
    if not _SHA256.match(blob.name):
        return None
    got = sha256_of(blob)
    if got != blob.name:
        blob.unlink(missing_ok=True)  # the cache keeps no bad bytes: the next try fetches again
        if path.is_symlink():
            path.unlink()
        raise EngineUnavailable(f"{what}: sha256 {got} differs from the {blob.name} the hub announced; removed "
                                "from the cache and refused")
    return got


def repo_files(src: HubSource, revision: str | None) -> list[str]:
    """The repository's file names: from the hub, or from the cache when offline."""
    from huggingface_hub import HfApi, errors

    s = _settings()
    with _explained(src, revision):
        if not _local_only():
            try:
                return list(HfApi(endpoint=s["endpoint"], token=s["token"]).list_repo_files(src.repo,
                                                                                             revision=revision))
            except Exception as exc:
                if not _unreachable(exc):
                    raise
        folder = cached(src, revision)
        if folder is None:
            raise errors.LocalEntryNotFoundError(f"no snapshot of {src.repo} in {s['cache_dir']}")
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _unreachable(exc: BaseException) -> bool:
    import httpx2  # huggingface_hub's HTTP client

    return isinstance(exc, (httpx2.ConnectError, httpx2.TimeoutException))


def gguf_name(src: HubSource, files: list[str]) -> str:
    """The GGUF a source means among a repository's files."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if src.file is not None:
        return src.file
    quant = src.quant or DEFAULT_QUANT
    picked = [f for f in ggufs if quant.lower() in Path(f).name.lower()]
    if src.quant is None and len(ggufs) == 1:
        picked = ggufs
    if len(picked) == 1:
        return picked[0]
    if any(re.search(r"-\d{5}-of-\d{5}\.gguf$", f) for f in picked):
        raise EngineUnavailable(f"{src}: a GGUF split into several files; chorus loads single-file GGUFs")
    choices = ", ".join(ggufs[:12]) or "none"
    how = "several match" if picked else "none matches"
    raise EngineUnavailable(f"{src}: {how} {quant!r}; name the file (hf:{src.repo}/FILE.gguf) or its "
                            f"quantization (hf:{src.repo}:QUANT); GGUFs there: {choices}")


def fetch_file(src: HubSource, revision: str | None, log: Callable[[str], None] = print) -> tuple[Path, str | None]:
    """A GGUF from the hub (or its cache), hashed: its path in the cache and its sha256."""
    from huggingface_hub import hf_hub_download

    name = src.file if src.file is not None else gguf_name(src, repo_files(src, revision))
    s, local = _settings(), _local_only()
    log(f"{src}: {name} from {'the hub cache' if local else s['endpoint'] or 'the hub'}"
        + (f" at {revision}" if revision else ""))
    with _explained(HubSource(src.repo, file=name), revision):
        path = Path(hf_hub_download(src.repo, name, revision=revision, local_files_only=local, **s))
    return path, verify(path, f"{src.repo}/{name}")


def fetch_snapshot(src: HubSource, revision: str | None, patterns: list[str],
                   log: Callable[[str], None] = print) -> Path:
    """The repository's files that match ``patterns`` (from the hub, or the cache), each LFS file hashed; the
    snapshot folder in the cache."""
    from huggingface_hub import snapshot_download

    s, local = _settings(), _local_only()
    log(f"{src}: {'from the hub cache' if local else 'from ' + (s['endpoint'] or 'the hub')}"
        + (f" at {revision}" if revision else ""))
    with _explained(src, revision):
        folder = Path(snapshot_download(src.repo, revision=revision, allow_patterns=patterns,
                                        local_files_only=local, **s))
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            verify(p, f"{src.repo}/{p.relative_to(folder)}")
    return folder


def cached(src: HubSource, revision: str | None) -> Path | None:
    """The repository's snapshot folder in the hub cache, without asking the hub (``None``: nothing cached). Read
    from the cache's documented layout (``models--ORG--REPO/refs/REVISION`` names the commit of
    ``snapshots/COMMIT``): huggingface_hub's own offline look-up insists on every file of a snapshot, where chorus
    fetches only what it uses."""
    storage = Path(_settings()["cache_dir"]) / f"models--{src.repo.replace('/', '--')}"
    commit = revision if revision and re.fullmatch(r"[0-9a-f]{40}", revision) else None
    if commit is None:
        try:
            commit = (storage / "refs" / (revision or "main")).read_text().strip()
        except OSError:
            return None
    folder = storage / "snapshots" / commit
    return folder if folder.is_dir() else None


def cache_state(src: HubSource, revision: str | None) -> tuple[str, str]:
    """What ``chorus models list`` shows for a hub source: cached (and where) or not fetched."""
    folder = cached(src, revision)
    if folder is None:
        return "not fetched", str(src)
    if src.names_file:
        try:
            return "cached", str(folder / gguf_name(src, sorted(str(p.relative_to(folder))
                                                                for p in folder.rglob("*.gguf"))))
        except EngineUnavailable:  # this GGUF is not among the cached ones
            return "not fetched", str(src)
    return "cached", str(folder)
