"""A throwaway PKI for TLS tests, made with the openssl binary: a CA, a server certificate for 127.0.0.1
signed by it, a client certificate signed by it, an unrelated second CA, and an encrypted client key."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]


@dataclass(frozen=True)
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_key_encrypted: Path
    other_ca: Path


def openssl() -> str | None:
    return shutil.which("openssl")


def make_pki(d: Path) -> PKI:
    exe = openssl()
    if exe is None:
        raise FileNotFoundError("openssl binary not found")

    def run(*args: str) -> None:
        subprocess.run([exe, *args], check=True, capture_output=True, cwd=d, timeout=60)

    def ca(name: str) -> None:
        run("req", "-x509", *EC, "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
            "-subj", f"/CN=voicepipe test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip

    def leaf(name: str, ext: str) -> None:
        run("req", *EC, "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(ext)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip

    ca("ca")
    ca("other-ca")
    leaf(
        "server",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    )
    leaf("client", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    run("pkey", "-in", "client.key", "-out", "client-enc.key", "-aes256", "-passout", "pass:keypass")
    return PKI(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        client_key_encrypted=d / "client-enc.key",
        other_ca=d / "other-ca.pem",
    )
