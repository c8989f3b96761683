"""``rediss://``: a Redis store over TLS, against a real ``redis-server`` listening only on a TLS port with a
certificate made here (a CA of our own and a server certificate for 127.0.0.1 and localhost, through the
``cryptography`` package). The store trusts that CA through ``?ssl_ca_certs=PATH`` (a path with a space
and a plus, percent-encoded); without it, or over plain ``redis://``, the server cannot be reached and
the error is a ``StoreError`` that never shows the password. A second server asks every client for a
certificate the CA signed (``--tls-auth-clients yes``): the store presents one through
``?ssl_certfile=PATH&ssl_keyfile=PATH``, and is refused without it."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from kvrelay.core.errors import StoreError
from kvrelay.transport.redis_server import free_port
from kvrelay.transport.stores import open_store
from tests.conftest import missing_service

PASSWORD = "tls-secret-7"


def _write_certificates(folder: Path) -> dict[str, Path]:
    """PEM files ``ca``, ``server`` / ``server.key`` and ``client`` / ``client.key``: the CA signs the server's
    certificate (for 127.0.0.1 and localhost) and a client's, each valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrelay test CA")])
    day = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(day[0]).not_valid_after(day[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def signed(name: str, usage, names=None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(day[0]).not_valid_after(day[1])
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if names:
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    server = signed("localhost", ExtendedKeyUsageOID.SERVER_AUTH,
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = signed("kvrelay test client", ExtendedKeyUsageOID.CLIENT_AUTH)
    folder.mkdir(parents=True)
    paths = {name: folder / f"{name}.pem" for name in ("ca", "server", "server.key", "client", "client.key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name, (cert, key) in (("server", server), ("client", client)):
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}.key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return paths


def _ping(port: int, tls: dict[str, Path]) -> bool:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(tls["ca"]),
                         ssl_certfile=str(tls["client"]), ssl_keyfile=str(tls["client.key"]),
                         socket_connect_timeout=0.5, socket_timeout=1)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return False
    finally:
        client.close()


def _tls_redis(root: Path, tls: dict[str, Path], auth_clients: str):
    """A redis-server speaking TLS only (``--port 0``) with a password; ``auth_clients``: ``no``, or ``yes``
    (a client must present a certificate the CA signed). Returns (process, port)."""
    exe = shutil.which("redis-server")
    if exe is None:
        missing_service("redis-server", "not on PATH (apt-get install redis-server)")
    log = ""
    for _ in range(3):  # another process may take the port between our bind and redis'
        port = free_port()
        with open(root / f"redis-{port}.log", "wb") as out:
            proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                                     "--tls-cert-file", str(tls["server"]), "--tls-key-file", str(tls["server.key"]),
                                     "--tls-ca-cert-file", str(tls["ca"]), "--tls-auth-clients", auth_clients,
                                     "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(root)],
                                    stdout=out, stderr=subprocess.STDOUT)
        for _ in range(100):  # bounded: 100 tries of at most ~1.5 s each
            if proc.poll() is not None or _ping(port, tls):
                break
            time.sleep(0.05)
        if proc.poll() is None and _ping(port, tls):
            return proc, port
        proc.kill()
        proc.wait()
        log = (root / f"redis-{port}.log").read_text(errors="replace")[-1500:]
    missing_service("redis-server with TLS", f"it did not answer over TLS; its log ends with:\n{log}")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return _write_certificates(tmp_path_factory.mktemp("redis-tls") / "tls certs+keys")  # '+', ' ': encoded in URLs


def _serve(tls_files, auth_clients: str):
    proc, port = _tls_redis(tls_files["ca"].parent.parent, tls_files, auth_clients)
    yield port, tls_files, auth_clients == "yes"
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server_auth(tls_files):
    """``(port, files, False)``: a TLS-only server that asks clients for no certificate."""
    yield from _serve(tls_files, "no")


@pytest.fixture(scope="module")
def mutual(tls_files):
    """``(port, files, True)``: a TLS-only server that asks every client for a certificate the CA signed."""
    yield from _serve(tls_files, "yes")


@pytest.fixture(params=["server_auth", "mutual"])
def tls_server(request):
    return request.getfixturevalue(request.param)


def _url(port: int, tls: dict[str, Path], *, mutual: bool, query: str = "") -> str:
    """``rediss://`` with the CA to trust and, for a mutual server, the client's certificate and key."""
    q = f"ssl_ca_certs={quote(str(tls['ca']), safe='')}"
    if mutual:
        q += f"&ssl_certfile={quote(str(tls['client']), safe='')}&ssl_keyfile={quote(str(tls['client.key']), safe='')}"
    return f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?{q}{query}"


def _blob(seed: int) -> bytes:
    from tests.transport.test_budget import _blob as blob

    return blob(seed)


def test_a_payload_round_trips_over_tls_trusting_the_ca_named_in_the_url(tls_server):
    port, tls, mutual = tls_server
    store = open_store(_url(port, tls, mutual=mutual, query="&namespace=tls"))
    try:
        assert store.url.startswith(f"rediss://:***@127.0.0.1:{port}/0?") and PASSWORD not in store.url
        assert store.url.endswith("&namespace=tls")
        assert store.client.connection_pool.connection_class.__name__ == "SSLConnection"
        store.check()
        data = _blob(3)
        store.put_bytes("k", data)
        assert bytes(store.get_bytes("k")) == data
    finally:
        store.clear()
        store.close()


def test_the_payload_api_and_a_budget_work_over_tls(tls_server, tiny_by_arch):
    from kvrelay.agents.agent import Agent
    from kvrelay.transport.payloads import get_payload, put_payload
    from tests.conftest import random_ids

    port, tls, mutual = tls_server
    lm = tiny_by_arch["qwen2"]
    p = Agent(lm, "s").prefill(random_ids(12, 4))
    store = open_store(_url(port, tls, mutual=mutual, query="&namespace=tls-api&max_bytes=1000000&evict=lru"))
    try:
        assert store.budget is not None and store.budget.policy == "lru"
        key = put_payload(store, p, "fp16")
        got = get_payload(store, key, expect=lm.identity)
        assert got.token_ids.tolist() == p.token_ids.tolist() and got.num_tokens == 12
    finally:
        store.clear()
        store.close()


@pytest.mark.parametrize("how", ["no CA", "plain redis://"])
def test_without_the_ca_or_without_tls_the_store_is_unreachable_and_says_so(tls_server, how):
    port, _, _ = tls_server
    scheme = "rediss" if how == "no CA" else "redis"
    _refused(f"{scheme}://:{PASSWORD}@127.0.0.1:{port}/0?retry_s=0&socket_timeout=2", port,
             "certificate verify failed" if how == "no CA" else "")


def test_a_server_asking_for_a_client_certificate_refuses_a_store_without_one(mutual):
    port, tls, _ = mutual
    _refused(_url(port, tls, mutual=False, query="&retry_s=0&socket_timeout=2"), port, "")


def _refused(url: str, port: int, why: str) -> None:
    store = open_store(url)
    try:
        with pytest.raises(StoreError, match=f"127.0.0.1:{port}") as e:
            store.check()
        assert PASSWORD not in str(e.value) and why in str(e.value)
    finally:
        store.close()
