"""Brokers voicepipe can start itself: the embedded amqtt broker and a spawned mosquitto.

* :class:`EmbeddedBroker` — amqtt in-process on a free loopback port (MQTT 3.1.1 only). The default when
  no broker is configured, so a fresh machine needs nothing else installed. asyncio sets TCP_NODELAY on
  its sockets, so it does not stall small messages.
* :class:`Mosquitto` — a ``mosquitto`` process on a free port with a config file we write:
  ``set_tcp_nodelay true`` (without it small QoS 1 round trips stall 40+ ms on delayed ACKs) and an
  explicit ``max_queued_messages`` (mosquitto silently drops QoS 1 messages past it, default 1000).
  Optionally a TLS listener (:class:`ServerTLS`: ``mqtts://``), a password file (``users``) and an ACL
  file (``acl_file``, e.g. docs/mosquitto-acl.conf) — what the security tests run against — and a
  :class:`Bridge` to another broker (mosquitto's own bridge: the two brokers act as one bus for
  ``voicepipe/#``; nothing of it is re-implemented here). :meth:`Mosquitto.restart` keeps the port (a
  broker outage for fault tests and the soak benchmark). For the fault
  tests: ``persistence`` (sessions saved every second), :meth:`Mosquitto.kill` then ``start()`` again (a
  crash and restart on the same port), :meth:`Mosquitto.pause`/``resume`` (SIGSTOP/SIGCONT).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_amqtt() -> None:
    for name in ("amqtt", "transitions"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class EmbeddedBroker:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._broker = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    async def start(self) -> None:
        quiet_amqtt()
        from amqtt.broker import Broker

        cfg = {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}", "max_connections": 0}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        self._broker = broker = Broker(cfg)
        await broker.start()

    async def stop(self) -> None:
        if self._broker is not None:
            with contextlib.suppress(Exception):
                await self._broker.shutdown()
            self._broker = None

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class MosquittoMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerTLS:
    """A TLS listener's PEM files: the CA that client certificates must chain to (and that signed the
    server's), the server's certificate and its key. ``require_certificate``: clients must present one."""

    ca_file: str
    cert_file: str
    key_file: str
    require_certificate: bool = False


@dataclass(frozen=True)
class Bridge:
    """A mosquitto bridge from this broker to ``address`` (``host:port``): the settings that matter.

    ``topic voicepipe/# both 1``: the run's topics cross both ways at QoS 1. ``try_private`` marks the link
    as a bridge so the remote broker does not loop messages back; ``cleansession`` true: no stale queue
    from an earlier link; ``restart_timeout``: reconnect after a second, not mosquitto's default 5-30 s
    backoff; ``max_queued_messages`` applies to the bridge link as to any client (see
    https://mosquitto.org/man/mosquitto-conf-5.html, "Bridges"). Messages cross one more hop each way.
    """

    address: str
    name: str = "voicepipe-bridge"
    topic: str = "voicepipe/#"
    protocol: str = "mqttv311"  # or mqttv50

    def config_lines(self) -> list[str]:
        return [
            f"connection {self.name}",
            f"address {self.address}",
            f"topic {self.topic} both 1",
            f"bridge_protocol_version {self.protocol}",
            "try_private true",
            "cleansession true",
            "restart_timeout 1",
            "notifications false",
            "keepalive_interval 10",
        ]


class Mosquitto:
    """A private mosquitto on a free loopback port; ``nodelay=False`` reproduces Debian's default stall."""

    def __init__(
        self,
        port: int | None = None,
        *,
        nodelay: bool = True,
        max_queued_messages: int = 100_000,
        users: dict[str, str] | None = None,
        tls: ServerTLS | None = None,
        acl_file: str | Path | None = None,
        persistence: bool = False,
        bridge: Bridge | None = None,
    ) -> None:
        self.port = port or free_port()
        self.bridge = bridge
        self.nodelay = nodelay
        self.max_queued = max_queued_messages
        self.users = users or {}
        self.tls = tls
        self.acl_file = acl_file
        self.persistence = persistence  # sessions and queued messages saved every second (restart tests)
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @staticmethod
    def binary() -> str:
        exe = shutil.which("mosquitto") or next(
            (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()), None
        )
        if not exe:
            raise MosquittoMissing("mosquitto binary not found (apt-get install -y mosquitto)")
        return exe

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://127.0.0.1:{self.port}"

    def config_text(self, workdir: Path) -> str:
        lines = [f"listener {self.port} 127.0.0.1"]
        if self.tls:
            lines += [
                f"cafile {self.tls.ca_file}",
                f"certfile {self.tls.cert_file}",
                f"keyfile {self.tls.key_file}",
                f"require_certificate {'true' if self.tls.require_certificate else 'false'}",
            ]
        lines += [
            f"set_tcp_nodelay {'true' if self.nodelay else 'false'}",
            f"max_queued_messages {self.max_queued}",
            "max_inflight_messages 0",
            *(
                [f"persistence true\npersistence_location {workdir}/\nautosave_interval 1"]
                if self.persistence
                else ["persistence false"]
            ),
            "log_dest stderr",  # errors only: why a start failed, without filling the pipe
            "log_type error",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")  # as root mosquitto would switch to 'mosquitto' and lose our files
        if self.users:
            pw = workdir / "passwd"
            pw.write_text("".join(f"{u}:{p}\n" for u, p in self.users.items()))
            pw.chmod(0o600)
            tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
            subprocess.run([tool, "-U", str(pw)], check=True, capture_output=True)
            lines += ["allow_anonymous false", f"password_file {pw}"]
        else:
            lines.append("allow_anonymous true")
        if self.acl_file:
            lines.append(f"acl_file {Path(self.acl_file).resolve()}")
        if self.bridge:
            lines += self.bridge.config_lines()  # last: bridge options follow their `connection` line
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> None:
        exe = self.binary()
        if self._dir is None:  # a restart keeps the directory: its config and persistence file
            self._dir = tempfile.TemporaryDirectory(prefix="voicepipe-mosquitto-")
        workdir = Path(self._dir.name)
        conf = workdir / "mosquitto.conf"
        conf.write_text(self.config_text(workdir))
        self.proc = subprocess.Popen(
            [exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
                raise RuntimeError(f"mosquitto exited at start: {err.strip()[:300]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on port {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to clients, nothing saved; :meth:`start` again restarts it on
        the same port with the same files."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing moves until :meth:`resume`."""
        if self.proc:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused broker cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._dir:
            self._dir.cleanup()
            self._dir = None

    def restart(self, down_s: float = 0.0) -> None:
        """Kill the broker, stay down ``down_s``, start it again on the same port (nothing persisted)."""
        self.kill()
        self.stop()
        time.sleep(down_s)
        self.start()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> Mosquitto:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Mosquitto:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
