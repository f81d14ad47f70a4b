"""A guest program's ports through forkd's E2B front, with E2B's unmodified Python SDK.

Pointed at forkd only through E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_TEST_TEMPLATE.
``get_host(port)`` names ``{port}-{sandboxID}.{domain}``; no resolver here knows that wildcard name
(curl and browsers send ``*.localhost`` to loopback themselves), so the checks connect to the
front's address and send that name as the Host header, as a wildcard DNS entry would. Prints
``ok NAME`` / ``FAIL NAME: why`` per check and exits non-zero if any failed.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from e2b import CommandExitException, Sandbox
from wsproto import ConnectionType, WSConnection
from wsproto import events as ws

from checks import check, failures

TEMPLATE = os.environ["E2B_TEST_TEMPLATE"]
FRONT = urlsplit(os.environ["E2B_SANDBOX_URL"])
WS_ECHO = (Path(__file__).resolve().parent.parent / "ws_echo.py").read_text()


def get(host: str, path: str = "/", headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"http://{FRONT.hostname}:{FRONT.port}{path}", headers={"Host": host, **(headers or {})},
                     timeout=120)


def wait_for(port: int, sbx: Sandbox) -> None:
    """Until the guest program listens (it starts in the background)."""
    for _ in range(240):
        try:
            sbx.commands.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\"",
                             timeout=60)
            return
        except CommandExitException:  # refused: not listening yet
            time.sleep(0.5)
    raise AssertionError(f"nothing listened on {port} in the guest")


def websocket_echo(host: str, token: str, messages: list[str | bytes]) -> list[str | bytes]:
    conn = WSConnection(ConnectionType.CLIENT)
    with socket.create_connection((FRONT.hostname, FRONT.port), timeout=120) as sock:
        sock.sendall(conn.send(ws.Request(host=host, target="/echo",
                                          extra_headers=[(b"e2b-traffic-access-token", token.encode())])))
        answers: list[str | bytes] = []
        accepted = False
        pending = list(messages)
        while True:
            for event in conn.events():
                if isinstance(event, ws.AcceptConnection):
                    accepted = True
                elif isinstance(event, ws.RejectConnection):
                    raise AssertionError(f"the WebSocket was refused: {event.status_code}")
                elif isinstance(event, ws.Message):
                    answers.append(event.data)
                elif isinstance(event, ws.CloseConnection):
                    return answers
            if accepted and pending:
                sock.sendall(conn.send(ws.Message(data=pending.pop(0))))
            elif accepted and len(answers) == len(messages):
                sock.sendall(conn.send(ws.CloseConnection(code=1000)))
                return answers
            data = sock.recv(65536)
            if not data:
                return answers
            conn.receive_data(data)


def main() -> int:
    sbx = Sandbox.create(TEMPLATE, timeout=900)
    token = sbx.traffic_access_token or ""
    try:
        sbx.files.write("/tmp/site/hello.txt", "served from the guest\n")
        sbx.files.write("/tmp/ws_echo.py", WS_ECHO)
        sbx.commands.run("cd /tmp/site && python3 -m http.server 8000", background=True)
        sbx.commands.run("python3 /tmp/ws_echo.py 8765", background=True)
        wait_for(8000, sbx)
        wait_for(8765, sbx)
        host = sbx.get_host(8000)

        def http_server() -> None:
            assert host.startswith(f"8000-{sbx.sandbox_id}."), host
            answer = get(host, "/hello.txt", {"E2B-Traffic-Access-Token": token})
            assert answer.status_code == 200 and answer.text == "served from the guest\n", answer.text
            listing = httpx.get(f"{os.environ['E2B_SANDBOX_URL']}/", timeout=120, headers={
                "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000", "E2B-Traffic-Access-Token": token})
            assert listing.status_code == 200 and "hello.txt" in listing.text, listing.text

        def needs_token() -> None:
            for headers in ({}, {"E2B-Traffic-Access-Token": "0" * 64}):
                answer = get(host, "/hello.txt", headers)
                assert answer.status_code == 401, (answer.status_code, answer.text)

        def closed_port() -> None:
            answer = get(sbx.get_host(8001), "/", {"E2B-Traffic-Access-Token": token})
            assert answer.status_code == 502 and "8001" in answer.json()["message"], answer.text

        def websocket() -> None:
            sent: list[str | bytes] = ["hello", b"\x00\x01binary", "x" * 40000]
            assert websocket_echo(sbx.get_host(8765), token, sent) == sent

        def public() -> None:
            other = Sandbox.create(TEMPLATE, timeout=600, network={"allow_public_traffic": True})
            try:
                other.files.write("/tmp/site/hello.txt", "public\n")
                other.commands.run("cd /tmp/site && python3 -m http.server 8000", background=True)
                wait_for(8000, other)
                answer = get(other.get_host(8000), "/hello.txt")
                assert answer.status_code == 200 and answer.text == "public\n", answer.text
            finally:
                other.kill()

        check("http_server", http_server)
        check("needs_token", needs_token)
        check("closed_port", closed_port)
        check("websocket", websocket)
        check("public", public)
    finally:
        sbx.kill()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
