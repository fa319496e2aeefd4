"""A Hub that cannot be reached (peft_shardmerge/api/hub.py): said as a network problem naming the address, not as a
token
problem; a Hub that answers and refuses is still a token or name problem."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from peft_shardmerge.api.hub import prepare_repo
from peft_shardmerge.errors import HubUploadError


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_is_a_network_problem_and_a_refusal_by_the_hub_a_token_one(monkeypatch):
    import huggingface_hub.constants as hc

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "ENDPOINT", endpoint)
    with pytest.raises(HubUploadError) as e:
        prepare_repo("me/tiny", token="hf_secret")
    text = str(e.value)
    assert f"the Hub at {endpoint} could not be reached" in text and "network" in text
    assert "Check the token" not in text and "hf_secret" not in text

    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            raw = json.dumps({"error": "Invalid credentials"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(hc, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(HubUploadError, match="Check the token") as e:
            prepare_repo("me/tiny", token="hf_wrong")
    finally:
        server.shutdown()
        server.server_close()
    assert "could not be reached" not in str(e.value)
