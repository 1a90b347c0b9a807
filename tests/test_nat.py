"""Volunteers behind home routers, with real NAT in network namespaces (tests/nat_harness.py): a public bootstrap and
peer on the hub, and peers behind routers that masquerade and forward nothing, each joining with no flag but
--initial-peers and --host-maddrs. The join check concludes: the dial-back server tries the IP it saw the peer at, at
the announced port; nothing answers there, so the peer switches to client mode by itself and says so in one line.
A peer whose router forwards its ports is dialled at the router's address instead and announces that one, and so is
a peer behind a router running miniupnpd, which maps its ports on request (port mapping is on by default)."""

from __future__ import annotations

import time

import pytest
import yaml

from conftest import TINY_RECIPE, stop_all
from nat_harness import PUBLIC_SUBNET, Internet, nat_unavailable, upnp_unavailable

REASON = nat_unavailable()
UPNP_REASON = REASON or upnp_unavailable()
ROUNDS = 3
FORWARDED = (31337, 31338)  # the libp2p and direct-stream ports a forwarding router forwards (inside namespaces)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"NAT harness unavailable: {REASON}")


@pytest.fixture
def internet(request, tmp_path):
    """(net, start): the namespaces, and `start(host, argv, name)` for a `python -m swarm` child in one of them;
    at the end every child is SIGKILLed (the test fails if one leaves processes behind) and the namespaces go."""
    yield from _internet(request, tmp_path, Internet())


@pytest.fixture
def public_internet(request, tmp_path):
    """As `internet`, on a hub of public addresses, where a router may run miniupnpd (see nat_harness)."""
    yield from _internet(request, tmp_path, Internet(subnet=PUBLIC_SUBNET, workdir=tmp_path / "routers"))


def _internet(request, tmp_path, internet: Internet):
    started = []
    request.node.swarm_processes = started
    with internet as net:
        def start(host, argv: list[str], name: str):
            started.append(net.process(host, argv, name, tmp_path))
            return started[-1]

        yield net, start
        leaks = stop_all(started)
    if leaks:
        pytest.fail("processes outlived the main process that started them: " + "; ".join(leaks), pytrace=False)


def _join(maddr: str, host, cache_dir, *extra: str, port: int = 0) -> list[str]:
    return ["join", "--initial-peers", maddr, "--host-maddrs", host.maddr(port), "--device", "cpu", "--num-threads",
            "1", "--cache-dir", str(cache_dir), *extra]


def _p2pd_args(process) -> list[str]:
    """The command line of the p2pd that `process` started (one in its session), or []."""
    import os

    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{entry}/cmdline", "rb").read().decode().split("\0")
            session = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if os.path.basename(args[0]) == "p2pd" and session == process.pid:
            return args
    return []


def _bootstrap_in_threes(start, host, tmp_path) -> tuple[dict, str]:
    """A bootstrap on `host` serving tests/recipes/tiny.yaml with groups of 3 pinned (every group then holds the
    public peer and both others): (the recipe, its join multiaddr)."""
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    recipe["averaging"]["min_group_size"] = 3
    (tmp_path / "three.yaml").write_text(yaml.safe_dump(recipe))
    boot = start(host, ["bootstrap", "--recipe", str(tmp_path / "three.yaml"), "--host-maddrs", host.maddr()], "boot")
    return recipe, boot.wait_event("listening", 60)["maddrs"][0]


