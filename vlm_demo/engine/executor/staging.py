"""Host numbers to the device in one copy a step: the decode step's inputs are built on the host (no device reads)
and sent together from a pinned buffer."""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """Host numbers to the device without waiting for it: each ``send`` packs its arrays into one pinned
    buffer (on CUDA) and makes one asynchronous copy. Sends go to fresh parts of the buffer until
    ``recycle``, which the engine calls right after a step's host read (every earlier copy is done then).
    ``persist`` returns device copies of their own, for tensors that outlive the step."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long) -> None:
        self.device = device
        self.dtype = dtype
        self.cursor = 0
        self._host = torch.empty(0, dtype=dtype)
        self._device = self._host

    def send(self, parts: list[np.ndarray], persist: bool = False) -> list[torch.Tensor]:
        if self.device.type == "cpu":  # the host's memory is the device's: the arrays themselves, no copy
            kind, own = self._host.numpy().dtype, np.array if persist else np.ascontiguousarray
            return [torch.from_numpy(own(p, dtype=kind)) for p in parts]
        sizes = [int(p.size) for p in parts]
        total = sum(sizes)
        if self.cursor + total > self._host.numel():
            room = max(self.cursor + total, 2 * self._host.numel(), 4096)
            self._host = torch.empty(room, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            self._device = (
                self._host if self.device.type == "cpu" else torch.empty(room, dtype=self.dtype, device=self.device)
            )
            self.cursor = 0
        start = self.cursor
        host = self._host.numpy()
        for part, size in zip(parts, sizes, strict=True):
            host[start : start + size] = np.asarray(part).reshape(-1)
            start += size
        if self._device is not self._host:
            self._device[self.cursor : start].copy_(self._host[self.cursor : start], non_blocking=True)
        out, at = [], self.cursor
        for part, size in zip(parts, sizes, strict=True):
            view = self._device[at : at + size].view(np.asarray(part).shape)
            out.append(view.clone() if persist else view)
            at += size
        self.cursor = start
        return out

    def recycle(self) -> None:
        self.cursor = 0
