"""Apply phase tracing (globaltimer + clock64 per block) to the fused LL kernel and the LL all-reduce in the tree at argv[1]."""
import sys, os
root = sys.argv[1]
TR = '''@triton.jit
def _tr(p_trace, i):
    g = tlcuda.globaltimer().to(tl.int64)
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(p_trace + tl.program_id(0) * 16 + i, g)
    tl.store(p_trace + tl.program_id(0) * 16 + 8 + i, c)


'''
def edit(path, reps):
    p = os.path.join(root, path); s = open(p).read()
    for a, b in reps:
        assert s.count(a) == 1, (path, a)
        s = s.replace(a, b)
    open(p, "w").write(s)

edit("sparkinfer/comm/fused_norm/kernel.py", [
    ("import triton.language as tl\n", "import triton.language as tl\nfrom triton.language.extra import cuda as tlcuda\n"),
    ("@triton.jit\ndef _piece_words(", TR + "@triton.jit\ndef _piece_words("),
    ("    NP: tl.constexpr, ONE_PASS: tl.constexpr, ONE_PIECE: tl.constexpr, INTERP: tl.constexpr,\n):",
     "    NP: tl.constexpr, ONE_PASS: tl.constexpr, ONE_PIECE: tl.constexpr, INTERP: tl.constexpr, p_trace=None, TRACE: tl.constexpr = False,\n):"),
    ("    DT: tl.constexpr = p_x.dtype.element_ty\n    epoch, deadline = begin(table, rank, timeout_ns, INTERP)\n    flag = ll_flag(epoch, fp)\n    p_x32",
     "    DT: tl.constexpr = p_x.dtype.element_ty\n    if TRACE:\n        _tr(p_trace, 0)\n    epoch, deadline = begin(table, rank, timeout_ns, INTERP)\n    flag = ll_flag(epoch, fp)\n    p_x32"),
    ("        _ll_push(p_x32, w_lo, w_hi, flag, table, rank, epoch, ll_off, ll_slot_bytes, ll_lane_bytes, W, BLOCK_W)\n    status",
     "        _ll_push(p_x32, w_lo, w_hi, flag, table, rank, epoch, ll_off, ll_slot_bytes, ll_lane_bytes, W, BLOCK_W)\n    if TRACE:\n        _tr(p_trace, 1)\n    status"),
    ("            if status == 0:\n                tl.store(p_res_out32 + o, pack_out(r_lo, r_hi, HALF, DT), mask=m)\n                ss = tl.sum(",
     "            if TRACE:\n                _tr(p_trace, 2)\n            if status == 0:\n                tl.store(p_res_out32 + o, pack_out(r_lo, r_hi, HALF, DT), mask=m)\n                ss = tl.sum("),
    ("                # this block's own partial", "                if TRACE:\n                    _tr(p_trace, 3)\n                # this block's own partial"),
    ("                                            W, NP, INTERP)\n                rstd", "                                            W, NP, INTERP)\n                if TRACE:\n                    _tr(p_trace, 4)\n                rstd"),
    ("        if arrive_last(table, rank):\n            ll_clear(", "        if TRACE:\n            _tr(p_trace, 5)\n        if arrive_last(table, rank):\n            ll_clear("),
    ("            close_epoch(table, rank, epoch)\n", "            close_epoch(table, rank, epoch)\n        if TRACE:\n            _tr(p_trace, 6)\n"),
])
edit("sparkinfer/comm/fused_norm/launch.py", [
    ('ALGORITHMS = ("auto",', 'TRACE = None\nALGORITHMS = ("auto",'),
    ("                      INTERP=comm.caps.interpret)\n    else:",
     "                      INTERP=comm.caps.interpret)\n        if TRACE is not None:\n            consts.update(p_trace=TRACE, TRACE=True)\n    else:"),
])
edit("sparkinfer/comm/all_reduce/kernel.py", [
    ("import triton.language as tl\n", "import triton.language as tl\nfrom triton.language.extra import cuda as tlcuda\nfrom sparkinfer.comm.fused_norm.kernel import _tr\n"),
    ("    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, INTERP: tl.constexpr,\n):",
     "    OP: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, INTERP: tl.constexpr, p_trace=None, TRACE: tl.constexpr = False,\n):"),
    ("    DT: tl.constexpr = p_x.dtype.element_ty\n    epoch, deadline = begin(table, rank, timeout_ns, INTERP)\n    flag = ll_flag(epoch, fp)\n    p_x32 = p_x.to(tl.pointer_type(tl.int32), bitcast=True)\n    p_out32",
     "    DT: tl.constexpr = p_x.dtype.element_ty\n    if TRACE:\n        _tr(p_trace, 0)\n    epoch, deadline = begin(table, rank, timeout_ns, INTERP)\n    flag = ll_flag(epoch, fp)\n    p_x32 = p_x.to(tl.pointer_type(tl.int32), bitcast=True)\n    p_out32"),
    ("                tl.store(p_lane + o, w, mask=m)\n    status = tl.zeros([], tl.int32)\n    for start",
     "                tl.store(p_lane + o, w, mask=m)\n    if TRACE:\n        _tr(p_trace, 1)\n    status = tl.zeros([], tl.int32)\n    for start"),
    ("            tl.store(p_out32 + o, pack_out(acc_lo, acc_hi, HALF, DT), mask=m)\n    finish(table, rank, epoch)",
     "            tl.store(p_out32 + o, pack_out(acc_lo, acc_hi, HALF, DT), mask=m)\n    if TRACE:\n        _tr(p_trace, 2)\n    finish(table, rank, epoch)\n    if TRACE:\n        _tr(p_trace, 3)"),
])
edit("sparkinfer/comm/all_reduce/launch.py", [
    ("def twoshot_chunk(", "TRACE = None\n\n\ndef twoshot_chunk("),
    ("HALF=x.element_size() == 2, INTERP=comm.caps.interpret)\n", "HALF=x.element_size() == 2, INTERP=comm.caps.interpret)\n        if TRACE is not None:\n            consts.update(p_trace=TRACE, TRACE=True)\n"),
])
print("traced", root)
