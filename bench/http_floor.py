"""The floor of bench/http_api.py: the cheapest HTTP streaming this machine can do under the same
burst, a trivial FastAPI endpoint on uvicorn (httptools, uvloop, a process of its own, as the
gateway runs) that streams pre-made completion chunks with nothing behind it.

    python bench/http_floor.py EVENTS   # serve it (FloorServer's child): prints its URL, serves until killed
"""

from __future__ import annotations

import asyncio
import json
import sys


def floor_app(num_events: int):
    """The floor: a trivial FastAPI endpoint that reads the request's JSON and streams `num_events`
    pre-made completion chunks, a usage chunk and [DONE], with nothing behind it."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    def chunk(finish: str | None, usage: dict | None = None) -> bytes:
        choices = [] if usage else [{"index": 0, "text": " x", "finish_reason": finish, "logprobs": None}]
        body = {"id": "floor", "object": "text_completion", "created": 0, "model": "floor"}
        event = json.dumps(body | {"choices": choices, "usage": usage}, separators=(",", ":"))
        return b"data: " + event.encode() + b"\n\n"

    usage = {"prompt_tokens": 0, "completion_tokens": num_events, "total_tokens": num_events}
    events = [chunk(None)] * (num_events - 1) + [chunk("length"), chunk(None, usage), b"data: [DONE]\n\n"]
    app = FastAPI()

    async def completions(request) -> StreamingResponse:  # a plain route: it takes the Request
        json.loads(await request.body())

        async def body():
            for event in events:
                yield event

        headers = {"x-kvtier-replica-ttft-s": "0"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    app.add_route("/v1/completions", completions, methods=["POST"])
    return app


def serve_floor(num_events: int) -> None:
    """Run the floor app as the gateway runs (uvicorn, httptools, uvloop, a TCP_NODELAY socket);
    print its URL, serve until killed."""
    import uvicorn
    import uvloop

    from kvtier.gateway.__main__ import bind, url_of

    sock = bind("127.0.0.1", 0)
    print(url_of(sock), flush=True)
    config = uvicorn.Config(floor_app(num_events), http="httptools", log_level="warning", access_log=False)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


class FloorServer:
    """The floor app in a process of its own, as the gateway is."""

    def __init__(self, num_events: int):
        self.num_events = num_events

    def __enter__(self) -> FloorServer:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.num_events)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self.proc.stdout.readline().strip()
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve_floor(int(sys.argv[1]))
