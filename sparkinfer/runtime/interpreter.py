"""Triton's interpreter (CPU ranks, CI) with dots that do not depend on the host's BLAS,
and without two costs of its own that bought nothing (`install` does both).

The interpreter runs `tl.dot` as `numpy.matmul` in the accumulator's dtype, so an fp32
dot is an OpenBLAS sgemm whose per-element summation follows the matmul's shape: on an
AMD EPYC host (OpenBLAS 0.3.29's Haswell kernels, numpy 2.2) a row's dot in a
[128, 64] x [64, 256] matmul had other fp32 bits than the same row's in a [64, 64] one,
so tiles of one kernel that agree bitwise on the GPU disagreed there
(`tests/linear/test_gemm.py::test_every_tile_gives_the_same_bits`), and a TP 3 model's
logits drifted past their tolerance against transformers; on the hosts before it the
same tests passed. `exact_dots` sums each run of 32 products of an fp32 dot in float64,
rounds it once to fp32 and adds the runs to the accumulator in K order: our kernels'
interpreted operands are bf16 or fp16 values upcast (products exact in float64, and sums
of them too unless their magnitudes span more than about 2^30), so the bits follow
neither the host's blocking nor the kernel's K step.
"""

from __future__ import annotations

__all__ = ["install", "exact_dots", "grouped_dot", "cheaper_calls", "lighter_types", "plain_bf16_casts",
           "no_discarded_overflow_checks"]

_installed = False
_calls_installed = False
_types_installed = False
_casts_installed = False
_replaced: dict[str, object] = {}  # the interpreter's own functions that cheaper_calls replaced


def install() -> None:
    """`exact_dots`, `cheaper_calls`, `lighter_types`, `plain_bf16_casts` and
    `no_discarded_overflow_checks` (idempotent; no-ops unless TRITON_INTERPRET=1)."""
    exact_dots()
    cheaper_calls()
    lighter_types()
    plain_bf16_casts()
    no_discarded_overflow_checks()


