"""Volunteers behind home routers, with real NAT in network namespaces (tests/nat_harness.py): a public bootstrap and
peer on the hub, and peers behind routers that masquerade and forward nothing, each joining with no flag but
--initial-peers and --host-maddrs. The join check concludes: the dial-back server tries the IP it saw the peer at, at
the announced port; nothing answers there, so the peer switches to client mode by itself and says so in one line.
A peer whose router forwards its ports is dialled at the router's address instead and announces that one."""

from __future__ import annotations

import time

import pytest
import yaml

from conftest import TINY_RECIPE, stop_all
from nat_harness import Internet, nat_unavailable

REASON = nat_unavailable()
ROUNDS = 3
FORWARDED = (31337, 31338)  # the libp2p and direct-stream ports a forwarding router forwards (inside namespaces)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"NAT harness unavailable: {REASON}")


@pytest.fixture
def internet(request, tmp_path):
    """(net, start): the namespaces, and `start(host, argv, name)` for a `python -m swarm` child in one of them;
    at the end every child is SIGKILLed (the test fails if one leaves processes behind) and the namespaces go."""
    started = []
    request.node.swarm_processes = started
    with Internet() as net:
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


@pytest.mark.slow
def test_peers_behind_home_routers_switch_to_client_mode_and_average(internet, tmp_path, cache_dir):
    """Bootstrap and one peer public, two peers each behind a router that forwards nothing. Both NAT'd peers conclude
    within their join check that the swarm cannot dial them (it tried their router's address at their port) and go
    on in client mode, saying so in one line; the public peer is dialled back at its own address. The three average
    every round in one group (groups of 3 pinned: the public peer reduces for both clients), with equal digests."""
    net, start = internet
    boot_host, public_host = net.public("boot"), net.public("pub")
    homes = [net.home("home1"), net.home("home2")]
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    recipe["averaging"]["min_group_size"] = 3
    (tmp_path / "three.yaml").write_text(yaml.safe_dump(recipe))
    boot = start(boot_host, ["bootstrap", "--recipe", str(tmp_path / "three.yaml"), "--host-maddrs",
                             boot_host.maddr()], "boot")
    maddr = boot.wait_event("listening", 60)["maddrs"][0]
    assert f"/ip4/{boot_host.address}/" in maddr, maddr
    until, launched = ["--until-round", str(ROUNDS)], time.time()
    public = start(public_host, _join(maddr, public_host, cache_dir, *until), "public")
    natted = [start(home, _join(maddr, home, cache_dir, *until), f"natted{i}") for i, home in enumerate(homes, 1)]

    for peer, home in zip(natted, homes):
        reach = peer.wait_event("check", 60, name="reachability")
        assert not reach["ok"] and "join switches to client mode" in reach["message"], reach
        assert f"it is seen at {home.router.wan}, where /ip4/{home.router.wan}/tcp/" in reach["message"], reach
        checks = peer.events("check", name="checkpoint dir")[0]["time"]  # join reports it as its node starts
        print(f"{peer.name}: started {checks - launched:.1f} s, concluded {reach['time'] - launched:.1f} s, "
              f"joined in client mode {peer.wait_event('joined', 60)['time'] - launched:.1f} s after launch")
    reach = public.wait_event("check", 60, name="reachability")
    assert reach["ok"] and public_host.address in reach["message"], reach

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
