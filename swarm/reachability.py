"""Whether the swarm can dial this peer, and what `join` does about it: the dial-back's verdict as a `Check`
(`check_reachability`), the address to announce where the swarm reached the peer at its router's IP
(`to_announce`, `announcing`), and the router's port mappings asked for before the dial-back (`map_node_ports`,
`map_if_asked`).
Read by swarm/doctor.py, which runs them around the node's start."""

from __future__ import annotations

import socket
from typing import Optional, Sequence

from swarm.checks import Check
from swarm.settings import PeerSettings
from swarm.dht.dialback import OPEN, DialBack, DialBackError, forwarded, ip_of, reachable, tcp_target
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.portmap import default_gateway, map_ports
from swarm.runtime import LoopThread

MAPPING_SECONDS = 15.0  # a router that answers NAT-PMP does so in milliseconds; one that does not costs under 2 s


# ---- the swarm's view of us -------------------------------------------------------------------------------------
def check_reachability(answer: DialBack | DialBackError, libp2p: Sequence[str], direct: Sequence[str],
                       nat_traversal: bool = False, mapped: bool = False) -> Check:
    """The dial-back's verdict and what join does about it: go on as it is; announce the address the swarm saw this
    peer at, where its port answered (a forwarded port or a mapping: details' `announce`, see `to_announce`); switch
    to client mode (under `nat_traversal`, rely on relays) when nothing answered; "not known" only when nothing could
    be dialled. `mapped`: the router granted join's port mappings (see `to_announce`)."""
    if isinstance(answer, DialBackError):
        return Check("reachability", False, f"not checked: {answer}: ask another peer (pass it first in "
                                            "--initial-peers), or run with --client-mode if unsure",
                     {"error": str(answer)})
    details = {"outcomes": answer.outcomes, "observed": list(answer.observed), "server": answer.server}
    verdict = reachable(answer, libp2p)
    seen = answer.dialled(answer.seen(libp2p))  # our ports, tried at the IP the server saw us at

    def said(maddrs: Sequence[str]) -> str:
        return "; ".join(f"{m} {answer.outcomes.get(m, 'not dialled')}" for m in maddrs)

    if verdict is None:
        return Check("reachability", False, f"not known: peer {answer.server} saw this peer at "
                                            f"{', '.join(answer.observed)} and could dial none of {said(libp2p)}: "
                                            "announce the address the swarm sees (--announce-maddrs)", details)
    if verdict is False:
        fix = ("join relies on relays (--nat-traversal), which carry less; for direct connections" if nat_traversal
               else "join switches to client mode; to serve others too,")
        port = tcp_target(libp2p[0])[1] if libp2p and tcp_target(libp2p[0]) else "PORT"
        public = tcp_target(seen[0])[0] if seen else "PUBLIC_IP"
        tried = f"it is seen at {', '.join(answer.observed)}, where {said(seen)}" if seen else said(libp2p)
        return Check("reachability", False, f"the swarm cannot dial this peer ({tried}): {fix} forward TCP port "
                                            f"{port} to this machine and announce its public address "
                                            f"(--announce-maddrs /ip4/{public}/tcp/{port})",
                     {**details, "reachable": False})
    announce = to_announce(answer, libp2p, mapped)
    # The direct-stream port is announced at the libp2p addresses' hosts: at the IP seen, once join announces that.
    closed = [m for m in (answer.seen(direct) if announce else direct) if answer.outcomes.get(m) != OPEN]
    slower = f"({said(closed)}): bulk data goes through libp2p (slower); fix --direct-port and forward it"
    if announce:
        unopened = [m for m in libp2p if m not in answer.opened(libp2p)]  # (p2pd's own mapping may have answered)
        return Check("reachability", True, f"peer {answer.server[-8:]} saw this peer at "
                                           f"{', '.join(answer.observed)} and dialled back {', '.join(announce)} "
                                           f"there (a forwarded port or the router's mapping), not "
                                           f"{', '.join(unopened or libp2p)}: join announces {', '.join(announce)}"
                                           + (f"; the direct-stream port does not answer there {slower}"
                                              if closed else ""),
                     {**details, "reachable": True, "announce": announce})
    if closed:
        return Check("reachability", False, f"libp2p is reachable but the direct-stream port is not {slower}",
                     {**details, "reachable": True})
    return Check("reachability", True, f"peer {answer.server[-8:]} dialled back {', '.join(answer.opened(libp2p))}",
                 {**details, "reachable": True})