@pytest.mark.slow
def test_peers_behind_home_routers_switch_to_client_mode_and_average(internet, tmp_path, cache_dir, request):
    """Bootstrap and one peer public, two peers each behind a router that forwards nothing. Both NAT'd peers conclude
    within their join check that the swarm cannot dial them (it tried their router's address at their port) and go
    on in client mode, saying so in one line. With nobody but them and the bootstrap online they cannot average, and
    each says why in one line (said once); the public peer then joins, is dialled back at its own address, and the
    clients average within about a matchmaking window of its start. The three average every round in one group
    (groups of 3 pinned: the public peer reduces for both clients), with equal digests."""
    net, start = internet
    boot_host, public_host = net.public("boot"), net.public("pub")
    homes = [net.home("home1"), net.home("home2")]
    recipe, maddr = _bootstrap_in_threes(start, boot_host, tmp_path)
    assert f"/ip4/{boot_host.address}/" in maddr, maddr
    until, launched = ["--until-round", str(ROUNDS)], time.time()
    natted = [start(home, _join(maddr, home, cache_dir, *until), f"natted{i}") for i, home in enumerate(homes, 1)]

    for peer, home in zip(natted, homes):
        reach = peer.wait_event("check", 60, name="reachability")
        assert not reach["ok"] and "join switches to client mode" in reach["message"], reach
        assert f"it is seen at {home.router.wan}, where /ip4/{home.router.wan}/tcp/" in reach["message"], reach
        checks = peer.events("check", name="checkpoint dir")[0]["time"]  # join reports it as its node starts
        print(f"{peer.name}: started {checks - launched:.1f} s, concluded {reach['time'] - launched:.1f} s, "
              f"joined in client mode {peer.wait_event('joined', 60)['time'] - launched:.1f} s after launch")
    for peer in natted:  # alone with each other: nobody can reduce, and they say so
        peer.wait_for(r"no peer of the swarm accepts connections: every peer online is in client mode", 90)
        assert not peer.events("averaged")
    public = start(public_host, _join(maddr, public_host, cache_dir, *until), "public")
    reach = public.wait_event("check", 60, name="reachability")
    assert reach["ok"] and public_host.address in reach["message"], reach
    training = public.wait_event("training", 60)["time"]
    window = recipe["averaging"]["matchmaking_timeout"]
    for peer in natted:
        first = peer.wait_event("averaged", 3 * window + 60)["time"]
        print(f"{peer.name}: first averaged {first - training:.1f} s after the public peer started training")
        assert first - training < 2 * window + 10, (first - training, window)
        said = [line for line in peer.lines if "no peer of the swarm accepts connections" in line]
        assert len(said) == 1, said

    # Nothing is relayed: every node's p2pd (the bootstrap's too) runs with relays off, so each byte averaged went
    # over a connection one of its two ends opened (the docs' "bytes relayed: 0").
    daemons = [_p2pd_args(process) for process in request.node.swarm_processes]
    assert len(daemons) == 4 and all("-relay=0" in args and "-relayService=0" in args for args in daemons), daemons
    for peer in (public, *natted):
        assert peer.wait(90) == 0, peer.output()[-3000:]
        assert peer.events("training")[0]["client"] is (peer is not public), peer.events("training")
        assert len(peer.events("check", name="reachability")) == 1, "one line says it"
    members = {peer.events("joined")[0]["peer_id"] for peer in (public, *natted)}
    for round_no in range(ROUNDS):
        averaged = [peer.events("averaged", round=round_no) for peer in (public, *natted)]
        assert all(len(a) == 1 and set(a[0]["members"]) == members for a in averaged), averaged
        assert len({a[0]["digest"] for a in averaged}) == 1, f"round {round_no}: digests differ: {averaged}"


@pytest.mark.slow
def test_a_peer_behind_a_forwarding_router_announces_the_routers_address(internet, cache_dir):
    """Its router forwards its two ports: the dial-back finds them at the router's address, not at the LAN one the
    peer listens on, and join restarts its node announcing the router's address, where it is dialled back."""
    net, start = internet
    boot_host, home = net.public("boot"), net.home("home", forwarded=FORWARDED)
    boot = start(boot_host, ["bootstrap", "--recipe", str(TINY_RECIPE), "--host-maddrs", boot_host.maddr()], "boot")
    maddr = boot.wait_event("listening", 60)["maddrs"][0]
    peer = start(home, _join(maddr, home, cache_dir, "--direct-port", str(FORWARDED[1]), port=FORWARDED[0]),
                 "forwarded")
    peer.wait_event("joined", 60)  # (join's checks are over)
    reach = peer.events("check", name="reachability")
    assert len(reach) == 2, reach
    found, confirmed = reach
    seen = f"/ip4/{home.router.wan}/tcp/{FORWARDED[0]}"
    assert found["ok"] and f"saw this peer at {home.router.wan}" in found["message"], found
    assert f"join announces {seen}" in found["message"] and "direct-stream" not in found["message"], found
    assert confirmed["ok"] and confirmed["message"].endswith(f"dialled back {seen}"), confirmed
    assert not any("client mode" in line for line in peer.lines)


