"""The hosts a stage sends frames to (issue 22, N8: with --peers empty, its default, a
stage sent a hidden-state frame to any address an `Open` named, and wrote to ports that
speak no data plane): loopback by default, else the listed hosts and networks."""

from __future__ import annotations

import pytest
from specpipe.services.peers import Peers


def test_by_default_only_loopback() -> None:
    peers = Peers.parse([])
    for host in ("127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1", "localhost", "LOCALHOST."):
        assert peers.allows(host), host
    for host in ("10.0.0.5", "192.0.2.1", "0.0.0.0", "::", "fd00::2", "evil.example", "127.1"):
        assert not peers.allows(host), host


def test_hosts_addresses_and_networks() -> None:
    peers = Peers.parse(["10.0.0.0/8", " 192.0.2.7 ", "stage-1.specpipe", "fd00::/64", ""])
    for host in ("10.1.2.3", "192.0.2.7", "Stage-1.specpipe", "fd00::2", "::ffff:10.9.9.9"):
        assert peers.allows(host), host
    for host in ("192.0.2.8", "127.0.0.1", "localhost", "stage-2.specpipe", "fd01::1"):
        assert not peers.allows(host), host
    assert str(peers) == "10.0.0.0/8,192.0.2.7,stage-1.specpipe,fd00::/64"


@pytest.mark.parametrize("bad", ["a b", "10.0.0.0/33", "-x", "host:80", "x" * 300])
def test_what_is_no_host_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="neither"):
        Peers.parse([bad])
