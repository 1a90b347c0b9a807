"""What `swarm-peer doctor` checks, and `join` at start-up: the bootstrap step by step, the router's port mappings,
whether the swarm can dial this peer back, the clock, the identity, ports, disk and memory. Each check returns a
`Check` whose one-line message says the cause and the fix; `diagnose` runs them all, `join_checked` is join's part of
them around its node's start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Callable, Optional, Sequence

from swarm import __version__
from swarm.checks import Check, check_checkpoint_dir, load_resolved, resource_checks
from swarm.config import Recipe, RecipeError
from swarm.settings import PeerSettings
from swarm.dht.admission import Admission, AdmissionError
from swarm.dht.dialback import DialBack, DialBackError, dial_back, reachable, serve_dialback, tcp_target
from swarm.dht.direct import listen_hosts
from swarm.dht.lifeline import identity_held_here
from swarm.dht.node import HOLDER_EXIT_SECONDS, NetworkOptions, NodeError, SwarmNode
from swarm.dht.recipes import fetch_run
from swarm.dht.validation import Identity, IdentityError
from swarm.dht.view import FRESH_SECONDS
from swarm.events import EventLog
from swarm.reachability import announcing, check_reachability, map_if_asked, to_announce
from swarm.runtime import LoopThread

logger = logging.getLogger("swarm.doctor")

PROBE_SECONDS = 3.0  # per step of reaching the bootstrap
RECIPE_SECONDS = 10.0
# A record older than FRESH_SECONDS reads as a stopped heartbeat: a clock off by half of it already costs peers.
CLOCK_TOLERANCE = FRESH_SECONDS / 2
MULTISTREAM = b"\x13/multistream/1.0.0\n"  # what a libp2p listener sends first on every new connection


# ---- this machine ---------------------------------------------------------------------------------------------
def fixed_ports(settings: PeerSettings) -> list[tuple[str, str, int]]:
    """(flag, host, port) of each fixed port (not 0) the settings make a peer listen on."""
    net = settings.network
    ports = [("--host-maddrs", *target) for target in map(tcp_target, net.host_maddrs) if target is not None]
    if net.direct_streams and net.direct_port and not net.client_mode:  # DirectStreams binds these hosts
        ports += [("--direct-port", host, net.direct_port) for host in listen_hosts(net.host_maddrs) or ["127.0.0.1"]]
    if settings.metrics.port:
        ports.append(("--metrics-port", settings.metrics.host, settings.metrics.port))
    return ports


def port_taken(host: str, port: int) -> Optional[str]:
    """Why nothing can listen on host:port (e.g. 'Address already in use'), or None if something can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as our servers bind: TIME_WAIT does not count
        try:
            sock.bind((host, port))
            sock.listen()
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_ports(ports: Sequence[tuple[str, str, int]],
                taken: Callable[[str, int], Optional[str]] = port_taken) -> Check:
    if not ports:
        return Check("ports", True, "none fixed (free ones are picked at start)")
    problems = [(flag, host, port, why) for flag, host, port in ports if (why := taken(host, port))]
    if not problems:
        return Check("ports", True, "free: " + ", ".join(f"{port} ({flag})" for flag, _, port in ports))
    flag, _, port, _ = problems[0]
    causes = "; ".join(f"{host}:{port} ({flag}): {why}" for flag, host, port, why in problems)
    return Check("ports", False, f"cannot listen on {causes}: stop what holds it (`ss -ltnp 'sport = :{port}'` "
                                 f"names it; another peer?) or pass another {flag}",
                 {"taken": [dict(flag=f, host=h, port=p, error=w) for f, h, p, w in problems]}, fatal=True)


