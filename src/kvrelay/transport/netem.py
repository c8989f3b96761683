"""A constrained link on this machine: two network namespaces, a veth pair, a ``tbf`` rate limit.

::

    namespace kvr-<pid>-a                         namespace kvr-<pid>-b
    ┌──────────────────────────┐   veth pair   ┌──────────────────────────┐
    │ sender (python)          │──────────────▶│ receiver (python)        │
    │ kvr<pid>a 10.201.0.1/30  │               │ kvr<pid>b 10.201.0.2/30  │
    │ egress: tc tbf rate R    │               │ reads N bytes, acks 1    │
    └──────────────────────────┘               └──────────────────────────┘

The addresses exist only inside these two namespaces; nothing is routed anywhere else. The
rate limit is a token bucket on the sender's egress (``tc qdisc replace … tbf``), so one link
serves several rates. The ``netem`` qdisc is not available on these machines, so there is no
propagation delay: a transfer's time is its bytes over the rate plus TCP's own costs, which is
the bandwidth-bound case that decides the break-even.

Namespaces carry the owner's pid; ``Link.up`` first removes ``kvr-*`` namespaces whose owner is
gone (a crashed run), and ``Link.down`` (always called: ``with Link() as link``) removes its own.
Needs root (CAP_NET_ADMIN) and ``ip``/``tc`` from iproute2; ``available()`` says why not otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ADDR_A, ADDR_B, PREFIX = "10.201.0.1", "10.201.0.2", 30
PORT = 5201

_RECEIVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4)
print("ready", flush=True)
buf = bytearray(1 << 20)
while True:
    c, _ = s.accept()
    with c:
        head = b""
        while len(head) < 8:
            part = c.recv(8 - len(head))
            if not part: break
            head += part
        if len(head) < 8: continue
        left = int.from_bytes(head, "little")
        view = memoryview(buf)
        while left:
            n = c.recv_into(view, min(left, len(buf)))
            if not n: break
            left -= n
        c.sendall(b"k")
"""

_SENDER = r"""
import socket, sys, time
data = open(sys.argv[1], "rb").read()
t0 = time.perf_counter()
c = socket.create_connection((sys.argv[2], int(sys.argv[3])))
c.sendall(len(data).to_bytes(8, "little")); c.sendall(data)
ack = c.recv(1)
t1 = time.perf_counter()
assert ack == b"k", ack
print(repr(t1 - t0))
"""


