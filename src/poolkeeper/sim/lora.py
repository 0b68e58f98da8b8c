"""LoRA adapter slots on one engine: which adapters are resident on the GPU, and swapping.

vLLM keeps at most `max_loras` adapters in GPU slots. A batch may only use resident adapters, so
a request for a non-resident adapter needs a slot: a free one, or one whose adapter no running
request uses (evicted least recently used first). If every slot is busy the request waits
("deferred") while others may run. Each swap-in costs the engine `lora_load_s` of step time.
"""

from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    """Resident adapters in LRU order plus per-adapter counts of running requests."""

    __slots__ = ("_resident", "max_loras", "running")

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._resident: OrderedDict[str, None] = OrderedDict()
        self.running: dict[str, int] = {}  # adapter -> running requests using it

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(self._resident)

    def is_resident(self, adapter: str) -> bool:
        return adapter in self._resident

    def acquire(self, adapter: str) -> bool | None:
        """Make `adapter` usable by one more running request.

        Returns False if it was already resident, True if it had to be loaded (a swap), and
        None if no slot can be freed now (the request must wait).
        """
        if adapter in self._resident:
            self._resident.move_to_end(adapter)
            self.running[adapter] = self.running.get(adapter, 0) + 1
            return False
        if len(self._resident) >= self.max_loras:
            victim = next((a for a in self._resident if not self.running.get(a)), None)
            if victim is None:
                return None
            del self._resident[victim]
        self._resident[adapter] = None
        self.running[adapter] = self.running.get(adapter, 0) + 1
        return True

    def release(self, adapter: str) -> None:
        left = self.running[adapter] - 1
        if left:
            self.running[adapter] = left
        else:
            del self.running[adapter]

    def drop(self, adapter: str) -> None:
        """Forget a resident adapter that is being unregistered (if no request runs it)."""
        if not self.running.get(adapter):
            self._resident.pop(adapter, None)
