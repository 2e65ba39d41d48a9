"""Spawn gloo ranks on CPU and re-raise a child's failure with its rank.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in
``world_size`` fresh processes joined to one gloo process group (or
``backend="nccl"``: tests/dist/test_cuda.py), and
returns the list of the ranks' return values.

The processes are forked from a multiprocessing forkserver that has already
imported torch and fullshard, so each test still gets fresh processes (no state
leaks from one test into the next) without paying the ~5 s of interpreter start
and imports per rank that spawn costs on a 2-core machine. A rank sees the
caller's environment and working directory as of the call, as it would under
spawn, except that glibc reads ``MALLOC_*_`` variables only at process start:
the rank applies the ones in ``_MALLOPT`` itself with ``mallopt(3)``.
``FULLSHARD_TEST_START=spawn`` restores plain spawn.
``run_main(main, argv, ...)`` runs a command's ``main`` the same way, as a
command's process (tests/e2e run the ``fullshard`` command so). A child's exception is raised
in the parent as ``RankFailure`` carrying the rank and the child's traceback;
a hang is killed after ``timeout_s`` and reported, never waited on forever.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback


class RankFailure(AssertionError):
    """A spawned rank raised; the message holds its rank and traceback."""


# Imported once in the forkserver; every rank is forked from it.
_PRELOAD = ["torch", "torch.distributed", "fullshard", "fullshard.cli", "fullshard.train.loop",
            "torch.distributed.launcher.api", "tests.dist.harness", "tests.dist.common", "tests.dist.models"]
_CONTEXT = None
# glibc's tunables read from the environment at process start, and their mallopt(3)
# parameter numbers (malloc.h: M_TRIM_THRESHOLD -1, M_TOP_PAD -2, M_MMAP_THRESHOLD -3).
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}


def context():
    """The multiprocessing context ranks start from (the preloaded forkserver, or spawn)."""
    global _CONTEXT
    if _CONTEXT is None:
        method = os.environ.get("FULLSHARD_TEST_START", "forkserver")
        _CONTEXT = mp.get_context(method)
        if method == "forkserver":
            _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


def _become_caller(env, cwd):
    """In a process forked from the forkserver (started with the environment of the first call):
    the caller's environment, working directory and ``MALLOC_*_`` tunables, as spawn would give."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _apply_malloc_env(env)


def _apply_malloc_env(env):
    """Set the caller's ``MALLOC_*_`` tunables in a forked rank, where glibc never reads them."""
    wanted = {param: int(env[name]) for name, param in _MALLOPT.items() if name in env}
    if not wanted:
        return
    mallopt = ctypes.CDLL(None).mallopt
    for param, value in wanted.items():
        if mallopt(param, value) != 1:
            raise RuntimeError(f"mallopt({param}, {value}) failed; run with FULLSHARD_TEST_START=spawn")


def _worker(rank, world_size, init_file, backend, fn, args, results, env, cwd):
    _become_caller(env, cwd)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 600.0, backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend`` process group."""
    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, backend, fn, args, results,
                                                      dict(os.environ), os.getcwd()))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outs, failures = {}, []
        deadline = time.monotonic() + timeout_s
        try:
            while len(outs) < world_size and not failures:
                try:
                    rank, ok, payload = results.get(timeout=1.0)
                except queue.Empty:
                    missing = [r for r in range(world_size) if r not in outs]
                    dead = [r for r in missing if procs[r].exitcode is not None]
                    if dead:
                        failures.append((dead[0], f"exited with code {procs[dead[0]].exitcode} "
                                                  "before reporting a result"))
                    elif time.monotonic() > deadline:
                        failures.append((-1, f"timed out after {timeout_s}s waiting for ranks {missing}"))
                    continue
                if ok:
                    outs[rank] = payload
                else:
                    failures.append((rank, payload))  # the others may now hang in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if failures else 60)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            rank, tb = failures[0]
            raise RankFailure(f"rank {rank} of {world_size} failed:\n{tb}")
        return [outs[r] for r in range(world_size)]


def _main_worker(main, argv, env, cwd, out_path, err_path):
    _become_caller(env, cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            sys.stderr.write(f"{e.code}\n")
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child skips them; a command's process runs them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def run_main(main, argv: list, env: dict, timeout_s: float, args=None) -> subprocess.CompletedProcess:
    """``main(argv)`` (a command's ``main``) in a process forked from the forkserver, as a command's
    process: environment ``env``, this working directory, stdout and stderr captured, exit status
    ``main``'s return value (a ``SystemExit``'s code; 1 and a traceback for an exception).

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` (it is killed).
    """
    ctx = context()
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out_path, err_path):  # there even if the process dies before writing
            open(path, "w").close()
        proc = ctx.Process(target=_main_worker, args=(main, argv, env, os.getcwd(), out_path, err_path))
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(args or argv, timeout_s)
        with open(out_path, errors="replace") as f_out, open(err_path, errors="replace") as f_err:
            return subprocess.CompletedProcess(args or argv, proc.exitcode, f_out.read(), f_err.read())
