"""Egress by name under attack: what a hostile program or a hostile input tried, and must not get.

Each test here pins a hole that was open: the mediator's rebinding guard, the
proxy's parsing, and the checks of the allow-list's own input. Mediators run
on the host's loopback (as in test_egress_mediator.py): no sandbox is needed
to speak to them the way a program inside would.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from conftest import NAMESPACES_WHY
from test_egress_mediator import FakeResolver, _recv_all, _rules, plan

import isolate
from isolate.egress import dns
from isolate.model.egress_rules import is_public

# --- the rebinding guard: IPv6 addresses that stand for IPv4 ones ---------------------------------

@pytest.mark.parametrize("address", [
    "64:ff9b::a00:5",          # NAT64 (RFC 6052): a DNS64/NAT64 network translates it to 10.0.0.5
    "64:ff9b::7f00:1",         # ... and this one to 127.0.0.1
    "64:ff9b::a9fe:a9fe",      # ... and this one to 169.254.169.254, a cloud's metadata service
    "64:ff9b:1::a00:5",        # the local-use NAT64 prefix (RFC 8215)
    "2002:a00:5::1",           # 6to4 of 10.0.0.5
    "::a00:5",                 # IPv4-compatible (deprecated; ::/96)
    "::ffff:0:a00:5",          # IPv4-translated (SIIT)
    "fec0::1",                 # site-local (deprecated, still routed inside some networks)
])
def test_ipv6_that_carries_a_private_address_is_not_public(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", ["64:ff9b::5db8:d822", "2002:5db8:d822::1", "2606:2800:220:1::1",
                                     "93.184.216.34", "::ffff:93.184.216.34"])
def test_public_addresses_stay_public(address: str) -> None:
    assert is_public(address)


def test_dns_rebinding_through_nat64_and_6to4_is_refused() -> None:
    upstream = FakeResolver({"nat64.test": ["64:ff9b::a00:5"], "sixtofour.test": ["2002:7f00:1::1"],
                             "site.test": ["fec0::5"], "public64.test": ["64:ff9b::5db8:d822"]})
    names = ("nat64.test", "sixtofour.test", "site.test", "public64.test")
    try:
        with plan(_rules(*((n, (443,)) for n in names), resolver=("127.0.0.1", upstream.port))) as p:
            for name in names[:3]:
                assert p.query(name).rcode == dns.NXDOMAIN, name
                assert p.mediator.resolver.resolve(name).refused, name
            denied = {entry["host"] for entry in p.mediator.summary()["denied"]}
            assert denied == set(names[:3])
            # A public IPv4 address behind the NAT64 prefix is what an IPv6-only host reaches the web by.
            assert p.resolve("public64.test") == "127.77.1.0"
            assert p.mediator.resolver.resolve("public64.test").addresses == ("64:ff9b::5db8:d822",)
    finally:
        upstream.close()


# --- the proxy: malformed authorities get an answer, not an internal error ------------------------

def test_proxy_answers_malformed_targets_with_400() -> None:
    rules = _rules(("one.test", (8080,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        for request in ("CONNECT one.test:\u00b2 HTTP/1.1\r\n\r\n",          # a digit to str.isdigit, not to int
                        "GET http://one.test:\u00b3/ HTTP/1.1\r\n\r\n",
                        "GET http://[one.test]:8080/ HTTP/1.1\r\n\r\n",      # urlsplit: not an IPv6 address
                        "GET http://[/ HTTP/1.1\r\n\r\n",
                        "POST http://one.test:8080/ HTTP/1.1\r\nContent-Length: \u00b9\r\n\r\n"):
            with socket.create_connection(p.proxy, timeout=10) as s:
                s.sendall(request.encode("latin-1"))
                answer = _recv_all(s)
            assert answer.split(b" ")[1] == b"400", (request, answer[:80])
        assert "errors" not in p.mediator.summary()


# --- the allow-list's own input -------------------------------------------------------------------

@pytest.mark.parametrize("hosts,options", [
    (["pypi.org:\u00b2"], {}),                                  # str.isdigit says yes, int says ValueError
    (["pypi.org:\u0664\u0664\u0663"], {}),                      # Arabic-Indic digits: not a port as written
    (["pypi.org"], {"resolver": "1.1.1.1:\u00b2"}),
    (["pypi.org"], {"resolver": "[::1]:\u00b2"}),
    (["127.1"], {}),                                            # an address to the C resolver (inet_aton)
    (["2130706433"], {}),
    (["0x7f.0.0.1"], {}),
    (["*.0.1"], {}),
    (["a.test"], {"add_hosts": {"a.test": "fe80::1%\x1b[2J"}}),  # a scope that is no interface name
])
def test_bad_egress_input_is_one_policy_error(hosts: list[str], options: dict[str, object]) -> None:
    with pytest.raises(isolate.PolicyError):
        isolate.Egress(hosts, **options)  # type: ignore[arg-type]


def test_numeric_looking_names_that_are_names_stay_allowed() -> None:
    assert isolate.Egress(["123.example.com", "1.2.3.4.nip.io", "a.test"],
                          add_hosts={"a.test": "fe80::1%lo"}).hosts == ("123.example.com", "1.2.3.4.nip.io",
                                                                        "a.test")


def test_a_toml_string_is_one_entry_not_its_characters() -> None:
    policy = isolate.Policy.from_toml('network = {egress = "ab", add_hosts = "ab:127.0.0.1"}')
    assert isinstance(policy.network, isolate.Egress)
    assert policy.network.hosts == ("ab",) and policy.network.add_hosts == ("ab:127.0.0.1",)


@pytest.mark.parametrize("flags", [["--allow-host=pypi.org:\u00b2"], ["--allow-host=pypi.org", "--dns=1.1.1.1:\u00b2"],
                                   ["--allow-host=127.1"]])
def test_the_cli_says_bad_egress_flags_in_one_line(flags: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "isolate.cli", *flags, "--", "true"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 125, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


# --- the allow-list's bound holds end to end ------------------------------------------------------

@pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")
def test_the_most_ports_the_policy_accepts_can_run() -> None:
    """64 ports pass the policy's check; with DNS's and the proxy's that is 66 listeners, which the
    first child used to refuse (EINVAL at step egress) beyond 64."""
    egress = isolate.Egress([f"p{i}.test:{2000 + i}" for i in range(64)])
    result = isolate.run(["true"], policy=isolate.Policy(network=egress), timeout=60)
    assert result.returncode == 0
    assert len(result.report.enforced["egress"]["mediator"]["ports"]) == 66


# --- the host process's descriptors -------------------------------------------------------------

_FLOOD_HOST = r"""
import json, os, resource, socket, sys, threading, time
import isolate
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
server = socket.create_server(("127.0.0.1", 0), backlog=1024)
port = server.getsockname()[1]
held = []
def accept():
    while True:
        try:
            held.append(server.accept()[0])
        except OSError:
            return
