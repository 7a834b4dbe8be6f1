"""The shipped nftables rules, loaded on a LAN of network namespaces.

Each host runs ``deploy/nftables/llamapool.nft`` with the test LAN's
addresses in its three sets, and plain TCP listeners stand on llamapool's
ports (what answers there does not matter to a firewall). Checked, host by
host: the balancer reaches the frontend's HTTP port and nobody else does;
only frontend hosts reach the broker's frontends port; only worker hosts
reach its workers port.
"""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.deploy.netns import Lan, NetnsExecutor, namespaces_work
from tests.system_tools import require_tool, unavailable

pytestmark = pytest.mark.stack

RULES = Path(__file__).resolve().parents[2] / "deploy" / "nftables" / "llamapool.nft"
HTTP, FRONTENDS, WORKERS = 8080, 5555, 5556
HOSTS = {"lb": 5, "broker": 2, "wh": 11, "fh": 21, "outsider": 100}
LISTENS = {"fh": [HTTP], "broker": [FRONTENDS, WORKERS]}
#: Who may connect to what; every other pair must be refused.
ALLOWED = {("lb", "fh", HTTP), ("fh", "broker", FRONTENDS),
           ("wh", "broker", WORKERS)}


def render(addresses: dict[str, str]) -> str:
    """The shipped rules with this LAN's addresses in the sets."""
    text = RULES.read_text()
    for define, host in (("llamapool_balancers", "lb"),
                         ("llamapool_frontends", "fh"),
                         ("llamapool_workers", "wh")):
        text, n = re.subn(rf"^define {define} = \{{[^}}]*\}}$",
                          f"define {define} = {{ {addresses[host]} }}",
                          text, flags=re.M)
        assert n == 1, f"one {define} set in the shipped rules"
    return text


def connects(address: str, port: int) -> bool:
    """True if a TCP connection is accepted; False if it is reset."""
    try:
        with socket.create_connection((address, port), timeout=30):
            return True
    except ConnectionRefusedError:
        return False


@pytest.fixture(scope="module")
def lan(tmp_path_factory):
    why_not = namespaces_work()
    if why_not:
        unavailable(why_not)
    nft = require_tool("nft")
    lan = Lan()
    pools: list[NetnsExecutor] = []
    listeners: list[socket.socket] = []
    try:
        hosts = {name: lan.add_host(name, octet) for name, octet in HOSTS.items()}
        rules = tmp_path_factory.mktemp("nft") / "llamapool.nft"
        rules.write_text(render({n: h.address for n, h in hosts.items()}))
        for host in hosts.values():
            subprocess.run(["ip", "netns", "exec", host.netns, nft, "-f", str(rules)],
                           check=True, capture_output=True)
        executors = {name: NetnsExecutor(host, max_workers=1)
                     for name, host in hosts.items()}
        pools += executors.values()
        for name, ports in LISTENS.items():
            for port in ports:
                listeners.append(executors[name].call(
                    socket.create_server, (hosts[name].address, port), backlog=64))
        yield hosts, executors
    finally:
        for sock in listeners:
            sock.close()
        for pool in pools:
            pool.shutdown()
        lan.close()


@pytest.mark.parametrize("source", sorted(HOSTS))
def test_llamapool_ports_answer_only_their_peers(lan, source):
    hosts, executors = lan
    reached = {(source, target, port): executors[source].call(
                   connects, hosts[target].address, port)
               for target, ports in LISTENS.items() for port in ports
               if target != source}
    expected = {key: key in ALLOWED for key in reached}
    assert reached == expected
