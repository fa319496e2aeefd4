"""A local HTTP server speaking the part of the Hub API that create_repo + upload_folder use (tests only)."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    """Records repositories, commits and the Authorization headers it was sent."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.commits: list[dict] = []
        self.auth: list[str] = []
        self.unknown: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _json(self, status: int, data) -> None:
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self):
                hub.auth.append(self.headers.get("Authorization", ""))
                body = self._body()
                if self.path == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'user'}/{req['name']}"
                    hub.repos[repo] = req
                    hub.files.setdefault(repo, {})
                    return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": repo})
                if self.path == "/api/validate-yaml":
                    return self._json(200, {"errors": [], "warnings": []})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/preupload/(.+)$", self.path)
                if m:
                    req = json.loads(body)
                    return self._json(
                        200,
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                                for f in req["files"]
                            ]
                        },
                    )
                m = re.match(r"^/api/models/([^/]+/[^/]+)/commit/(.+?)(\?.*)?$", self.path)
                if m:
                    repo = m.group(1)
                    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                    commit = {"repo": repo, "header": lines[0]["value"], "files": []}
                    for line in lines[1:]:
                        if line["key"] == "file":
                            v = line["value"]
                            hub.files.setdefault(repo, {})[v["path"]] = base64.b64decode(v["content"])
                            commit["files"].append(v["path"])
                    hub.commits.append(commit)
                    return self._json(
                        200,
                        {
                            "commitUrl": f"{hub.url}/{repo}/commit/{'a' * 40}",
                            "commitOid": "a" * 40,
                            "pullRequestUrl": None,
                        },
                    )
                hub.unknown.append(f"POST {self.path}")
                return self._json(404, {"error": f"not served by the test hub: {self.path}"})

            def do_GET(self):
                hub.unknown.append(f"GET {self.path}")
                m = re.match(r"^/api/models/([^/]+/[^/]+)(/revision/[^/?]+)?$", self.path)
                if m:
                    return self._json(200, {"id": m.group(1), "sha": "a" * 40, "siblings": [], "private": False})
                return self._json(404, {"error": f"not served by the test hub: {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
