"""The bus on a real MQTT broker.

* :mod:`.address` — :class:`BrokerAddress`: URL, credentials, TLS, and the clients made for it;
* :mod:`.lean` — :class:`LeanClient`, the lean per-message path; :mod:`._private` holds its every reach into
  aiomqtt's and paho's internals and the versions they are pinned to; :mod:`.plain` — the public-API client
  used when those versions differ (or ``VOICEPIPE_LEAN=0``);
* :mod:`.link` — :class:`MqttLink`, one connection per process: delivery, reconnect, resume, replay;
* :mod:`.bus` — :class:`MqttBus`, a stage's bus on a link: validation, dead letters, duplicates;
* :mod:`.probe` — start-up checks: protocol version, the run's topics under an ACL, the round trip.

Topics are ``voicepipe/{run}/{session}/{channel}``; a link subscribes ``voicepipe/{run}/+/{channel}`` once per
channel its stages want, so a message several stages of a process subscribe to crosses the wire once.
"""

from voicepipe.bus.mqtt.address import BrokerAddress
from voicepipe.bus.mqtt.bus import MqttBus
from voicepipe.bus.mqtt.lean import LeanClient
from voicepipe.bus.mqtt.link import MqttLink
from voicepipe.bus.mqtt.plain import PlainClient
from voicepipe.bus.mqtt.probe import (
    RunTopicsUnreachable,
    check_run_topics,
    negotiate_protocol,
    probe_round_trip,
)

__all__ = [
    "BrokerAddress",
    "LeanClient",
    "MqttBus",
    "MqttLink",
    "PlainClient",
    "RunTopicsUnreachable",
    "check_run_topics",
    "negotiate_protocol",
    "probe_round_trip",
]
