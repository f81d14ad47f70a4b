"""Where a request's time went, for the client that asks: ``X-Forkd-Timings: 1`` in, ``Server-Timing`` out.

The outermost middleware: it starts the request's :class:`~forkd.runtime.timings.Timings`, hands it
down in ``timings.CURRENT`` (the layers below mark their stages: sessions, the agent client, the
guest's own marks), marks ``answer_ready`` when the response starts and sends every stage in
milliseconds as a standard ``Server-Timing`` header. Requests without the header pay one header
lookup; ``bench/roundtrip.py`` reads the stages.
"""

from __future__ import annotations

from typing import Any

from forkd.runtime.timings import CURRENT, Timings

ASK_HEADER = b"x-forkd-timings"
ANSWER_HEADER = b"server-timing"


def server_timing(timings: Timings) -> bytes:
    """``stage;dur=ms, ...``: the header's standard syntax (stage names are tokens)."""
    return ", ".join(f"{stage};dur={ms}" for stage, ms in timings.as_ms().items()).encode()


class ServerTiming:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not any(name == ASK_HEADER for name, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return
        timings = Timings()

        async def timed_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                timings.mark("answer_ready")
                timings.close()  # a streamed answer's later calls, and tasks started meanwhile, mark nothing
                message = {**message, "headers": [*message.get("headers", []), (ANSWER_HEADER, server_timing(timings))]}
            await send(message)

        token = CURRENT.set(timings)
        try:
            await self.app(scope, receive, timed_send)
        finally:
            timings.close()
            CURRENT.reset(token)
