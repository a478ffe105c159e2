"""Router: picks who serves the turn and hands it the final transcript.

Policy ``single`` sends every turn to one agent. This stage is the seam where the speculative cache,
the council and preemptive generation plug in: they are further routes chosen here.
"""

from __future__ import annotations

from voicepipe.messages import Envelope
from voicepipe.stages.base import Stage


class Router(Stage):
    name = "router"
    channels = ("asr/final",)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.on("asr.final", self.final)

    async def final(self, env: Envelope) -> None:
        agent = self.cfg.router.agent
        payload = {
            "target": "agent",
            "agent": agent,
            "path": "agent",
            "route": "single",
            "text": env.payload.get("text", ""),
            "words": env.payload.get("words", 0),
            "segment": env.payload.get("segment", 0),
        }
        await self.bus.publish(self.reply(env, "route", payload, list(env.spans)))
