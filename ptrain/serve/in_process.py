"""An ASGI app served by uvicorn on a free loopback port in a thread of this process: how the
eval stage puts its engine in front of lm-evaluation-harness, how the verifiers environment
puts it in front of a verifiers harness, and how tests stand up scripted servers, each without
a second process (and so without a second copy of the weights).

    with serving(make_app(engine, tokenizer)) as url:   # "http://127.0.0.1:PORT"
        ...
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1", timeout_s: float = 60.0) -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on a free port of `host` in a thread of this process;
    yields its base URL and stops it on exit. The port is bound before the server starts, so
    no other process can take it in between."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ptrain-serve-inproc", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the in-process server on {host}:{port} did not start within {timeout_s:.0f} s")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