def check_identity(path: Optional[str], held: Callable[[str], Optional[str]] = identity_held_here) -> Check:
    if path is None:
        return Check("identity", True, "none given: a new peer id each start (--identity-path FILE keeps one)")
    if not os.path.exists(path):
        return Check("identity", True, f"{path} does not exist yet: join creates it")
    try:
        peer_id = Identity.load_or_create(path).peer_id
    except IdentityError as e:
        return Check("identity", False, f"{e}: give --identity-path a key file hivemind wrote, or a new path (a "
                                        "missing file is created)", fatal=True)
    holder = held(path)
    if holder:  # node.py's words: join refuses the same way
        return Check("identity", False, f"identity {path} is in use on this machine by {holder}, or give this peer "
                                        "another --identity-path", {"path": path, "peer_id": peer_id}, fatal=True)
    return Check("identity", True, f"{path} ({peer_id}) is not in use here", {"path": path, "peer_id": peer_id})


# ---- the bootstrap --------------------------------------------------------------------------------------------
async def check_bootstrap(maddr: str, timeout: float = PROBE_SECONDS) -> Check:
    """The steps before libp2p's secure handshake, in order: name resolution (/dns*/), TCP connect, libp2p's
    greeting. The handshake itself (the peer id) is the node's start: see `handshake_failed`."""
    parts = maddr.strip("/").split("/")

    def failed(step: str, cause: str, fix: str) -> Check:
        return Check("bootstrap", False, f"{maddr}: {step} failed: {cause}: {fix}", {"maddr": maddr, "step": step},
                     fatal=True)

    if "/p2p/" not in maddr or len(parts) < 4 or parts[2] != "tcp" or not parts[3].isdigit():
        why = "it has no /p2p/<peer id> part" if "/p2p/" not in maddr else "not a /ip4|ip6|dns/HOST/tcp/PORT/p2p/ID one"
        return failed("reading the address", why, "copy the full multiaddr that `swarm-peer bootstrap` printed")
    kind, host, port = parts[0], parts[1], int(parts[3])
    ip = host
    if kind in ("dns", "dns4", "dns6"):
        family = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6}.get(kind, socket.AF_UNSPEC)
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                host, port, family=family, type=socket.SOCK_STREAM), timeout)
            ip = infos[0][4][0]
        except (OSError, asyncio.TimeoutError, IndexError) as e:
            return failed("name resolution", f"{host} does not resolve ({e or 'timeout'})",
                          f"check the name and this machine's DNS (`getent hosts {host}`)")
    elif kind not in ("ip4", "ip6"):
        return failed("reading the address", f"/{kind}/ is not supported", "use /ip4/, /ip6/ or /dns/")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except ConnectionRefusedError:
        return failed("TCP connect", f"{ip}:{port} refused: nothing listens there",
                      "check that the bootstrap runs and that this is the port it printed")
    except asyncio.TimeoutError:
        return failed("TCP connect", f"no answer from {ip}:{port} within {timeout:.0f} s (host down, or a firewall "
                                     "drops it)", f"check the host is up and port {port}/tcp is open on the way")
    except OSError as e:
        return failed("TCP connect", f"{ip}:{port}: {e.strerror or e}", "check this machine's network")
    try:
        greeting = await asyncio.wait_for(reader.readexactly(len(MULTISTREAM)), timeout)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        greeting = b""
    finally:
        writer.close()
    if greeting != MULTISTREAM:
        return failed("libp2p greeting", f"{ip}:{port} accepts TCP but does not speak libp2p",
                      "that port belongs to another program: use the address the bootstrap printed")
    return Check("bootstrap", True, f"{maddr} resolves, accepts TCP and speaks libp2p", {"maddr": maddr, "ip": ip})


def handshake_failed(maddrs: Sequence[str], reason: str) -> Check:
    """The node could not join though the bootstrap's port speaks libp2p: the secure handshake (peer id) failed."""
    return Check("handshake", False, f"the secure handshake with {', '.join(maddrs)} failed ({reason}): the peer "
                                     "there is not the /p2p/ id in the address (a bootstrap restarted without "
                                     "--identity-path gets a new one): copy the address it prints now",
                 {"reason": reason}, fatal=True)