@pytest.mark.slow
@pytest.mark.skipif(UPNP_REASON is not None, reason=f"miniupnpd harness unavailable: {UPNP_REASON}")
def test_a_peer_behind_a_upnp_router_maps_its_ports_and_reduces_as_a_full_peer(public_internet, tmp_path, cache_dir):
    """Bootstrap and one peer public; one peer behind a router running miniupnpd, another behind a plain MASQUERADE
    router; no flag but --initial-peers and --host-maddrs. The first asks its router by NAT-PMP to forward its libp2p
    and direct-stream ports (port mapping is on by default off loopback), is dialled back at the router's address,
    announces it and averages as a full peer: it reduces parts, so it sends more a round than the client, which
    only sends its own. The second finds no NAT-PMP at its router (in one line) and goes on in client mode. The three
    average every round in one group, with equal digests; the mappings are gone from the router once the peer
    stopped."""
    net, start = public_internet
    boot_host, public_host = net.public("boot"), net.public("pub")
    mapped_host, natted_host = net.home("upnp", upnp=True), net.home("natted")
    router = mapped_host.router
    recipe, maddr = _bootstrap_in_threes(start, boot_host, tmp_path)
    until, launched = ["--until-round", str(ROUNDS)], time.time()
    public = start(public_host, _join(maddr, public_host, cache_dir, *until), "public")
    mapped = start(mapped_host, _join(maddr, mapped_host, cache_dir, *until), "mapped")
    natted = start(natted_host, _join(maddr, natted_host, cache_dir, *until), "natted")

    mapping = mapped.wait_event("check", 60, name="port mapping")
    assert f"the router {router.lan} forwards {router.wan}:" in mapping["message"], mapping
    assert "(libp2p)" in mapping["message"] and "(direct-stream)" in mapping["message"], mapping
    mapped.wait_event("joined", 60)
    found, confirmed = mapped.events("check", name="reachability")
    announced = found["message"].rsplit("join announces ", 1)[-1]
    assert found["ok"] and announced.startswith(f"/ip4/{router.wan}/tcp/"), found
    assert "direct-stream port does not answer" not in found["message"], found
    assert confirmed["ok"] and confirmed["message"].endswith(f"dialled back {announced}"), confirmed
    port = announced.rsplit("/", 1)[1]
    redirects = router.redirects()
    assert any(f"dport {port} dnat ip to {mapped_host.address}:{port}" in rule for rule in redirects), redirects
    started = mapped.events("check", name="checkpoint dir")[0]["time"]  # join reports it as its node starts
    print(f"mapped: checks began {started - launched:.1f} s after launch; mapped {mapping['time'] - started:.1f} s, "
          f"dialled back at {router.wan} {found['time'] - started:.1f} s, announcing it and dialled back there "
          f"{confirmed['time'] - started:.1f} s after join's checks began; miniupnpd holds {redirects}")

    natted_mapping = natted.wait_event("check", 60, name="port mapping")
    assert natted_mapping["message"].startswith(f"none: the router {natted_host.router.lan} ") \
        and "answer NAT-PMP" in natted_mapping["message"], natted_mapping
    reach = natted.wait_event("check", 60, name="reachability")
    assert not reach["ok"] and "join switches to client mode" in reach["message"], reach

    for peer in (public, mapped, natted):
        assert peer.wait(90) == 0, peer.output()[-3000:]
        assert peer.events("training")[0]["client"] is (peer is natted), (peer.name, peer.events("training"))
    assert not any(f"{mapped_host.address}:" in rule for rule in router.redirects()), \
        f"mappings left on the router after the peer stopped: {router.redirects()}"
    members = {peer.events("joined")[0]["peer_id"] for peer in (public, mapped, natted)}
    for round_no in range(ROUNDS):
        averaged = [peer.events("averaged", round=round_no) for peer in (public, mapped, natted)]
        assert all(len(a) == 1 and set(a[0]["members"]) == members for a in averaged), averaged
        assert len({a[0]["digest"] for a in averaged}) == 1, f"round {round_no}: digests differ: {averaged}"
        # A client sends its vector once (to the reducers); a reducer of share s also sends s of the average to the
        # two others: (1 + s) times as much.
        sent = {peer.name: a[0]["bytes_sent"] for peer, a in zip((public, mapped, natted), averaged)}
        assert sent["mapped"] > 1.1 * sent["natted"] and sent["public"] > 1.1 * sent["natted"], sent
        print(f"round {round_no}: averaged {max(a[0]['time'] for a in averaged) - launched:.1f} s after launch, "
              f"bytes sent {sent}")



