"""The bus package: how stages exchange envelopes, on a real MQTT broker or in memory.

Layering: the bus imports only :mod:`voicepipe.messages`, :mod:`voicepipe.clock`, :mod:`voicepipe.errors`,
:mod:`voicepipe.limits` and its own modules; stages, the runner and the CLI import it, never the reverse.

* :mod:`.base` — the :class:`Bus` contract, :class:`BrokerHealth`, :class:`BrokerOutage` (re-exported here);
* :mod:`.memory` — the in-process bus of virtual-time runs;
* :mod:`.mqtt` — the MQTT bus (address and TLS, the lean client, the shared link, start-up probes);
* :mod:`.liveness` — who is alive on the bus; :mod:`.partition` — sessions split over replicas;
* :mod:`.brokers` — brokers a run or a test starts itself (mosquitto, embedded amqtt, a bridge).
"""

from voicepipe.bus.base import BrokerHealth, BrokerOutage, Bus, merged

__all__ = ["BrokerHealth", "BrokerOutage", "Bus", "merged"]
