"""Ask the home router for port mappings by UPnP IGD, for routers that do not speak NAT-PMP (portmap.py asks that
first): most home routers speak UPnP only. Discovery is one SSDP search on the LAN (multicast, UDP 1900); only the
default route's gateway is believed, and only a description and control URL at that gateway's own address are
fetched or posted to. Then SOAP calls to its WANIPConnection (or WANPPPConnection) service: GetExternalIPAddress,
AddPortMapping (the same external port as the internal one, to this host's LAN address), DeletePortMapping. Every
exchange is bounded in time and size; whatever the router says is only a claim, as with NAT-PMP, until the
dial-back finds the port open."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Optional

SSDP = ("239.255.255.250", 1900)
SEARCH_SECONDS = 1.5  # how long the LAN is listened to for the gateway's answer (routers answer in milliseconds)
HTTP_SECONDS = 3.0  # each fetch or call of the router's description or control URL
MAX_BYTES = 1 << 16  # of an answer read from the router
SERVICES = ("urn:schemas-upnp-org:service:WANIPConnection:2", "urn:schemas-upnp-org:service:WANIPConnection:1",
            "urn:schemas-upnp-org:service:WANPPPConnection:1")
ONLY_PERMANENT = "725"  # OnlyPermanentLeasesSupported: the router maps only with lease 0 (we remove it at close)


class UpnpError(Exception):
    """No UPnP gateway answered, or it refused; the message says which, in one line."""


@dataclass(frozen=True)
class Gateway:
    address: str  # the router's LAN address
    control_url: str
    service: str
    local_ip: str  # this host's address towards the router: the mapping's internal client


def _search() -> bytes:
    return (f"M-SEARCH * HTTP/1.1\r\nHOST: {SSDP[0]}:{SSDP[1]}\r\nMAN: \"ssdp:discover\"\r\nMX: 1\r\n"
            f"ST: urn:schemas-upnp-org:device:InternetGatewayDevice:1\r\n\r\n").encode()


class _Answers(asyncio.DatagramProtocol):
    def __init__(self, gateway: str) -> None:
        self.gateway, self.location = gateway, asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr) -> None:
        found = re.search(rb"(?im)^location:\s*(\S+)\s*$", data[:4096])
        if addr[0] == self.gateway and found and not self.location.done():
            self.location.set_result(found.group(1).decode("ascii", "replace"))


async def discover(gateway: str, timeout: float = SEARCH_SECONDS) -> Gateway:
    """The UPnP IGD at `gateway` (its LAN address): its connection service's control URL. Raises UpnpError."""
    loop = asyncio.get_running_loop()
    transport, answers = await loop.create_datagram_endpoint(lambda: _Answers(gateway), family=socket.AF_INET,
                                                             local_addr=("0.0.0.0", 0))
    try:
        for _ in range(2):  # (UDP: a second search in case the first was lost)
            transport.sendto(_search(), SSDP)
        location = await asyncio.wait_for(asyncio.shield(answers.location), timeout)
    except (asyncio.TimeoutError, OSError) as e:
        raise UpnpError(f"no UPnP gateway answered at {gateway} in {timeout:.1f} s"
                        + ("" if isinstance(e, asyncio.TimeoutError) else f" ({e})")) from None
    finally:
        transport.close()
    description = await asyncio.to_thread(_fetch, _at(location, gateway), None, None)
    control, service = _service(description, location, gateway)
    return Gateway(gateway, control, service, _local_ip(gateway))


def _at(url: str, gateway: str) -> str:
    """`url` if it is plain HTTP at the gateway's own address, else UpnpError: we post nowhere else."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname != gateway:
        raise UpnpError(f"the UPnP gateway {gateway} pointed at {url[:100]!r}, not an http URL at its own address")
    return url


def _service(description: bytes, location: str, gateway: str) -> tuple[str, str]:
    try:
        root = ElementTree.fromstring(description)
    except ElementTree.ParseError as e:
        raise UpnpError(f"the UPnP gateway {gateway} described itself in malformed XML ({e})") from None
    found = {}
    for service in root.iter():
        if service.tag.endswith("}service") or service.tag == "service":
            fields = {child.tag.rsplit("}", 1)[-1]: (child.text or "").strip() for child in service}
            if fields.get("serviceType") in SERVICES and fields.get("controlURL"):
                found[fields["serviceType"]] = fields["controlURL"]
    for kind in SERVICES:
        if kind in found:
            return _at(urllib.parse.urljoin(location, found[kind]), gateway), kind
    raise UpnpError(f"the UPnP gateway {gateway} offers no WANIPConnection or WANPPPConnection service")


def _local_ip(gateway: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((gateway, SSDP[1]))  # (no packet: picks the route's source address)
        return probe.getsockname()[0]


def _fetch(url: str, body: Optional[bytes], action: Optional[str]) -> bytes:
    """GET `url`, or POST the SOAP `body` for `action`, with no proxy; the answer's first MAX_BYTES. A SOAP fault
    raises UpnpError with its UPnP error code and description."""
    headers = {} if action is None else {"Content-Type": 'text/xml; charset="utf-8"', "SOAPAction": f'"{action}"'}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, body, headers), timeout=HTTP_SECONDS) as answer:
            return answer.read(MAX_BYTES)
    except urllib.error.HTTPError as e:
        text = e.read(MAX_BYTES).decode("utf-8", "replace")
        code = re.search(r"<errorCode>\s*(\d+)", text)
        why = re.search(r"<errorDescription>([^<]{0,200})", text)
        raise UpnpError(f"the UPnP gateway refused {action or url}: HTTP {e.code}"
                        + (f", UPnP error {code.group(1)}" if code else "") + (f" ({why.group(1)})" if why else ""))
    except (OSError, ValueError) as e:
        raise UpnpError(f"the UPnP gateway did not answer {action or url}: {e}") from None


async def _call(gateway: Gateway, action: str, **arguments: object) -> bytes:
    fields = "".join(f"<{name}>{value}</{name}>" for name, value in arguments.items())
    body = ('<?xml version="1.0"?><s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/" '
            's:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/"><s:Body>'
            f'<u:{action} xmlns:u="{gateway.service}">{fields}</u:{action}></s:Body></s:Envelope>').encode()
    return await asyncio.to_thread(_fetch, gateway.control_url, body, f"{gateway.service}#{action}")


async def external_ip(gateway: Gateway) -> str:
    found = re.search(rb"<NewExternalIPAddress>\s*([0-9.]{7,15})\s*<", await _call(gateway, "GetExternalIPAddress"))
    if not found:
        raise UpnpError(f"the UPnP gateway {gateway.address} gave no external IPv4 address")
    return found.group(1).decode()


async def map_tcp(gateway: Gateway, port: int, lease: int) -> int:
    """Map TCP `port` at the router's external address to the same port of this host for `lease` s; the lease the
    router holds it for (0: until removed, where it takes no other)."""
    async def add(seconds: int) -> None:
        await _call(gateway, "AddPortMapping", NewRemoteHost="", NewExternalPort=port, NewProtocol="TCP",
                    NewInternalPort=port, NewInternalClient=gateway.local_ip, NewEnabled=1,
                    NewPortMappingDescription="swarm-peer", NewLeaseDuration=seconds)

    try:
        await add(lease)
        return lease
    except UpnpError as e:
        if f"UPnP error {ONLY_PERMANENT}" not in str(e):
            raise
    await add(0)
    return 0


async def unmap_tcp(gateway: Gateway, port: int) -> None:
    await _call(gateway, "DeletePortMapping", NewRemoteHost="", NewExternalPort=port, NewProtocol="TCP")
