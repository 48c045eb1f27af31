"""A local server that speaks the Hugging Face hub's download protocol, for tests where the hub is unreachable:
what huggingface_hub asks of it when it downloads (a repository's info and file tree, a HEAD then a GET with
Range on ``/ORG/REPO/resolve/REVISION/PATH``) answered from real files, with the hub's headers (``X-Repo-Commit``,
``ETag``, ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS files) and its error codes (``X-Error-Code``:
``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``).

Faults a test can set: a file whose bytes differ from the sha256 announced for it (``tamper``), a GET cut after
so many bytes (``cut_after``, once), a gated repository that needs ``Authorization: Bearer TOKEN``. Every request
is logged (method, path, Range) in ``requests``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class HubFile:
    source: Path  #: the real file served
    size: int
    sha256: str
    git_oid: str

    @property
    def lfs(self) -> bool:
        return self.source.suffix in LFS_SUFFIXES or self.size > 10 * 2**20


def hub_file(path: Path) -> HubFile:
    sha, git = hashlib.sha256(), hashlib.sha1()
    size = path.stat().st_size
    git.update(f"blob {size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
            git.update(chunk)
    return HubFile(path, size, sha.hexdigest(), git.hexdigest())


@dataclass
class Repo:
    #: commit -> files (path in the repository -> file)
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  #: branch -> commit
    gated: bool = False


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    token: str = "hf_test_token"
    tamper: set[str] = field(default_factory=set)  #: "REPO/PATH" served with one byte changed
    cut_after: dict[str, int] = field(default_factory=dict)  #: "REPO/PATH" -> bytes sent before the cut (once)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def add(self, repo: str, files: dict[str, Path], *, branch: str = "main", gated: bool = False) -> str:
        """A commit of ``files`` on ``branch`` (the repository made when new); its commit hash."""
        r = self.repos.setdefault(repo, Repo())
        r.gated = r.gated or gated
        entries = {name: hub_file(p) for name, p in files.items()}
        commit = hashlib.sha1(repr(sorted((n, f.sha256) for n, f in entries.items())).encode()
                              + str(len(r.commits)).encode()).hexdigest()
        r.commits[commit] = entries
        r.refs[branch] = commit
        return commit


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status,
                        headers={"X-Error-Code": code, "X-Error-Message": message})


def create_hub_app(hub: Hub) -> FastAPI:
    app = FastAPI()

    def find(org: str, name: str, revision: str, request: Request) -> tuple[Repo, str, dict[str, HubFile]] | Response:
        repo_id = f"{org}/{name}"
        repo = hub.repos.get(repo_id)
        if repo is None:
            return _error(401, "RepoNotFound", f"Repository Not Found for url: {request.url}.")
        if repo.gated and request.headers.get("authorization") != f"Bearer {hub.token}":
            return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                            "and be authenticated to access it. Please log in.")
        commit = repo.refs.get(revision, revision)
        if commit not in repo.commits:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, commit, repo.commits[commit]

    @app.middleware("http")
    async def log(request: Request, call_next):  # type: ignore[no-untyped-def]
        hub.requests.append((request.method, request.url.path, request.headers.get("range")))
        return await call_next(request)

    @app.get("/api/models/{org}/{name}")
    @app.get("/api/models/{org}/{name}/revision/{revision}")
    async def info(org: str, name: str, request: Request, revision: str = "main") -> Response:
        found = find(org, name, revision, request)
        if isinstance(found, Response):
            return found
        _, commit, files = found
        return JSONResponse({"id": f"{org}/{name}", "modelId": f"{org}/{name}", "sha": commit, "private": False,
                             "gated": hub.repos[f"{org}/{name}"].gated and "manual",
                             "siblings": [{"rfilename": n} for n in sorted(files)]})

    @app.get("/api/models/{org}/{name}/tree/{revision}")
    async def tree(org: str, name: str, revision: str, request: Request) -> Response:
        found = find(org, name, revision, request)
        if isinstance(found, Response):
            return found
        _, _, files = found
        out = []
        for n, f in sorted(files.items()):
            entry: dict[str, object] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": n}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            out.append(entry)
        return JSONResponse(out)

    @app.api_route("/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve(org: str, name: str, revision: str, path: str, request: Request) -> Response:
        found = find(org, name, revision, request)
        if isinstance(found, Response):
            return found
        _, commit, files = found
        f = files.get(path)
        if f is None:
            return _error(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"")
        key = f"{org}/{name}/{path}"
        etag = f'"{f.sha256 if f.lfs else f.git_oid}"'
        headers = {"X-Repo-Commit": commit, "ETag": etag, "Accept-Ranges": "bytes", "Content-Length": str(f.size)}
        if f.lfs:
            headers |= {"X-Linked-Etag": etag, "X-Linked-Size": str(f.size)}
        if request.method == "HEAD":
            return Response(headers=headers)
        start = 0
        if (rng := request.headers.get("range")) and rng.startswith("bytes="):
            start = int(rng[len("bytes="):].split("-")[0])
            headers |= {"Content-Range": f"bytes {start}-{f.size - 1}/{f.size}",
                        "Content-Length": str(f.size - start)}
        cut = hub.cut_after.pop(key, None)
        return StreamingResponse(_body(f, start, cut, key in hub.tamper), status_code=206 if start else 200,
                                 headers=headers, media_type="application/octet-stream")

    return app


def _body(f: HubFile, start: int, cut: int | None, tamper: bool) -> Iterator[bytes]:
    sent = 0
    with f.source.open("rb") as fh:
        fh.seek(start)
        while chunk := fh.read(1 << 20):
            if tamper and start + sent <= f.size // 2 < start + sent + len(chunk):
                i = f.size // 2 - start - sent
                chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1:]
            if cut is not None and sent + len(chunk) > cut:
                yield chunk[:cut - sent]
                raise ConnectionAbortedError("the hub test server cut this download")
            sent += len(chunk)
            yield chunk
