"""`k3export check`: an artifact against the eager model, fed the same requests, step by step.

Shaped as Polygraphy shapes its own (a comparator that feeds every runner the same inputs, one
runner per backend):

    driver.py      the requests (a prefill of right-padded prompts, then greedy decode steps), the
                   artifact's steps recorded, the eager side after them, the comparison per step,
                   the verdict; `run_check` for an export folder (--onnx)
    compare.py     relative error, cosine, tolerances, token agreement with ties, the verdict's rules
    taps.py        per-layer taps compared, and the first divergent layer (export --taps)
    routing.py     holding the eager routers to the graph's expert choices (half precision)
    report.py      --report DIR: report.json, report.md and plots
    runners/       one runner per artifact, each on k3export.onnx.runner.StatefulRunner (which holds
                   the caches, reset, input metadata and the request check once): eager.py (the
                   reference, run a span of layers at a time: one layer streamed, one stage in
                   memory), network.py (--network), engine.py (--engine), chain.py (--build, and
                   --stage), grid.py (a build split over ranks);
                   ONNX Runtime's runner (--onnx) is k3export.onnx.runner.BoundOnnxrtRunner, which
                   the sharded runtime uses too

A new artifact is a runner (a `StatefulRunner` with `call` and, if its caches are not numpy,
`empty_caches`) and a function that hands it to `compare_with_eager`.
"""
