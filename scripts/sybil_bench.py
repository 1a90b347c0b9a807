"""What a crowd of Sybil keys writing peer records costs honest DHT nodes: two honest nodes announce themselves,
one attacker node writes --sybils valid signed records (each under its own key, padded to --pad bytes) under the
run's peers key, then each honest node, and a node that joins afterwards, reads the key: how long, how many
records, whether it sees both honest peers, and how much the honest nodes' DHT processes grew.

Run: python scripts/sybil_bench.py [--sybils 1000] [--pad 7000]   (on 127.0.0.1; prints a table and a JSON line)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from attackers import SYBIL_BATCH, SybilSigner, sybil_key
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.utils import get_dht_time

from swarm import __version__
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.records import PEER_RECORD_RULE, PeerRecord, parse_peer_records, peers_key
from swarm.dht.validation import owned_subkey, peer_id_of
from swarm.runtime import LoopThread

RUN = "sybil-bench"


def _rss_mb(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024


def _record(peer_id: str, pad: int) -> dict:
    record = PeerRecord(peer_id=peer_id, state="joining", version=__version__, run_id=RUN, round=0,
                        tokens_in_round=0, block_start=0, block_end=2, updated=get_dht_time())
    return {**record.to_wire(), **({"pad": "p" * pad} if pad else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sybils", type=int, default=1000)
    parser.add_argument("--pad", type=int, default=7000, help="bytes of an unknown field in each Sybil record")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    started = time.monotonic()
    keys = [sybil_key() for _ in range(args.sybils)]
    keygen = time.monotonic() - started
    loop, key = LoopThread(), peers_key(RUN)
    honest = [SwarmNode([], NetworkOptions())]
    honest.append(SwarmNode(honest[0].visible_maddrs(), NetworkOptions()))
    nodes, rows = list(honest), []
    try:
        for node in honest:
            node.protect({key: PEER_RECORD_RULE})
            loop.run(node.store(key, _record(node.peer_id, 0), 300, subkey=node.owned_subkey), timeout=30)
        before = [_rss_mb(node.dht.pid) for node in honest]
        attacker = loop.run(DHTNode.create(initial_peers=honest[0].visible_maddrs(),
                                           record_validator=CompositeValidator([SybilSigner(keys)]),
                                           host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False, use_relay=False,
                                           use_auto_relay=False, auto_nat=False, nat_port_map=False), timeout=60)
        entries = []
        for sybil in keys:
            public = sybil.get_public_key().to_bytes().decode()
            entries.append((owned_subkey(peer_id_of(public), public), _record(peer_id_of(public), args.pad)))
        started = time.monotonic()
        for start in range(0, len(entries), SYBIL_BATCH):
            batch = entries[start:start + SYBIL_BATCH]
            loop.run(attacker.store_many([key] * len(batch), [v for _, v in batch], [get_dht_time() + 500] * len(batch),
                                         subkeys=[s for s, _ in batch]), timeout=120)
        written = time.monotonic() - started
        grown = [_rss_mb(node.dht.pid) - mb for node, mb in zip(honest, before)]
        later = SwarmNode(honest[0].visible_maddrs(), NetworkOptions())
        nodes.append(later)
        ids = {node.peer_id for node in honest}
        for name, node in (("honest0", honest[0]), ("honest1", honest[1]), ("later (1st read)", later),
                           ("later (2nd read)", later)):
            started = time.monotonic()
            records, _ = parse_peer_records(loop.run(node.get(key), timeout=120))
            rows.append({"reader": name, "seconds": round(time.monotonic() - started, 2), "records": len(records),
                         "honest_seen": len(ids & {r.peer_id for r in records})})
        loop.run(attacker.shutdown(), timeout=30)
    finally:
        for node in nodes:
            node.shutdown()
        loop.close()
    print(f"{args.sybils} Sybil records of ~{args.pad // 1024 + 1} KiB (keys made in {keygen:.1f} s, written in "
          f"{written:.1f} s); honest DHT processes grew {grown[0]:.1f} and {grown[1]:.1f} MB")
    print(f"{'reader':<18} {'seconds':>8} {'records':>8} {'honest seen':>12}")
    for row in rows:
        print(f"{row['reader']:<18} {row['seconds']:>8.2f} {row['records']:>8} {row['honest_seen']:>12}")
    print(json.dumps({"sybils": args.sybils, "pad": args.pad, "rss_grown_mb": [round(g, 1) for g in grown],
                      "reads": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
