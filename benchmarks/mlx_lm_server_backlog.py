"""`mlx_lm.server` with a listen backlog sized to its clients.

    python benchmarks/mlx_lm_server_backlog.py BACKLOG [mlx_lm.server options]

`mlx_lm.server` serves on the standard library's `ThreadingHTTPServer`,
whose listen backlog is `socketserver.TCPServer.request_queue_size`, 5.
It answers over HTTP/1.0, so every request opens a new connection; when
more than 5 clients connect before its accept loop runs, the kernel's
accept queue overflows and the client reads a reset (`ReadError` in
`blockmgr bench`) on a request the server never saw. At 64-128 clients
that dropped 3-37 % of the requests (57 % on the tiny test model).
`benchmarks/compare_serve.py` starts the tuned peer through this launcher
so that it serves every request; its `mlx_lm-default` server keeps the
stock backlog.
"""

from __future__ import annotations

import sys

from mlx_lm import server


def main() -> None:
    backlog = int(sys.argv.pop(1))
    # A class attribute read by `TCPServer.server_activate` (`listen(backlog)`).
    server.ThreadingHTTPServer.request_queue_size = backlog
    server.main()


if __name__ == "__main__":
    main()