def exact_dots() -> None:
    """Install the exact fp32 dot into Triton's interpreter (idempotent; a no-op unless
    TRITON_INTERPRET=1). Other dtypes keep the interpreter's own dot.

    Each run of DOT_GROUP reduction elements is summed exactly in float64 and rounded
    to fp32, then the runs are added to the accumulator one by one in K order, as a
    tensor core's chain of MMAs adds its products: so the bits depend on the K order
    only, not on the kernel's K step (a multiple of DOT_GROUP). Rounded once per dot
    instead, the NVFP4 layer's dequantized path (bf16 steps of 64) and its kernels
    (chunks of 128) differed by one bf16 ulp in one FC1 element of 5,120
    (tests/moe/test_fp8_layer.py, 1 random seed in 6)."""
    global _installed
    from sparkinfer.envs import triton_interpret

    if _installed or not triton_interpret():
        return
    import numpy as np
    from triton.runtime import interpreter

    own = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
            return interpreter.TensorHandle(grouped_dot(a.data, b.data, d.data), d.dtype.scalar)
        return own(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    _installed = True


# Products per run: the K steps whose bits must agree are multiples of 32 (MoE chunks of
# 32-128, linear's and gemm's steps of 64 and up; a K of 16 is one run either way). Runs
# of 16 (a bf16 wgmma's K) also passed, but moved a TP 3 Qwen3 test's logit error against
# transformers from 0.495 to 0.557, past its 0.528 bound: the interpreter's truncating
# bf16 casts leave that test near its bound, and any other rounding moves it.
DOT_GROUP = 32


def grouped_dot(a, b, d):
    """d + a @ b (numpy fp32 [.., M, K], [.., K, N], [.., M, N]): float64 sums of
    DOT_GROUP products, each rounded to fp32 and added to the fp32 accumulator in K
    order (`exact_dots`). K not a multiple of DOT_GROUP is one group."""
    import numpy as np

    k = a.shape[-1]
    g = k // DOT_GROUP if k % DOT_GROUP == 0 else 1
    a_g = np.moveaxis(a.astype(np.float64).reshape(a.shape[:-1] + (g, k // g)), -2, 0)
    b_g = np.moveaxis(b.astype(np.float64).reshape(b.shape[:-2] + (g, k // g, b.shape[-1])), -3, 0)
    parts = np.matmul(a_g, b_g).astype(np.float32)  # [g, .., M, N]
    acc = d.copy()
    for part in parts:
        acc += part
    return acc


def cheaper_calls() -> None:
    """Two of Triton 3.6's interpreter costs, same results. Every call of a jitted helper
    from inside a kernel re-patches `triton.language` by walking each package with
    `inspect.getmembers` (about 0.8 ms a call), and every dtype lookup builds a dict of
    17 dtypes: in a CPU rank's interpreted prefill of the tiny Qwen3 MoE (2 layers,
    cProfile) those were 25 of 94 s. The walk is done once per package here (its
    builtins are module and class attributes, fixed after import), each call patching
    the same names the walk would find: the ones whose current value is still a builtin.
    The dtype table is built once. Idempotent; a no-op unless TRITON_INTERPRET=1."""
    global _calls_installed
    from sparkinfer.envs import triton_interpret

    if _calls_installed or not triton_interpret():
        return
    import inspect

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    names: dict[object, list[str]] = {}  # package (a module or a class) -> its builtins' names

    def patch_builtin(pkg, builder, scope):
        if pkg not in names:
            names[pkg] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name in names[pkg]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    own_dtype = interpreter._get_np_dtype
    table = {t: own_dtype(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                       tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
                                       tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            return pointer if isinstance(tt_dtype.element_ty, tl.pointer_type) else table[tt_dtype.element_ty]
        return table[tt_dtype]

    _replaced.update(patch_builtin=interpreter._patch_builtin, get_np_dtype=own_dtype)
    interpreter._patch_builtin = patch_builtin
    interpreter._get_np_dtype = np_dtype
    _calls_installed = True


def lighter_types() -> None:
    """Triton 3.6's front end rebuilds the type of a shape at every operation, and the
    interpreter runs the front end once per program: each tensor made holds its shape
    as a `tl.tuple` of constexprs whose `tuple_type` formats a name string, and each
    `block_type` unwraps its shape into another such tuple and formats one more. In a
    CPU rank's prefix-reuse test (tests/engine/test_prefix_reuse_ranks.py, py-spy)
    `block_type.__init__` and `tl.tuple.__init__` were 20% and 19% of the samples.
    Here a shape's `tuple_type`, element count and constexprs are made once per shape
    (a dict by its ints), and the two names are formatted only when read; every type
    and value compares and prints as before. The interpreted rope kernel of an 8-token
    chunk: 266-276 -> 143-148 ms a call, the same bits (this host, process time).
    Idempotent; a no-op unless TRITON_INTERPRET=1."""
    global _types_installed
    from sparkinfer.envs import triton_interpret

    if _types_installed or not triton_interpret():
        return
    import builtins
    import math

    import triton.language.core as core
    from triton._utils import validate_block_shape

    tl_tuple, constexpr, constexpr_type = core.tuple, core.constexpr, core.constexpr_type
    types: dict[tuple, object] = {}  # a tuple of ints -> its tuple_type (any ints: not only shapes)
    numels: dict[tuple, int] = {}  # a valid block shape -> its element count
    consts: dict[tuple, tuple] = {}  # a tensor's shape -> (its constexprs, their product as one)

    def tuple_type_of(key: tuple):
        ty = types.get(key)
        if ty is None:
            ty = types[key] = core.tuple_type([constexpr_type(d) for d in key])
        return ty

    def ints(values):
        """values as a tuple of ints, or None when one is neither an int nor a constexpr of one."""
        out = []
        for v in values:
            if type(v) is constexpr:
                v = v.value
            if type(v) is not int:
                return None
            out.append(v)
        return builtins.tuple(out)

    own_types = core._type_for_tuple_values

    def type_for_tuple_values(values, fields=None):
        key = None if fields is not None else ints(values)
        return own_types(values, fields) if key is None else tuple_type_of(key)

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    def block_type_init(self, element_ty, dims):
        self.element_ty = element_ty
        assert isinstance(dims, (list, builtins.tuple, tl_tuple))
        key = ints(dims.values if isinstance(dims, tl_tuple) else dims)
        plain = key is not None  # not plain ints: the original's unwrapping and checks, never the
        if not plain:  # table, where (2.0,) would find (2,): equal keys
            key = builtins.tuple(core._unwrap_shape(dims))
        if not key:
            raise TypeError('0d block_type is forbidden')
        numel = numels.get(key) if plain else None
        if numel is None:  # validated before it is kept: a bad shape raises as the original does
            numel = validate_block_shape(key)
            if plain:
                numels[key] = numel
        self.numel = numel
        self.shape = tl_tuple(list(key), tuple_type_of(key))

    def tensor_init(self, handle, type):
        self.handle = handle
        key = builtins.tuple(type.shape.values) if type.is_block() else ()
        v = consts.get(key)
        if v is None:
            v = consts[key] = ([constexpr(d) for d in key], constexpr(math.prod(key)))
        self.numel = v[1]
        self.type = type
        self.dtype = type.scalar
        self.shape = tl_tuple(list(v[0]), tuple_type_of(key))  # a list of its own: `_setitem` writes in place

    core._type_for_tuple_values = type_for_tuple_values
    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = property(lambda self: "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)])
                                    + "]")
    core.block_type.__init__ = block_type_init
    core.block_type.name = property(lambda self: f"<{self.shape}, {self.element_ty}>")
    core.tensor.__init__ = tensor_init
    _types_installed = True


def plain_bf16_casts() -> None:
    """The interpreter casts bf16 to fp32 and fp32 to bf16 (truncating) through a general
    float converter: some twenty numpy passes over the block. Where no element is
    subnormal (zeros are not) its result is the input's bits shifted by 16, which this
    computes in one pass; blocks holding a subnormal take the converter, whose own
    handling of them this keeps. 12.7% of the samples of the prefix-reuse test
    (tests/engine/test_prefix_reuse_ranks.py, py-spy, after `lighter_types`) were in the
    converter. tests/runtime/test_interpreter.py checks the bits against it. Idempotent;
    a no-op unless TRITON_INTERPRET=1."""
    global _casts_installed
    from sparkinfer.envs import triton_interpret

    if _casts_installed or not triton_interpret():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    own = interpreter._convert_float

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        up = input_dtype == tl.bfloat16 and output_dtype == tl.float32
        if not up and not (input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None):
            return own(data, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(data).view(np.uint16 if up else np.uint32)
        exponent, significand = (0x7F80, 0x7F) if up else (0x7F800000, 0x7FFFFF)
        if np.any(((bits & exponent) == 0) & ((bits & significand) != 0)):  # a subnormal
            return own(data, input_dtype, output_dtype, rounding_mode)
        out = (bits.astype(np.uint32) << 16) if up else (bits >> 16).astype(np.uint16)
        return out.reshape(data.shape)

    _replaced.update(convert_float=own)
    interpreter._convert_float = convert_float
    _casts_installed = True


def no_discarded_overflow_checks() -> None:
    """Triton 3.6's interpreter options ask for integer overflow checks (sanitize_overflow)
    but not for debug, and its `device_assert` returns at once without debug: every
    integer add, sub and mul of a kernel built the check (two casts to int64, the op,
    two compares, an and) and threw it away, 19% of the samples of the prefix-reuse test
    (tests/engine/test_prefix_reuse_ranks.py, py-spy, after `lighter_types`). With debug
    off nothing could read the check, so it is not built; with debug on (set on the
    interpreter's builder) the options are left as they are. Idempotent; a no-op unless
    TRITON_INTERPRET=1."""
    from sparkinfer.envs import triton_interpret

    if not triton_interpret():
        return
    import dataclasses

    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    if options.sanitize_overflow and not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