threading.Thread(target=accept, daemon=True).start()
inside = (
    "import socket, sys, time\n"
    "socks = []\n"
    "for _ in range(200):\n"
    "    try:\n"
    "        s = socket.create_connection(('127.77.0.1', 3128), timeout=5)\n"
    f"        s.sendall(b'CONNECT one.test:{port} HTTP/1.1\\r\\n\\r\\n'); socks.append(s)\n"
    "    except OSError: pass\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)
policy = isolate.Policy(network=isolate.Egress([f"one.test:{port}"], add_hosts={"one.test": "127.0.0.1"}),
                        read=json.loads(sys.argv[2]))
process = isolate.Popen([sys.argv[1], "-c", inside], policy=policy, stdin=-1, stdout=-1)
assert process.stdout.readline() == b"ready\n"
time.sleep(0.5)
# While the program holds every connection it could get, this process still has descriptors.
files = [os.open("/dev/null", os.O_RDONLY) for _ in range(64)]
for fd in files:
    os.close(fd)
second = isolate.run(["true"], policy=isolate.Policy(network="none"))
process.stdin.close()
process.wait(timeout=60)
denied = process.report.egress["denied"]
print(json.dumps({"second": second.returncode, "refused": sum(e["count"] for e in denied)}))
"""


@pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")
def test_a_program_cannot_exhaust_the_host_process_descriptors() -> None:
    import json

    from conftest import PYTHON, python_read

    result = subprocess.run([sys.executable, "-c", _FLOOD_HOST, PYTHON, json.dumps(list(python_read()))],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["second"] == 0 and out["refused"] > 0


def test_every_address_add_hosts_gives_a_name_is_tried() -> None:
    """Two --add-host lines for one name: the first address refuses, the second answers. One of them
    used to be dropped without a word."""
    dead = socket.socket()
    dead.bind(("127.0.0.2", 0))          # bound, not listening: a connection to it is refused
    port = dead.getsockname()[1]
    server = socket.create_server(("127.0.0.3", port))
    try:
        egress = isolate.Egress([f"two.test:{port}"], add_hosts=("two.test:127.0.0.3", "two.test:127.0.0.2"))
        rules = egress.rules()
        with plan(rules) as p:
            with socket.create_connection(p.proxy, timeout=10) as s:
                s.sendall(f"CONNECT two.test:{port} HTTP/1.1\r\n\r\n".encode())
                assert s.recv(100).startswith(b"HTTP/1.1 200")
            assert p.mediator.resolver.resolve("two.test").addresses == ("127.0.0.2", "127.0.0.3")
    finally:
        server.close()
        dead.close()


_FLOOD_AMONG_MANY = r"""
import json, resource, socket, sys, threading
import isolate
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, max(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
server = socket.create_server(("127.0.0.1", 0), backlog=1024)
port = server.getsockname()[1]
held = []
def accept():
    while True:
        try:
            held.append(server.accept()[0])
        except OSError:
            return
threading.Thread(target=accept, daemon=True).start()
connect = ("import socket\n"
           "def one():\n"
           "    s = socket.create_connection(('127.77.0.1', 3128), timeout=10)\n"
           f"    s.sendall(b'CONNECT one.test:{port} HTTP/1.1\\r\\n\\r\\n')\n"
           "    return s, s.recv(64).startswith(b'HTTP/1.1 200')\n")
flood = connect + ("import sys\nsocks = []\nfor _ in range(400):\n    try:\n        s, ok = one()\n"
                   "        socks.append(s)\n    except OSError:\n        pass\n"
                   "print('ready', sum(1 for _ in socks), flush=True)\nsys.stdin.read()\n")
polite = connect + "s, ok = one()\nprint('ok' if ok else 'refused')\n"
policy = isolate.Policy(network=isolate.Egress([f"one.test:{port}"], add_hosts={"one.test": "127.0.0.1"}),
                        read=json.loads(sys.argv[2]))
flooder = isolate.Popen([sys.argv[1], "-c", flood], policy=policy, stdin=-1, stdout=-1)
line = flooder.stdout.readline().split()
assert line[0] == b"ready", line
results = []
def run():
    try:
        done = isolate.run([sys.argv[1], "-c", polite], policy=policy, capture_output=True, text=True, timeout=120)
        results.append(done.stdout.strip() or done.stderr.strip()[-200:])
    except Exception as exc:
        results.append(repr(exc))
threads = [threading.Thread(target=run) for _ in range(19)]
for t in threads:
    t.start()
for t in threads:
    t.join()
flooder.stdin.close()
flooder.wait(timeout=60)
print(json.dumps({"flooder": int(line[1]), "others": results}))
"""


@pytest.mark.host_independent  # the host's mediator sharing its time (29 s per caller under the VM's emulation)
@pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")
def test_one_flooding_sandbox_does_not_starve_nineteen_others() -> None:
    # The mediators of one host process share its descriptor budget (half its RLIMIT_NOFILE). One
    # sandbox that held every connection it could get took all of it, and the next sandboxes' connections
    # were reset. Each mediator is now guaranteed a part, and none takes more than 3/4 of the budget.
    import json

    from conftest import PYTHON, python_read

    result = subprocess.run([sys.executable, "-c", _FLOOD_AMONG_MANY, PYTHON, json.dumps(list(python_read()))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["flooder"] >= 32, out  # it got a fair deal: the flood itself is served, up to its share
    assert out["others"] == ["ok"] * 19, out
