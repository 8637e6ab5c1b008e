"""Helpers for tests and benchmarks, not used by a training job.

    multiproc  run a function on N spawned gloo ranks and collect the results
    gather     the full logical state of a live job, for bit-for-bit comparisons
"""