def check_version(theirs: str, server: str, ours: str = __version__) -> Optional[Check]:
    """Our package version against what the swarm published (None if it published none: nothing to say)."""
    if not theirs:
        return None
    if theirs.split(".")[:2] == ours.split(".")[:2]:
        return Check("version", True, f"swarm-peer {ours}, the swarm's {theirs}", {"ours": ours, "theirs": theirs})
    return Check("version", False, f"this is swarm-peer {ours} but peer {server} runs {theirs}: peers of other "
                                   f"versions may refuse each other's messages; install {theirs} (`pip install "
                                   f"swarm-peer=={theirs}`)", {"ours": ours, "theirs": theirs})


def check_run(local: Recipe, swarm: Recipe, path: str) -> Check:
    if local.digest() == swarm.digest():
        return Check("run", True, f"{path} is the swarm's recipe ({swarm.run_id}, {swarm.digest()[:12]})")
    differ = local.differing_fields(swarm)
    return Check("run", False, f"the swarm trains another run ({swarm.run_id}, recipe {swarm.digest()[:12]}) than "
                               f"{path} ({local.run_id}, {local.digest()[:12]}), differing in {', '.join(differ)}: "
                               "pass the bootstrap of your recipe's run, or drop --recipe to follow this swarm",
                 {"differing": differ, "swarm": swarm.digest(), "local": local.digest()}, fatal=True)


def check_admission(admission: Optional[Admission], run_id: str, identity_path: Optional[str],
                    invite: Optional[str]) -> Optional[Check]:
    """Whether this peer, with the identity and --invite it would join with, may take part in the run: in a private
    run its invite (or the owner's allowlist) must admit its peer id, as join's admission does; None for an open
    run joined without --invite (nothing to say)."""
    if admission is None:
        if invite:
            return Check("admission", True, f"run {run_id} is open to everyone: --invite is not needed")
        return None
    if identity_path is not None and not os.path.exists(identity_path):
        return Check("admission", False, f"run {run_id} is private and identity {identity_path} does not exist yet: "
                                         f"make it and print its peer id (`swarm-peer id --identity-path "
                                         f"{identity_path}`), then ask the run owner for an invite",
                     {"private": True}, fatal=True)
    identity = Identity.load_or_create(identity_path) if identity_path is not None else Identity.ephemeral()
    try:
        admission.join_with(identity, invite)
    except AdmissionError as e:
        return Check("admission", False, str(e), {"private": True, "peer_id": identity.peer_id}, fatal=True)
    finally:
        identity.discard_file()
    return Check("admission", True, f"run {run_id} is private and admits peer {identity.peer_id}",
                 {"private": True, "peer_id": identity.peer_id})


def check_clock(offset: float, server: str, tolerance: float = CLOCK_TOLERANCE) -> Check:
    """`offset`: the swarm's clock minus ours, seconds."""
    details = {"offset_s": round(offset, 3), "server": server}
    if abs(offset) <= tolerance:
        return Check("clock", True, f"{offset:+.2f} s from peer {server[-8:]}", details)
    side = "behind" if offset > 0 else "ahead of"
    return Check("clock", False, f"this machine's clock is {abs(offset):.1f} s {side} peer {server}'s: peers read "
                                 "its announcements as stale or from the future; sync it (`sudo timedatectl "
                                 "set-ntp true`, or an NTP client)", details)


# ---- running them -----------------------------------------------------------------------------------------------
def swarm_checks(answer: DialBack | DialBackError, libp2p: Sequence[str], direct: Sequence[str],
                 settings: PeerSettings, mapped: bool = False) -> list[Check]:
    """Reachability, clock and version, from a dial-back answer (`mapped`: see check_reachability)."""
    if settings.network.client_mode:
        checks = [Check("reachability", True, "client mode: nobody dials this peer, nothing to check")]
    else:
        checks = [check_reachability(answer, libp2p, direct, settings.network.nat_traversal, mapped)]
    if isinstance(answer, DialBack):
        checks.append(check_clock(answer.offset, answer.server))
        version = check_version(answer.version, answer.server)
        checks += [version] if version is not None else []
    return checks


