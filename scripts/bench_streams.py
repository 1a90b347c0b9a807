#!/usr/bin/env python3
"""What one stream between two peers costs: two real nodes on 127.0.0.1 (each its own p2pd and DHT process), and
N request/answer exchanges of --bytes each way, each on a stream of its own as every pipeline hop and state range
opens one (a direct TCP+TLS connection where the peers reach each other: swarm/dht/direct.py). Both ends run in
this process, so its CPU time is the stream's cost on both sides. Prints a table, then a JSON line.

    python scripts/bench_streams.py
    python scripts/bench_streams.py --streams 500 --bytes 65536
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.dht.frames import recv_frame, send_frame  # noqa: E402
from swarm.dht.node import NetworkOptions, SwarmNode  # noqa: E402
from swarm.runtime import LoopThread  # noqa: E402

PROTOCOL = "swarm.bench.echo"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=100, help="the request's and the answer's size")
    args = parser.parse_args()
    loop = LoopThread()
    opener = SwarmNode([], NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    receiver = SwarmNode([opener.visible_maddrs()[0]], NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    try:
        async def echo(remote, reader, writer):
            await send_frame(writer, await recv_frame(reader, 64 << 20))
            writer.close()

        loop.run(receiver.add_stream_handler(PROTOCOL, echo), timeout=30)
        payload = b"x" * args.bytes

        async def exchange() -> None:
            reader, writer = await opener.open_stream(receiver.peer_id, PROTOCOL)
            try:
                await send_frame(writer, payload)
                assert len(await recv_frame(reader, 64 << 20)) == args.bytes
            finally:
                writer.close()

        for _ in range(5):  # (the first streams learn where and under which certificate the receiver listens)
            loop.run(exchange(), timeout=30)
        wall, cpu = time.monotonic(), _cpu()
        for _ in range(args.streams):
            loop.run(exchange(), timeout=30)
        wall, cpu = time.monotonic() - wall, _cpu() - cpu
        opened = dict(opener.direct.opened) if opener.direct is not None else {}
    finally:
        receiver.shutdown()
        opener.shutdown()
        loop.close()
    result = {"streams": args.streams, "bytes": args.bytes, "wall_ms_per_stream": 1000 * wall / args.streams,
              "cpu_ms_per_stream": 1000 * cpu / args.streams, "opened": opened}
    print(f"{'streams':>8} {'bytes each way':>15} {'wall ms a stream':>17} {'CPU ms a stream (both ends)':>28}")
    wall_ms, cpu_ms = result["wall_ms_per_stream"], result["cpu_ms_per_stream"]
    print(f"{args.streams:>8} {args.bytes:>15} {wall_ms:>17.2f} {cpu_ms:>28.2f}")
    print(f"(streams opened: {opened})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
