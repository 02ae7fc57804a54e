"""exp_table(out, count, rate, scale): out[j] = scale * exp(j * rate) for j < count, in vector code.

The engines' power tables (kernels.power_tables_into) are exponentials of j * rate. Through the
C library, one call each (the block scheme below, with blocks of ~sqrt(N)), the calls cannot be
vectorised, and at small N they are a large share of an option's time (docs/decisions.md). Here
exp is written out in LLVM vector code: x = k ln2 + r with k = rint(x / ln2) (Cody-Waite: ln2 in
two parts, k * LN2_HI exact), exp(r) by its Taylor polynomial of degree 13 in fused multiply-adds
(|r| <= ln2 / 2: the remainder is below 2e-18), times 2^k built in the exponent bits: within 0.80
ulp of exact (mpmath, 40 000 arguments in [-708, 709]; the C library: 0.50). The table is blocks
of eight, entry 8 b + j = (scale exp(8 b rate)) * exp(j rate), as the C library's block scheme
had them: an exp per eight entries. Each entry is within a few ulp of scale * exp(j * rate) (2.7
at most over 66 000 entries against decimal arithmetic, tests/test_engines.py), plus |j * rate|
ulp for the rounding of the argument (as in any exp(j * rate)). Every lane is the same sequence
of IEEE operations (fused multiply-adds are exact-rounded, in hardware or not), so the tables
are the same bits on every x86 machine and in every vector width.

Valid for |(count - 1) * rate| <= EXP_TABLE_MAX_ARGUMENT (2^k stays a normal number); callers fall
back to the C library beyond (kernels.power_tables_into).
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

EXP_TABLE_MAX_ARGUMENT = 700.0

_LANES = 8
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")    # 32 low mantissa bits zero: k * _LN2_HI exact
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")   # ln 2 - _LN2_HI
_INV_LN2 = 1.0 / math.log(2.0)
_TAYLOR = [1.0 / math.factorial(k) for k in range(14)]


def _vector_function(builder, name: str, vector, arity: int):
    return cgutils.get_or_insert_function(builder.module,
                                          ir.FunctionType(vector, [vector] * arity), name)


@intrinsic
def exp_table(typingctx, out, count, rate, scale):
    """out[j] = scale * exp(j * rate) for 0 <= j < count; out[count:] untouched."""
    def codegen(context, builder, signature, args):
        out, count, rate, scale = args
        f64, i64, i32 = ir.DoubleType(), ir.IntType(64), ir.IntType(32)
        vec, ivec = ir.VectorType(f64, _LANES), ir.VectorType(i64, _LANES)
        data = context.make_array(signature.args[0])(context, builder, out).data
        fma = _vector_function(builder, "llvm.fma.v8f64", vec, 3)
        rint = _vector_function(builder, "llvm.rint.v8f64", vec, 1)
        lanes = ir.Constant(ivec, list(range(_LANES)))

        def splat(x, vector_type):
            one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), x,
                                         ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined),
                                          ir.Constant(ir.VectorType(i32, _LANES), [0] * _LANES))

        def const(x):
            return ir.Constant(vec, [x] * _LANES)

        store = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [vec, vec.as_pointer(), i32,
                                                            ir.VectorType(ir.IntType(1), _LANES)]),
            "llvm.masked.store.v8f64.p0v8f64")

        def entries(j0, vrate, vscale=None):
            """vscale * exp(j * vrate) for j = j0 .. j0 + 7."""
            x = builder.fmul(builder.sitofp(builder.add(splat(j0, ivec), lanes), vec), vrate)
            k = builder.call(rint, [builder.fmul(x, const(_INV_LN2))])
            r = builder.call(fma, [k, const(-_LN2_HI), x])
            r = builder.call(fma, [k, const(-_LN2_LO), r])
            p = const(_TAYLOR[13])
            for coefficient in _TAYLOR[12::-1]:
                p = builder.call(fma, [p, r, const(coefficient)])
            two_k = builder.bitcast(builder.shl(builder.add(builder.fptosi(k, ivec),
                                                            ir.Constant(ivec, [1023] * _LANES)),
                                                ir.Constant(ivec, [52] * _LANES)), vec)
            e = builder.fmul(p, two_k)
            return e if vscale is None else builder.fmul(e, vscale)

        def at(j):
            return builder.bitcast(builder.gep(data, [j]), vec.as_pointer())

        # out[8 b + j] = (scale exp(8 b rate)) * exp(j rate): the block factors eight at a time
        # (8 * rate is exact, so their arguments round as (8 b) * rate would), each block one
        # vector product
        small = entries(ir.Constant(i64, 0), splat(rate, vec))
        block_rate = splat(builder.fmul(rate, ir.Constant(f64, float(_LANES))), vec)
        blocks = builder.sdiv(builder.add(count, ir.Constant(i64, _LANES - 1)),
                              ir.Constant(i64, _LANES))
        factors = cgutils.alloca_once(builder, vec)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), blocks,
                                     ir.Constant(i64, _LANES)) as (b0, _):
            builder.store(entries(b0, block_rate, splat(scale, vec)), factors)
            last = builder.sub(blocks, b0)
            here = builder.select(builder.icmp_signed("<", last, ir.Constant(i64, _LANES)), last,
                                  ir.Constant(i64, _LANES))
            with cgutils.for_range(builder, here) as loop:
                b = builder.add(b0, loop.index)
                factor = builder.load(builder.gep(builder.bitcast(factors, f64.as_pointer()),
                                                  [loop.index]))
                block = builder.fmul(splat(factor, vec), small)
                j = builder.mul(b, ir.Constant(i64, _LANES))
                left = builder.sub(count, j)
                with builder.if_else(builder.icmp_signed(">=", left,
                                                         ir.Constant(i64, _LANES))) as (full, part):
                    with full:
                        builder.store(block, at(j), align=8)
                    with part:
                        mask = builder.icmp_signed("<", lanes, splat(left, ivec))
                        builder.call(store, [block, at(j), ir.Constant(i32, 8), mask])
        return context.get_dummy_value()

    return types.void(out, count, rate, scale), codegen