MAP_SCRIPT = """
import asyncio, sys
from swarm.dht.portmap import map_ports

async def main():
    held, line = await map_ports({40400: "libp2p", 40401: "direct-stream"})
    print(line, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for mapping in held:
        await mapping.close()
    print("closed", flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(UPNP_REASON is not None, reason=f"miniupnpd router unavailable: {UPNP_REASON}")
def test_a_router_that_speaks_only_upnp_maps_the_ports_by_upnp_and_a_router_with_neither_says_both(public_internet):
    """Most home routers speak UPnP IGD and not NAT-PMP: miniupnpd with NAT-PMP off. The peer's port mapping finds
    the router by SSDP, maps both ports at the same external ports to its LAN address (the router's rules show them)
    and removes them at the end; one line says what was granted, and by UPnP. Behind a plain router the line says
    why neither NAT-PMP nor UPnP gave a mapping."""
    import subprocess
    import sys

    net, _ = public_internet
    upnp_only, plain = net.home("upnponly", upnp=True, natpmp=False), net.home("plain")
    router = upnp_only.router
    started = time.monotonic()
    mapper = subprocess.Popen([*upnp_only.prefix(), sys.executable, "-c", MAP_SCRIPT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = mapper.stdout.readline().strip()
        assert line == (f"the router {router.lan} forwards by UPnP {router.wan}:40400 (libp2p), {router.wan}:40401 "
                        "(direct-stream) to this machine's same ports for 3600 s, renewed while the peer runs"), \
            line + mapper.stdout.read() if mapper.poll() is not None else line
        print(f"a UPnP-only router: mapped in {time.monotonic() - started:.1f} s, with Python starting")
        redirects = router.redirects()
        for port in (40400, 40401):
            assert any(f"dport {port} dnat ip to {upnp_only.address}:{port}" in rule for rule in redirects), redirects
        mapper.stdin.write("\n")
        mapper.stdin.flush()
        assert mapper.stdout.readline().strip() == "closed" and mapper.wait(10) == 0
    finally:
        mapper.kill()
    assert not any(f"{upnp_only.address}:" in rule for rule in router.redirects()), router.redirects()
    started = time.monotonic()
    found = subprocess.run([*plain.prefix(), sys.executable, "-c", MAP_SCRIPT], input="\n", capture_output=True,
                           text=True, timeout=30)
    line = found.stdout.splitlines()[0]
    assert line.startswith(f"none: the router {plain.router.lan} ") and "answer NAT-PMP" in line \
        and f"no UPnP gateway answered at {plain.router.lan} in 1.5 s" in line, found.stdout + found.stderr
    print(f"a router with neither: {time.monotonic() - started:.1f} s, with Python starting")