class LinkError(RuntimeError):
    """The link could not be built or a transfer over it failed."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> tuple[bool, str]:
    """Whether this process may build namespaces and tbf qdiscs; the reason when not."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN) for `ip netns` and `tc`"
    name = f"kvr-{os.getpid()}-probe"
    r = _run("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return True, ""


def remove_stale() -> list[str]:
    """Delete ``kvr-<pid>-*`` namespaces whose pid is no longer running; returns their names."""
    out = _run("ip", "netns", "list", check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(r"kvr-(\d+)-\w+", name)
        if name.startswith("kvr-") and (m is None or not Path(f"/proc/{m.group(1)}").exists()):
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


def tbf_args(rate_mbit: float) -> list[str]:
    """``tc`` arguments for a token bucket at ``rate_mbit``: a bucket of 10 ms at that rate (at least
    128 KiB, so a 64 KiB GSO segment always fits) and a 100 ms queue."""
    if not rate_mbit > 0:
        raise ValueError(f"rate must be positive, got {rate_mbit} Mbit/s")
    burst = max(128 << 10, int(rate_mbit * 1e6 / 8 * 0.010))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


class Link:
    """``with Link() as link: link.set_rate(100); seconds = link.send(data)``."""

    def __init__(self, *, port: int = PORT, python: str | None = None):
        tag = str(os.getpid())
        self.ns_a, self.ns_b = f"kvr-{tag}-a", f"kvr-{tag}-b"
        self.dev_a, self.dev_b = f"kvr{tag}a", f"kvr{tag}b"  # <= 15 chars for pids < 10^10
        self.port = port
        self.python = python or sys.executable
        self.rate_mbit: float | None = None
        self._receiver: subprocess.Popen | None = None
        self._dir: Path | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def up(self) -> Link:
        ok, why = available()
        if not ok:
            raise LinkError(why)
        remove_stale()
        try:
            for ns in (self.ns_a, self.ns_b):
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            for ns, dev, addr in ((self.ns_a, self.dev_a, ADDR_A), (self.ns_b, self.dev_b, ADDR_B)):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            self._dir = Path(tempfile.mkdtemp(prefix="kvrelay-link-"))
            self._receiver = subprocess.Popen(
                ["ip", "netns", "exec", self.ns_b, self.python, "-c", _RECEIVER, ADDR_B, str(self.port)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = self._receiver.stdout.readline()
            if line.strip() != "ready":
                raise LinkError(f"receiver did not start: {line!r} {self._receiver.stderr.read()[-1000:]}")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        if self._receiver is not None:
            self._receiver.kill()
            self._receiver.wait()
            self._receiver = None
        for ns in (self.ns_a, self.ns_b):  # deleting a namespace deletes its end of the veth pair
            _run("ip", "netns", "del", ns, check=False)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Link:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- use ---------------------------------------------------------------------------------
    def set_rate(self, rate_mbit: float, *, both_ways: bool = False) -> None:
        """Limit the sender's egress to ``rate_mbit`` Mbit/s (replaces any earlier limit); ``both_ways``: the
        receiver's egress too (what a server in b sends back, e.g. a store's replies to gets)."""
        for ns, dev in ((self.ns_a, self.dev_a), (self.ns_b, self.dev_b))[: 2 if both_ways else 1]:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_mbit))
        self.rate_mbit = rate_mbit

    def argv(self, side: str, *cmd: str) -> list[str]:
        """``cmd`` run inside namespace ``side``: "a" (the sender's, ``ADDR_A``) or "b" (``ADDR_B``, where a
        server listening on ``ADDR_B`` is reachable from a only over the limited link)."""
        return ["ip", "netns", "exec", self._side(side)[0], *cmd]

    def shaped(self, side: str = "a") -> dict[str, int]:
        """The token bucket's counters on ``side``'s egress: ``sent_bytes``, ``overlimits`` (packets the
        bucket held back for want of tokens: > 0 means the rate, not the machine, set the pace)."""
        ns, dev = self._side(side)
        out = _run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
        m = re.search(r"Sent (\d+) bytes .*?overlimits (\d+)", out, re.S)
        if "tbf" not in out or m is None:
            raise LinkError(f"no token bucket on {dev} in {ns} (call set_rate first): {out.strip()}")
        return {"sent_bytes": int(m.group(1)), "overlimits": int(m.group(2))}

    def _side(self, side: str) -> tuple[str, str]:
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        return (self.ns_a, self.dev_a) if side == "a" else (self.ns_b, self.dev_b)

    def send(self, data: bytes | bytearray | memoryview | list, *, timeout_s: float = 600.0) -> float:
        """Seconds to send ``data`` (a buffer or a list of buffers: the kvrelay/1 parts) from namespace a
        to the receiver in b, until its 1-byte acknowledgement arrives (connect included). The bytes
        are staged in a file the sender reads before its clock starts."""
        if self._receiver is None or self._dir is None:
            raise LinkError("the link is down; use `with Link() as link`")
        path = self._dir / "payload.bin"
        with open(path, "wb") as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part)
        try:
            r = subprocess.run(["ip", "netns", "exec", self.ns_a, self.python, "-c", _SENDER, str(path), ADDR_B,
                                str(self.port)], capture_output=True, text=True, timeout=timeout_s)
        finally:
            path.unlink(missing_ok=True)
        if r.returncode != 0:
            raise LinkError(f"transfer failed: {r.stderr.strip()[-1000:]}")
        return float(r.stdout.strip())
