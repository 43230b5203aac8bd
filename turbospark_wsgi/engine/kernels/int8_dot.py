"""The int8 kernels' integer dot products, one LLVM code generator per instruction set (isa.PATHS)
side by side: `_unit_dot` (a numba intrinsic) emits, for one weight unit and 16 output rows, the
dots of the unit's weight quads with one row's int8 activations on the path its literal `isa_id`
names. Every path yields exactly the same int32 sums (tests/engine/test_quant_kernels.py pins each
one the machine can run to the numpy reference; tests/engine/test_isa.py checks what each lowers to).
"""
from . import isa

try:
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic
except ImportError:            # pragma: no cover - exercised only where numba is absent
    ir = None

if ir is not None:
    _i32x16 = ir.VectorType(ir.IntType(32), 16)

    def _bcast(builder, value, n):
        """<n x i32> with every lane `value`."""
        vt = ir.VectorType(ir.IntType(32), n)
        v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(v, v, ir.Constant(vt, [0] * n))

    _i32 = ir.IntType(32)

    def _vec(bits, n):
        return ir.VectorType(ir.IntType(bits), n)

    def _lanes(builder, v, lo, n):
        """Lanes lo..lo+n of vector v."""
        return builder.shuffle_vector(v, v, ir.Constant(_vec(32, n), list(range(lo, lo + n))))

    def _join(builder, parts):
        """The <k x i32> parts as one vector, in order."""
        while len(parts) > 1:
            n = parts[0].type.count
            parts = [builder.shuffle_vector(parts[i], parts[i + 1], ir.Constant(_vec(32, 2 * n), list(range(2 * n))))
                     for i in range(0, len(parts), 2)]
        return parts[0]

    def _call(builder, name, ret, *args):
        fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ret, [a.type for a in args]))
        return builder.call(fn, list(args))

    def _unit_dots(builder, isa_id, total, pairs, signed):
        """total (<16 x i32>, one lane per output row) + for each (w, a) of `pairs` the per-lane dot
        of w's 4 bytes (<16 x i32>) with the 4 signed activation bytes a (i32, the same for every
        lane). Weight bytes are unsigned (q4 nibbles 0..15, or q8 stored as q + 128); with `signed`
        (q8 units) the paths that take signed bytes (avx2, neon) undo the + 128 first and compute
        the plain signed dot, the others the biased one (kernels take 128 * sum(q_a) off for them:
        `_q8_bias`). Every path gives exactly the integers of `generic`."""
        if isa_id == isa.IDS["vnni512"]:
            for w, a in pairs:
                total = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _i32x16, total, w, _bcast(builder, a, 16))
            return total
        if isa_id == isa.IDS["avxvnni"]:
            halves = [_lanes(builder, total, 8 * h, 8) for h in range(2)]
            for w, a in pairs:
                av = _bcast(builder, a, 8)
                halves = [_call(builder, "llvm.x86.avx512.vpdpbusd.256", _vec(32, 8), halves[h],
                                _lanes(builder, w, 8 * h, 8), av) for h in range(2)]
            return _join(builder, halves)
        if isa_id == isa.IDS["avx2"]:
            return _join(builder, [_avx2_half(builder, _lanes(builder, total, 8 * h, 8), h, pairs, signed)
                                   for h in range(2)])
        if isa_id == isa.IDS["neon"]:
            quarters = [_lanes(builder, total, 4 * k, 4) for k in range(4)]
            for w, a in pairs:
                av = builder.bitcast(_bcast(builder, a, 4), _vec(8, 16))
                for k in range(4):
                    wq = builder.bitcast(_lanes(builder, w, 4 * k, 4), _vec(8, 16))
                    if signed:
                        wq = builder.xor(wq, ir.Constant(_vec(8, 16), [0x80] * 16))
                    quarters[k] = _call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", _vec(32, 4), quarters[k], wq, av)
            return _join(builder, quarters)
        i8x64, i32x64 = _vec(8, 64), _vec(32, 64)             # generic: widen to int32 and multiply
        for w, a in pairs:
            prod = builder.mul(builder.zext(builder.bitcast(w, i8x64), i32x64),
                               builder.sext(builder.bitcast(_bcast(builder, a, 16), i8x64), i32x64))
            for e in range(4):
                total = builder.add(total, builder.shuffle_vector(
                    prod, prod, ir.Constant(_i32x16, [4 * lane + e for lane in range(16)])))
        return total

    def _avx2_half(builder, acc, h, pairs, signed):
        """acc (<8 x i32>, rows 8h..8h+7) + the pairs' dots on those rows: `vpmaddubsw` (u8 x s8, pairs
        of products summed to i16) then `vpmaddwd` against ones (pairs of i16 summed to i32).
        q4 nibbles (<= 15) times |a| <= 127 sum to at most 3810 per i16, so up to 8 products are added
        in i16 before one `vpmaddwd`; a q8 weight's |q| <= 128 takes its sign onto a (`vpsignb`): one
        product reaches 2 * 128 * 127 = 32512 and is widened at once."""
        i8x32, i16x16 = _vec(8, 32), _vec(16, 16)
        ones = ir.Constant(i16x16, [1] * 16)
        s16, n = None, 0
        for w, a in pairs:
            wb = builder.bitcast(_lanes(builder, w, 8 * h, 8), i8x32)
            ab = builder.bitcast(_bcast(builder, a, 8), i8x32)
            if signed:
                q = builder.xor(wb, ir.Constant(i8x32, [0x80] * 32))
                wb = _call(builder, "llvm.x86.avx2.psign.b", i8x32, q, q)          # |q| (as u8: 128 for -128)
                ab = _call(builder, "llvm.x86.avx2.psign.b", i8x32, ab, q)         # a * sign(q)
            p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", i16x16, wb, ab)
            s16, n = (p, 1) if s16 is None else (builder.add(s16, p), n + 1)
            if signed or n == 8:
                acc = builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(32, 8), s16, ones))
                s16 = None
        if s16 is not None:
            acc = builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(32, 8), s16, ones))
        return acc

    def _ptr(context, builder, arrty, arr, off, elty):
        data = context.make_array(arrty)(context, builder, arr).data
        p = builder.gep(data, [off])
        return builder.bitcast(p, elty.as_pointer())

    @intrinsic
    def _q8_bias(typingctx, isa_id):
        """What a q8 unit's integer dot on path `isa_id` (a literal) holds beyond sum(q * q_a), per
        sum(q_a): 128 where the weight bytes are used as stored (q + 128), 0 where undone first."""
        if not isinstance(isa_id, types.IntegerLiteral):
            return None
        bias = 0 if isa_id.literal_value in (isa.IDS["avx2"], isa.IDS["neon"]) else 128

        def codegen(context, builder, signature, args):
            return ir.Constant(_i32, bias)
        return types.int32(isa_id), codegen

    @intrinsic
    def _unit_dot(typingctx, w, wo, a, ao, acc, co, quads, nibbles, isa_id):
        """acc[co:co+16] (int32) += for 16 rows the dot of `quads` weight quads at w[wo:] with the
        activations a[ao:] (int8); q4 (`nibbles`): low nibbles read a[ao:ao+16], high a[ao+16:].
        q8 units add `_q8_bias` * sum(q_a) beyond the dot. `isa_id` (a literal) picks the
        instructions (isa.PATHS)."""
        if not (isinstance(quads, types.IntegerLiteral) and isinstance(nibbles, types.BooleanLiteral)
                and isinstance(isa_id, types.IntegerLiteral)):
            return None
        nq, nib, path = quads.literal_value, nibbles.literal_value, isa_id.literal_value
        sig = types.void(w, wo, a, ao, acc, co, quads, nibbles, isa_id)

        def codegen(context, builder, signature, args):
            wa, wo_, aa, ao_, ca, co_ = args[:6]
            wp = _ptr(context, builder, signature.args[0], wa, wo_, ir.IntType(8))
            ap = _ptr(context, builder, signature.args[2], aa, ao_, ir.IntType(8))
            cp = _ptr(context, builder, signature.args[4], ca, co_, _i32x16)
            mask = ir.Constant(_i32x16, [0x0F0F0F0F] * 16)

            def act(at):
                q = builder.gep(ap, [ir.Constant(ir.IntType(64), at)])
                return builder.load(builder.bitcast(q, _i32.as_pointer()), align=1)
            pairs = []
            for g in range(nq):
                wv = builder.load(builder.bitcast(builder.gep(wp, [ir.Constant(ir.IntType(64), 64 * g)]),
                                                  _i32x16.as_pointer()), align=1)
                if nib:
                    pairs.append((builder.and_(wv, mask), act(4 * g)))
                    pairs.append((builder.and_(builder.lshr(wv, ir.Constant(_i32x16, [4] * 16)), mask), act(16 + 4 * g)))
                else:
                    pairs.append((wv, act(4 * g)))
            total = _unit_dots(builder, path, builder.load(cp, align=4), pairs, not nib)
            builder.store(total, cp, align=4)
            return context.get_dummy_value()
        return sig, codegen
