"""A Hugging Face hub on loopback, serving one local model folder as a hub repo, for the tests that need the hub's
protocol itself (who downloads what, when): huggingface_hub and transformers talk to it as to huggingface.co
(HF_ENDPOINT=hub.url), over real HTTP, with nothing leaving the machine.

It answers what they ask of a model repo: the repo's info and file tree (`/api/models/...`), each file's metadata
(HEAD `/<repo>/resolve/<revision>/<file>`: commit, ETag, size) and contents (GET), 404 with the hub's error code for
anything else.  It counts the GETs of each file's contents (`downloads`) and may answer every request after a delay
(`delay`, seconds), as a distant or busy hub does.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34  # the one revision the repo has


class StandInHub:
    def __init__(self, repo_id: str, folder: Path, delay: float = 0.0):
        self.repo_id, self.folder, self.delay = repo_id, Path(folder), delay
        self.files = sorted(str(p.relative_to(folder)) for p in self.folder.rglob("*") if p.is_file())
        self.downloads: Counter[str] = Counter()
        self.unknown: list[str] = []  # requests it had no answer for (404), to see what a client asked
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandInHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _etag(self, name: str) -> str:
        return hashlib.sha256((self.folder / name).read_bytes()).hexdigest()

    def _send(self, handler, status: int, body: bytes, headers: dict[str, str], with_body: bool) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if with_body:
            handler.wfile.write(body)

    def _json(self, handler, value, with_body: bool) -> None:
        self._send(handler, 200, json.dumps(value).encode(), {"Content-Type": "application/json", "X-Repo-Commit": COMMIT}, with_body)

    def _missing(self, handler, path: str, with_body: bool, code: str = "EntryNotFound") -> None:
        self.unknown.append(f"{handler.command} {path}")
        self._send(handler, 404, json.dumps({"error": f"{code}: {path}"}).encode(), {"X-Error-Code": code, "X-Repo-Commit": COMMIT}, with_body)

    def _answer(self, handler, body: bool) -> None:
        if self.delay:
            time.sleep(self.delay)
        path = unquote(urlparse(handler.path).path)
        if path in ("", "/"):
            return self._send(handler, 200, b"stand-in hub", {}, body)
        api = f"/api/models/{self.repo_id}"
        if path == api or path.startswith(f"{api}/revision/"):
            siblings = [{"rfilename": name, "size": (self.folder / name).stat().st_size} for name in self.files]
            return self._json(handler, {"id": self.repo_id, "modelId": self.repo_id, "sha": COMMIT, "siblings": siblings, "private": False}, body)
        if path.startswith(f"{api}/tree/"):
            revision, _, inside = path.removeprefix(f"{api}/tree/").partition("/")
            listed = [name for name in self.files if not inside or name.startswith(inside.rstrip("/") + "/")]
            if inside and not listed:
                return self._missing(handler, path, body)
            entries = [{"type": "file", "path": name, "size": (self.folder / name).stat().st_size, "oid": self._etag(name)[:40]} for name in listed]
            return self._json(handler, entries, body)
        prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(prefix):
            _, _, name = path.removeprefix(prefix).partition("/")
            if name not in self.files:
                return self._missing(handler, path, body)
            content = (self.folder / name).read_bytes()
            if body:
                self.downloads[name] += 1
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self._etag(name)}"', "Content-Type": "application/octet-stream"}
            return self._send(handler, 200, content, headers, body)
        return self._missing(handler, path, body, code="RepoNotFound")


def hub_env(hub: StandInHub, cache: Path) -> dict[str, str]:
    """The variables that point a job at the stand-in hub, with its own cache (HF_HOME), online."""
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(cache), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"} | ({"HF_TOKEN": os.environ["HF_TOKEN"]} if "HF_TOKEN" in os.environ else {})
