# SPDX-License-Identifier: MIT
"""DeepEP's event types over torch.cuda events (no-ops for CPU tensors)."""


def _cuda():
    import torch
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class EventHandle:
    """An event recorded on the current CUDA stream when made (None on a
    machine without CUDA, where everything runs in order anyway)."""

    def __init__(self, stream=None):
        import torch
        self.event = None
        if _cuda():
            self.event = torch.cuda.Event()
            self.event.record(stream or torch.cuda.current_stream())

    def current_stream_wait(self):
        import torch
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """What DeepEP's ops return: wait for the op on the current stream
    (current_stream_wait(), or leaving a with block). extra_tensors are
    kept alive until then."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._hooks = []

    def current_stream_wait(self, release_handle=False):
        assert self.event is not None, "no event: the op was not async"
        self.event.current_stream_wait()
        for h in self._hooks:
            h()
        self._hooks = []
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook_after_wait):
        self._hooks.append(hook_after_wait)

    def __call__(self, release_handle=False):
        self.current_stream_wait(release_handle)
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.event is not None:
            self.event.current_stream_wait()
