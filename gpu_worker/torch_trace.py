"""torch.profiler over a `tandem profile` window, for `--torch-profiler FILE`.

Our spans say where each plan and step went; torch.profiler says which operators (and, on
CUDA, which kernels) ran inside them.  Both cover the same window: the gpu worker starts and
stops this next to its span recording, between plans.  Exporting the Chrome trace takes a
while for a long window, so it happens after the recording has stopped.
"""
from __future__ import annotations

import logging
import os

import torch

from tandem_serve.proto.monitor_messages import ProfileControl

log = logging.getLogger("tandem.gpu_worker")


class TorchTrace:
    """The gpu worker's `ProfileExtra`: a torch.profiler run when the control names a file."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._prof: torch.profiler.profile | None = None
        self._path = ""
        self._error = ""

    def start(self, msg: ProfileControl) -> None:
        self._prof, self._path, self._error = None, msg.torch_trace, ""
        if not self._path:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            prof = torch.profiler.profile(activities=activities)
            prof.start()
            self._prof = prof
        except Exception as exc:  # a profiler that cannot start must not stop serving
            self._error = f"torch.profiler did not start: {exc}"
            log.warning("%s", self._error)

    def stop(self) -> tuple[str, str]:
        """(file written, error)."""
        prof, path = self._prof, self._path
        self._prof = None
        if prof is None:
            return "", self._error
        try:
            prof.stop()
            folder = os.path.dirname(path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            prof.export_chrome_trace(path)
        except Exception as exc:  # e.g. a folder we may not write: report it, keep serving
            log.warning("torch.profiler trace %s not written: %s", path, exc)
            return "", f"{type(exc).__name__}: {exc}"
        log.info("torch.profiler trace written to %s", path)
        return path, ""
