"""Count the kernels a piece of work launches: Triton kernels by name, torch operators by name.

    with LaunchCounter() as launches:
        run()                                   # e.g. one decode step, warmed up before
    print(launches.total, launches.table())     # {"triton: linear_stream_kernel": 11, "torch: embedding": 1, ...}

What it counts, per name (keys "triton: <kernel>" and "torch: <operator>"):

- every Triton launch (`kernel[grid](...)`): the `run` of Triton's `JITFunction` (compiled,
  on a GPU) and of its interpreter's `InterpretedFunction` (TRITON_INTERPRET=1, on the CPU)
  is wrapped while the counter is entered and restored on exit. A compile-only `warmup`
  call is not a launch and is not counted. `execute=False` records launches without running
  them (the interpreter runs a tiny model's step in seconds; recording it takes
  milliseconds): only for work whose host code never reads a kernel's output.
- every torch operator that reaches the dispatcher (`TorchDispatchMode`) except those in
  `FREE_OPS`: views and metadata changes, which alias storage and launch nothing, and
  allocations without a fill (`empty*`), which launch nothing either. Torch operators a
  Triton launch runs inside itself (the interpreter copies tensors through torch) are not
  counted: they are that kernel's own implementation.
- host syncs (keys "sync: <operator>"): operators in `SYNC_OPS`, which make the host wait
  for the device (`.item()`, `torch.equal`, `nonzero`); a captured step must have none.

What it does not count, or counts differently from a GPU's profiler:

- a CUDA-graph replay launches from C++: nothing here sees it. Count the eager step; its
  graph holds one node per launch counted here (same kernels, same order).
- one torch operator may be several device kernels on a GPU (cuBLAS splits a matmul's
  reduction over a second kernel, some indexing ops launch two), or none (an operator on
  host scalars): torch counts are operators, not kernels.
- host-to-device copies are counted as `copy_` (a memcpy, not a kernel, on a GPU);
  `.tolist()` / `.numpy()` of a CPU tensor never reach the dispatcher, so on the CPU a host
  read that way is not seen as a sync.
- Triton's own autotuner launches a kernel many times while it tunes: warm the work up
  once before counting, so tuning, compiles and one-time plans are excluded.
- the wrapping is process-wide while entered (not per thread): launches from other
  threads count too.

Nothing here is imported at package import; torch and Triton are imported on first use.
"""

from __future__ import annotations

import collections
import contextlib

__all__ = ["FREE_OPS", "SYNC_OPS", "LaunchCounter", "count_launches", "format_counts"]

# aten operators (overload packets) that launch no device kernel: views (an alias of the
# input's storage with other sizes / strides / offset) and allocations without a fill
FREE_OPS = frozenset({
    # views and metadata
    "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "as_strided", "alias", "detach",
    "t", "transpose", "permute", "expand", "expand_as", "squeeze", "unsqueeze", "unflatten", "flatten",
    "slice", "select", "narrow", "diagonal", "unfold", "split", "split_with_sizes", "chunk", "unbind",
    "view_as_real", "view_as_complex", "real", "imag", "conj", "_conj", "_neg_view", "lift_fresh",
    # allocations (no fill) and storage bookkeeping (record_stream: the caching allocator's)
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
    "record_stream",
    # size / stride queries (seen only for tensor subclasses)
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "dim", "size", "stride",
})
# aten operators after which the host holds a device value: each waits for the device
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "masked_select",
                      "unique", "_unique2", "unique_consecutive"})


class LaunchCounter:
    """A context manager counting the launches inside it (module docstring).

    execute: run the Triton kernels (True) or only record their launches (False).
    torch_ops: count torch operators too (a TorchDispatchMode while entered).
    After (or during) the block: `counts` (a Counter by key), `total` (launches:
    Triton + torch, host syncs excluded), `syncs` (the "sync: " keys), `table()`.
    Not reentrant; use a fresh counter per measured block.
    """

    def __init__(self, *, execute: bool = True, torch_ops: bool = True):
        self.execute, self.torch_ops = execute, torch_ops
        self.counts: collections.Counter = collections.Counter()
        self._stack: contextlib.ExitStack | None = None
        self._inside_kernel = 0  # > 0 while a Triton launch runs: its torch calls are its own

    @property
    def total(self) -> int:
        return sum(n for k, n in self.counts.items() if not k.startswith("sync: "))

    @property
    def syncs(self) -> collections.Counter:
        return collections.Counter({k: n for k, n in self.counts.items() if k.startswith("sync: ")})

    def table(self) -> str:
        """One line per key, most launched first."""
        return format_counts(self.counts)

    def __enter__(self) -> LaunchCounter:
        if self._stack is not None:
            raise RuntimeError("LaunchCounter is already entered; use a fresh one per block")
        stack = contextlib.ExitStack()
        try:
            for cls in _kernel_classes():
                stack.enter_context(_patched_run(cls, self))
            if self.torch_ops:
                stack.enter_context(_dispatch_mode(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        stack.close()


def count_launches(fn, *, warmup: int = 1, execute: bool = True, torch_ops: bool = True) -> LaunchCounter:
    """Call fn() `warmup` times (compiles, autotuning, one-time plans), then once inside a
    `LaunchCounter`; returns the counter."""
    for _ in range(warmup):
        fn()
    with LaunchCounter(execute=execute, torch_ops=torch_ops) as counter:
        fn()
    return counter


def format_counts(counts) -> str:
    """Lines of "  <count>  <key>", most first (ties by key)."""
    return "\n".join(f"  {n:5d}  {k}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _kernel_classes() -> list:
    """The classes whose `run` is a Triton launch: the compiled JITFunction and, when Triton
    runs interpreted, its InterpretedFunction (`triton.jit` returns one or the other)."""
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter: compiled launches only
        return classes
    return classes + [InterpretedFunction]


@contextlib.contextmanager
def _patched_run(cls, counter: LaunchCounter):
    """cls.run counts launches (not compile-only warmups) into `counter`; restored on exit.
    The wrapper sits on the class, so every kernel of that class is counted, including
    those the Autotuner and Heuristics wrappers reach through `self.fn.run`."""
    original = cls.__dict__["run"]

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        counter.counts["triton: " + self.fn.__name__] += 1
        if not counter.execute:
            return None
        counter._inside_kernel += 1
        try:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter._inside_kernel -= 1

    cls.run = run
    try:
        yield
    finally:
        cls.run = original


def _dispatch_mode(counter: LaunchCounter):
    """A TorchDispatchMode adding every operator not in FREE_OPS to `counter` (SYNC_OPS
    under "sync: "), except while a Triton launch runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not counter._inside_kernel and name not in FREE_OPS:
                counter.counts[("sync: " if name in SYNC_OPS else "torch: ") + name] += 1
            return func(*args, **(kwargs or {}))

    return _Count()
