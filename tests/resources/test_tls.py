"""A cluster over mutual TLS (Dask's Security), with certificates made here: every
connection is tls://, a client without a certificate from the cluster's CA is refused, and
the dashboard answers over HTTPS. One CPU worker; no model is loaded."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import ssl
import subprocess
import sys
import urllib.request

import dask
import pytest
from distributed import Client

from resources.cluster import RoleCluster, listen_address, submit, tls_security
from resources.plan import WorkerSpec

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def make_ca_and_cert(directory, name: str) -> tuple[str, str]:
    """A self-signed CA and a certificate for 127.0.0.1 it signed; returns (ca.pem, cert+key.pem)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dask-rl")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path = directory / f"{name}-ca.pem", directory / f"{name}-cert.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(ca_path), str(cert_path)


def _echo(value):
    return value


def test_a_tls_cluster_encrypts_every_connection_and_refuses_strangers(tmp_path):
    ca, cert = make_ca_and_cert(tmp_path, "cluster")
    other_ca, other_cert = make_ca_and_cert(tmp_path, "stranger")
    worker = WorkerSpec(name="reward-0", role="reward", device_type="cpu", device_id=None, env=())
    # The dashboard's HTTPS is Dask's own setting, read as the scheduler starts.
    dashboard_tls = {"distributed.scheduler.dashboard.tls.cert": cert}
    with dask.config.set(dashboard_tls), RoleCluster([worker], dashboard_address=":0", security=tls_security(
            ca, cert), preload=["pipeline.dashboard"]) as cluster:  # as the trainer's own cluster
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        assert [w["address"][:16] for w in cluster.workers_of("reward")] == ["tls://127.0.0.1:"]
        assert submit(cluster.client, "reward", _echo, 7).result(timeout=60) == 7
        # A certificate from another CA is not enough: the scheduler refuses the handshake.
        with pytest.raises((OSError, TimeoutError)):
            Client(cluster.scheduler_address, security=tls_security(other_ca, other_cert), timeout=5)
        port = cluster.client.run_on_scheduler(lambda dask_scheduler=None: dask_scheduler.services["dashboard"].port)
        trusted = ssl.create_default_context(cafile=ca)
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/json/identity.json", context=trusted,
                                    timeout=30) as answer:
            assert answer.status == 200 and b'"type": "Scheduler"' in answer.read()
        with pytest.raises(OSError):  # plain HTTP gets no page from a TLS listener
            urllib.request.urlopen(f"http://127.0.0.1:{port}/json/identity.json", timeout=10).read()


def test_a_dashboard_address_without_a_host_follows_the_listening_host():
    assert listen_address(":8787", "127.0.0.1") == "127.0.0.1:8787"
    assert listen_address(":0", "0.0.0.0") == "0.0.0.0:0"
    assert listen_address("10.0.0.5:8787", "127.0.0.1") == "10.0.0.5:8787"


def test_dask_rl_scheduler_and_worker_over_tls_and_a_half_given_tls_flag_refused(tmp_path):
    """The multi-host commands of the README, on one host: scheduler and worker with the TLS flags."""
    ca, cert = make_ca_and_cert(tmp_path, "hosts")
    flags = ["--tls-ca-file", ca, "--tls-cert", cert]
    half = subprocess.run([sys.executable, "-m", "pipeline.cli", "scheduler", "--tls-cert", cert],
                          capture_output=True, text=True, timeout=120)
    assert half.returncode == 2 and "--tls-ca-file" in half.stderr and "Traceback" not in half.stderr
    with subprocess.Popen([sys.executable, "-m", "pipeline.cli", "scheduler", "--port", "0", "--dashboard-address",
                           ":0", *flags], stdout=subprocess.PIPE, text=True) as scheduler:
        try:
            address = _printed_address(scheduler)
            assert address.startswith("tls://127.0.0.1:")  # localhost unless --host says otherwise
            worker = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", address, "--role", "reward",
                                       *flags], stdout=subprocess.DEVNULL)
            try:
                with Client(address, security=tls_security(ca, cert), timeout=60) as client:
                    client.wait_for_workers(1, timeout=120)
                    # A builtin: this scheduler's process cannot import the test module.
                    assert submit(client, "reward", abs, -3).result(timeout=60) == 3
            finally:
                worker.send_signal(signal.SIGINT)
                worker.wait(60)
        finally:
            scheduler.send_signal(signal.SIGINT)
            scheduler.wait(60)


def _printed_address(process) -> str:
    for line in process.stdout:
        if "scheduler at " in line:
            return line.split("scheduler at ", 1)[1].split()[0]
    raise AssertionError("dask-rl scheduler exited without printing its address")