def diagnose(settings: PeerSettings) -> list[Check]:
    """Every check, for `swarm-peer doctor`. Starts a node that listens as join's would (with a throwaway identity)
    to be dialled back. Raises RecipeError for an unreadable --recipe file."""
    local = load_resolved(settings.recipe_file, settings.data_dir or settings.cache_dir) if settings.recipe_file \
        else None
    checks = [check_ports(fixed_ports(settings)), check_identity(settings.network.identity_path),
              check_checkpoint_dir(settings.checkpoints.dir)]
    swarm_recipe, dataset, node, loop = None, None, None, LoopThread()
    try:
        probes = [loop.run(check_bootstrap(m), timeout=4 * PROBE_SECONDS) for m in settings.initial_peers]
        checks += probes
        if any(p.ok for p in probes) and checks[0].ok:  # a port taken would fail the node, not the handshake
            try:
                node = _start_node(settings.model_copy(update={"network": settings.network.model_copy(
                    update={"identity_path": None})}))
                checks.append(Check("handshake", True, f"joined the DHT as {node.peer_id}"))
            except NodeError as e:
                checks.append(Check("handshake", False, str(e), fatal=True))
        if node is not None:
            mapping = map_if_asked(node, settings, loop)
            checks += [mapping] if mapping is not None else []
            answer, libp2p, direct = loop.run(dial_back(node, node.initial_peer_ids,
                                                        announce=not settings.network.client_mode), timeout=60)
            checks += swarm_checks(answer, libp2p, direct, settings, bool(node.port_mappings))
            try:
                swarm_recipe, dataset = loop.run(fetch_run(node, RECIPE_SECONDS), timeout=2 * RECIPE_SECONDS)
            except (RecipeError, TimeoutError) as e:
                checks.append(Check("run", False, str(e), fatal=True))
            else:
                admitted = check_admission(node.admission, swarm_recipe.run_id, settings.network.identity_path,
                                           settings.invite)
                checks += [admitted] if admitted is not None else []
    finally:
        if node is not None:
            node.shutdown()
        loop.close()
    if local is not None and swarm_recipe is not None:
        checks.append(check_run(local, swarm_recipe, settings.recipe_file))
    if swarm_recipe or local:
        return checks + resource_checks(swarm_recipe or local, settings, shared=dataset is not None)
    return checks  # (disk and memory need a recipe; the problem that kept us from the swarm's is the one to fix)


