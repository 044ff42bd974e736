"""What the route handlers share: the served model once it is loaded, readiness, draining,
and the count of API calls in flight (the drain waits for it to reach zero)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from brook_engine.core.async_engine import AsyncEngine
from brook_engine.tokenizer import Tokenizer


@dataclass
class ServerState:
    """What the handlers need, filled in once the model is loaded."""

    served_name: str
    engine: AsyncEngine | None = None
    tokenizer: Tokenizer | None = None
    max_model_len: int = 0
    vocab_size: int = 0
    is_ready: bool = False
    is_draining: bool = False  # shutting down; a model still loading stops at its next step
    engine_thread: threading.Thread | None = None  # loads the model, then runs the engine
    num_in_flight: int = 0  # API calls between their start and their last byte
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))

    def begin(self) -> None:
        self.num_in_flight += 1
        self.idle.clear()

    def end(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self.idle.set()
