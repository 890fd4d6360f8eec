"""Echo peer for the per-hop latency benchmark: returns every frame it receives.

Run by `bench_services.py` as a separate process: `python hop_echo.py KIND PORT_FILE`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from specpipe.services.transport import Frame, make_transport


async def main(kind: str, port_file: str) -> None:
    queue: asyncio.Queue[Frame] = asyncio.Queue()
    transport = make_transport(kind, queue.put_nowait)
    address = await transport.start()
    Path(port_file).write_text(address)
    while True:
        frame = await queue.get()
        reply_to = frame.header.sender  # the sender names its own listening address
        await transport.send_frame(reply_to, frame.header, frame.payload)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