def join_checked(settings: PeerSettings, loop: LoopThread, events: EventLog) -> tuple[SwarmNode, PeerSettings]:
    """join's start: ports and the bootstrap's TCP and libp2p before the node starts (a problem there stops join
    with its line, as NodeError); right after it joined, the port mappings (see NetworkOptions.maps_ports: the
    router's answer in one line) and the dial-back: a peer the swarm dialled only at the IP it saw it at (a
    forwarded port, a mapping) restarts its node announcing that address, keeping its mappings, and one the swarm
    cannot dial restarts it in client mode (under --nat-traversal it relies on relays instead), without them; then
    clock, version, disk and memory, which only warn. Each check is logged (problems one line each) and emitted as
    a `check` event. Returns the node, holding the mappings it keeps (removed at its shutdown), and the settings it
    runs with (client_mode, or the addresses announced, set if it switched)."""
    passed: list[str] = []

    def report(check: Check) -> Check:
        events.emit("check", name=check.name, ok=check.ok, message=check.message)
        if check.ok:
            passed.append(check.name)
        else:
            logger.warning("%s: %s", check.name, check.message)
        return check

    checkpoints = check_checkpoint_dir(settings.checkpoints.dir)  # before training, not when the first is due
    if not checkpoints.ok:
        raise NodeError(checkpoints.message)
    ports, deadline = check_ports(fixed_ports(settings)), time.monotonic() + HOLDER_EXIT_SECONDS
    while not ports.ok and time.monotonic() < deadline:  # a crashed peer's p2pd may be letting go of them
        time.sleep(0.2)
        ports = check_ports(fixed_ports(settings))
    if not ports.ok:  # the error is its line
        raise NodeError(ports.message)
    probes = [loop.run(check_bootstrap(m), timeout=4 * PROBE_SECONDS) for m in settings.initial_peers]
    if not any(p.ok for p in probes):
        raise NodeError(f"could not start the DHT node or reach the swarm: {probes[0].message}")
    for check in (checkpoints, ports, *probes):
        report(check)
    node = _start_node(settings)
    client = settings.network.client_mode
    mapping = map_if_asked(node, settings, loop)
    if mapping is not None:
        logger.info("port mapping: %s", mapping.message)  # (what the router granted, or why nothing, at any rate)
        report(mapping)
    mapped = bool(node.port_mappings)
    answer, libp2p, direct = loop.run(dial_back(node, node.initial_peer_ids, announce=not client), timeout=60)
    for check in swarm_checks(answer, libp2p, direct, settings, mapped):
        report(check)
    announce = to_announce(answer, libp2p, mapped) if not client and isinstance(answer, DialBack) else []
    if not announce and node.port_mappings:  # the swarm dials what we announce: nobody would use them
        for held in node.port_mappings:
            held.release()
        node.port_mappings = []
    if announce:  # its message said so: announce where the swarm dialled us, on the ports it dialled
        settings = announcing(settings, announce, libp2p, node.direct.port if node.direct is not None else None)
        node = _restarted(node, settings)
        answer, libp2p, direct = loop.run(dial_back(node, node.initial_peer_ids), timeout=60)
        report(check_reachability(answer, libp2p, direct, settings.network.nat_traversal))
    if not client and not settings.network.nat_traversal and isinstance(answer, DialBack) \
            and reachable(answer, libp2p) is False:
        # its message said so: from here on we open every connection ourselves, and nobody dials a mapping
        settings = settings.model_copy(update={"network": settings.network.model_copy(update={"client_mode": True})})
        node = _restarted(node, settings, keep_mappings=False)
    if not settings.network.client_mode:
        loop.run(serve_dialback(node, __version__), timeout=30)
    try:
        recipe, dataset = loop.run(fetch_run(node, RECIPE_SECONDS), timeout=2 * RECIPE_SECONDS)
    except (RecipeError, TimeoutError):
        recipe = dataset = None  # the peer's own read of the recipe says what is wrong
    for check in resource_checks(recipe, settings, shared=dataset is not None) if recipe is not None else []:
        report(check)
    logger.info("checks passed: %s", ", ".join(dict.fromkeys(passed)))
    return node, settings


def _restarted(node: SwarmNode, settings: PeerSettings, keep_mappings: bool = True) -> SwarmNode:
    """`node` shut down and a new one started with `settings`, holding `node`'s port mappings if `keep_mappings`
    (the ports stay the same: see _announcing), else with them removed."""
    mappings = node.port_mappings if keep_mappings else []
    if keep_mappings:
        node.port_mappings = []  # (not removed by its shutdown)
    node.shutdown()
    try:
        restarted = _start_node(settings)
    except BaseException:
        for mapping in mappings:
            mapping.release()
        raise
    restarted.port_mappings = mappings
    return restarted


def _start_node(settings: PeerSettings) -> SwarmNode:
    """The node, or NodeError; when it cannot reach a bootstrap that speaks libp2p, the error names the handshake."""
    try:
        return SwarmNode(settings.initial_peers, NetworkOptions(**settings.network.model_dump()))
    except NodeError as e:
        if "could not start the DHT node or reach" not in str(e):
            raise
        raise NodeError(handshake_failed(settings.initial_peers, str(e).rsplit(": ", 1)[-1]).message) from None