def to_announce(answer: DialBack, libp2p: Sequence[str], mapped: bool = False) -> list[str]:
    """The addresses join announces instead of `libp2p`: those at the IP the swarm saw this peer at that answered
    in their stead (dialback.forwarded). Where join's own port mappings were granted (`mapped`), they are preferred
    even though an address that p2pd announces answered as well: p2pd maps libp2p's port to a random external one
    and announces it (where the router's address is public), but maps no direct-stream port, which ours does."""
    if mapped:
        return answer.opened(answer.seen(libp2p)) or forwarded(answer, libp2p)
    return forwarded(answer, libp2p)


# ---- port mapping -----------------------------------------------------------------------------------------------
def _own_address(ip: str) -> bool:
    """Whether `ip` is one of this machine's addresses (a socket can bind it): not one p2pd saw or mapped."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            return False
    return True


async def map_node_ports(node: SwarmNode) -> Check:
    """Ask the router by NAT-PMP, or UPnP IGD where it does not speak that, to forward the node's libp2p and
    direct-stream ports at the same external ports (swarm/dht/portmap.py, upnp.py); what it grants goes to
    `node.port_mappings`, renewed until the node shuts down. Always ok: what the router says is only a claim, and the
    dial-back that follows says whether the swarm can dial us."""
    await node.p2p()  # (starts the direct-stream server: its port is known from here on)
    ports: dict[int, str] = {}
    for target in map(tcp_target, (m.rsplit("/p2p/", 1)[0] for m in node.visible_maddrs())):
        if target is not None and ip_of(target[0]).version == 4 and not ip_of(target[0]).is_loopback \
                and _own_address(target[0]):  # (NAT-PMP maps IPv4 only)
            ports.setdefault(target[1], "libp2p")
    if node.direct is not None and node.direct.port:
        ports.setdefault(node.direct.port, "direct-stream")
    gateway = default_gateway()
    if gateway is None:
        return Check("port mapping", True, "none: no default route: no router to ask", {"mapped": []})
    mappings, line = await map_ports(ports, gateway)
    node.port_mappings += mappings
    return Check("port mapping", True, line,
                 {"mapped": [{"internal": m.internal_port, "external": f"{m.mapping.external_ip}:"
                                                                        f"{m.mapping.external_port}",
                              "lifetime": m.mapping.lifetime, "by": m.mapping.via} for m in mappings]})


def map_if_asked(node: SwarmNode, settings: PeerSettings, loop: LoopThread) -> Optional[Check]:
    """map_node_ports where the settings map ports (see NetworkOptions.maps_ports), else None."""
    if not NetworkOptions(**settings.network.model_dump()).maps_ports:
        return None
    try:
        return loop.run(map_node_ports(node), timeout=MAPPING_SECONDS)
    except TimeoutError:
        return Check("port mapping", True, f"none: the router did not answer within {MAPPING_SECONDS:.0f} s")


def announcing(settings: PeerSettings, announce: Sequence[str], listening: Sequence[str],
                direct_port: Optional[int]) -> PeerSettings:
    """`settings` announcing `announce` (addresses the dial-back reached at the IP it saw us at), and listening on
    the ports it reached there: each port 0 of --host-maddrs (and --direct-port) fixed to the one the node got
    (from `listening`, the addresses it announced), since a forwarded port or a mapping leads to that one."""
    got = [target for target in map(tcp_target, listening) if target is not None]
    host_maddrs = []
    for maddr in settings.network.host_maddrs:
        parts = maddr.strip("/").split("/")  # (tcp_target takes no port 0)
        if len(parts) == 4 and parts[0] in ("ip4", "ip6") and parts[2:] == ["tcp", "0"]:
            family = [p for h, p in got if (":" in h) == (parts[0] == "ip6")]
            port = next((p for h, p in got if h == parts[1]), next(iter(family), None))
            maddr = maddr if port is None else f"/{parts[0]}/{parts[1]}/tcp/{port}"
        host_maddrs.append(maddr)
    network = settings.network.model_copy(update={
        "host_maddrs": tuple(host_maddrs), "announce_maddrs": tuple(announce),
        "direct_port": settings.network.direct_port or direct_port or 0})
    return settings.model_copy(update={"network": network})
