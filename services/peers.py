"""The hosts a stage or the draft may send data-plane frames to (`specpipe stage|draft
--peers`).

A request's next hop and report address come from whoever opens the request; a stage
sends hidden states and error frames only to hosts on this list, in every mode, so
nobody can make it connect elsewhere (another host, or a port of its own that speaks
something else). The list holds IP networks in CIDR notation ("10.0.0.0/8"), single
addresses ("10.0.0.5") and host names ("stage-1.specpipe", compared as written, without
resolving them). Without a list a stage sends only to loopback (`DEFAULT_PEERS`): a
deployment on one machine needs nothing, one across machines names its network.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from specpipe.common.runtime.errors import InvalidInput

from .transport.base import Address

DEFAULT_PEERS = ("127.0.0.0/8", "::1/128", "localhost")
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$"
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Peers:
    networks: tuple[Network, ...]
    names: frozenset[str]
    text: str  # as given, for messages

    @classmethod
    def parse(cls, items: Iterable[str]) -> Peers:
        """Peers from addresses, CIDR networks and host names (none: `DEFAULT_PEERS`);
        ValueError names an entry that is none of these."""
        given = [item.strip() for item in items if item.strip()] or list(DEFAULT_PEERS)
        networks: list[Network] = []
        names: set[str] = set()
        for item in given:
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
                continue
            except ValueError:
                pass
            name = item.lower().rstrip(".")
            if not _HOST_NAME.match(name):
                raise ValueError(
                    f"peer {item!r} is neither an IP address, a CIDR network nor a host name"
                )
            names.add(name)
        return cls(tuple(networks), frozenset(names), ",".join(given))

    def allows(self, host: str) -> bool:
        """Whether `host` (an address's host: an IP or a name) is one of the peers."""
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host.lower().rstrip(".") in self.names
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)

    def check_hop(self, address: str, scheme: str, who: str) -> None:
        """An address to send frames to (a next hop, a report or reply address) must be
        a data-plane address of this deployment's transport (`scheme`) on one of the
        peers; InvalidInput says why not (`who`: whose peers, for the message)."""
        try:
            addr = Address.parse(address)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        if addr.scheme != scheme:
            raise InvalidInput(f"{address}: this deployment's data plane is {scheme}")
        if not self.allows(addr.host):
            raise InvalidInput(
                f"{address}: {addr.host} is not one of {who}'s peers ({self}; see --peers)"
            )

    def __str__(self) -> str:
        return self.text
