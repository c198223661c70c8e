"""How every process of ours that has used gloo ends: `end_process(code)`, never the interpreter's
teardown (the runtime under torchrun, check --build's rank processes, the tests' torchrun workers).

gloo's worker thread (pt_gloo_runloop) destroys a finished all-reduce's work, and with it the last
reference to its tensors. On a loaded host that thread can be kept off the CPU until the main thread
is finalizing the interpreter; freeing a tensor's Python object then takes the GIL, Python 3.11 ends a
thread that takes the GIL during finalization with pthread_exit, and its forced unwind through a
noexcept destructor calls std::terminate: the process aborts (SIGABRT, "terminate called without an
active exception") after its work is done. The aborting thread, from a core dump (issue 46):

    std::terminate <- __gxx_personality_v0 <- _Unwind_ForcedUnwind <- pthread_exit
    <- PyThread_exit_thread <- take_gil <- PyEval_AcquireThread <- pybind11::gil_scoped_acquire
    <- ConcretePyInterpreterVTable::decref <- c10::TensorImpl::decref_pyobject
    <- ~vector<vector<at::Tensor>> <- ProcessGroupGloo::AsyncWork::~AsyncWork
    <- ProcessGroupGloo::runLoop            (thread pt_gloo_runloop; main thread in Py_FinalizeEx)

destroy_process_group() does not prevent it: in torch 2.13.0 the gloo_tcp_loop and pt_gloo_runloop
threads are alive after it (the case of pytorch PR #179291, abandoned upstream). os._exit ends every
thread at once, without the teardown: measured in docs/benchmarks.md ("gloo exits",
tools/fault_soak.py --gloo-exits).

What no longer runs when such a process ends: atexit handlers (weakref.finalize's among them), the
__del__ of objects alive at exit, and the flush of files other than stdout and stderr. Nothing of ours
relies on them there: every result is written and closed before end_process (the runtime's report on
stdout, the workers' rank files), the fault board's heartbeat is joined first (FaultBoard.close), no
TemporaryDirectory is left to the collector in these processes (check's rendezvous folder belongs to
the check process, which is no gloo process), logging's handlers are flushed here, and the atexit
handlers torch and ONNX Runtime register in them (torch._dynamo's caches, torch.multiprocessing's)
write no file. check --build's rank processes (multiprocessing's forkserver children) ended with
os._exit before too (multiprocessing.forkserver), after multiprocessing's own exit work, which
end_process now skips: its finalizers (none of ours: no multiprocessing.util.Finalize) and the join
of children (they start none).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

# With this set to 1 (tools/fault_soak.py --gloo-exits --teardown), end_process ends through the
# interpreter's teardown, as our processes ended before it, to show the abort it prevents.
TEARDOWN = "K3EXPORT_GLOO_TEARDOWN"
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process that SIGINT ended


def end_process(code: int, *, fault: bool = False) -> NoReturn:
    """Ends this process with exit status `code`: destroys the default process group (not for a
    `fault`: its teardown can wait on a peer that is gone, or on a main thread blocked in a call),
    shuts logging down, flushes stdout and stderr, and calls os._exit. Call it once the results are
    written and closed."""
    if not fault and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # its reader is gone, or it is closed
            stream.flush()
    if os.environ.get(TEARDOWN) == "1" and not fault:
        sys.exit(code)
    os._exit(code)


def run_to_end(main: Callable[[], int | None]) -> NoReturn:
    """Runs a process's `main` and ends it with end_process, the exit status as Python gives it: main's
    return (None: 0) or SystemExit's code; after an exception (a fault: the group is not destroyed), 1
    with its traceback, or INTERRUPTED on Ctrl-C."""
    fault = False
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code, fault = INTERRUPTED, True
    except BaseException:
        traceback.print_exc()
        code, fault = 1, True
    if not isinstance(code, int):  # SystemExit("message"): Python prints it and exits 1
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    end_process(code, fault=fault)
