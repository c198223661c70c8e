"""TensorRT's own messages through k3export's logger, not printed over a command's output.

TensorRT's stock `trt.Logger` writes to the C stdout, so a parse's "[TRT] [W] ModelImporter.cpp:1071:
Make sure input input_ids has Int64 binding." landed in the middle of `build`'s and `demo`'s lines.
`tensorrt_logger(trt)` hands errors to the "k3export.tensorrt" logger as errors (always shown) and
warnings and info at DEBUG (shown with `k3export --verbose`), and counts them, so the command line
can say how many it held back. Verbose messages are dropped unread: a parse gives thousands.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from types import ModuleType
from typing import Any

log = logging.getLogger("k3export.tensorrt")
# Messages held back (not shown) by severity name, over the process.
held_back: Counter[str] = Counter()


@functools.cache
def tensorrt_logger(trt: ModuleType) -> Any:
    """The ILogger of `trt` (tensorrt or tensorrt_rtx) that forwards to the "k3export.tensorrt" logger:
    one per process, never freed. TensorRT keeps the first logger it is given (a builder's, a runtime's)
    for messages of objects that outlive it, its plugin registry's among them: a logger freed with the
    parse that made it crashed the next plugin lookup (a segfault in get_creator)."""
    severity = trt.ILogger.Severity

    class ForwardingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, level: Any, message: str) -> None:
            if level > severity.INFO:
                return
            if level <= severity.ERROR:
                log.error("TensorRT: %s", message)
                return
            name = level.name.lower()
            if not log.isEnabledFor(logging.DEBUG):
                held_back[name] += 1
            log.debug("TensorRT %s: %s", name, message)

    return ForwardingLogger()
