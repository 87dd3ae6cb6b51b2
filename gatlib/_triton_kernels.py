r"""The Triton kernels of :mod:`gatlib._triton`: row kernels over a plan's CSR (forward, the
destination side of the backward) and CSC (the source side), a merge of split rows, the
returned weights and the dropout mask. docs/gpu.md has the design.

A row kernel's program owns ``BLOCK_R`` work items (a row's in-edges, or a piece of a hub's
row) with all their heads and channels: an ``[R, HP, C]`` tile. It walks their edges one at a
time, in CSR (CSC) order, so every sum over a row's edges runs in that order whatever the
config; the tuned ``BLOCK_R`` and ``STAGES`` (the edge loop's software pipelining) change
neither a sum's order nor (with the warps fixed per layer) a tile's layout. ``KIND``: 0 GAT
from per-node terms, 1 GATv2, 2 the scaled dot product; :func:`_score` writes
:mod:`gatlib._scores`' formulas again in Triton and tests/test_triton.py holds it to them. An
absent input or output is ``None`` (Triton compiles it out). Arithmetic is in ``ACC``: float32,
float64 for float64 inputs.
"""
from __future__ import annotations

import triton
import triton.language as tl

# GATv2's att gradient is summed per program over this many work items, in item order, so its
# partial sums do not depend on BLOCK_R (which is at most this in the dst kernel).
_ATT_ROWS = tl.constexpr(16)


@triton.jit
def _items(items, block, BLOCK_R: tl.constexpr):
    """``(row, start, length, slot)`` of block ``block``'s work items, ``[BLOCK_R]`` int64: the
    edges ``start : start + length`` of segment ``row``, ``slot`` -1 for a whole row, else its
    piece's partial row. The schedule is padded: past it, ``length`` and ``slot`` are -1."""
    w = (tl.zeros([BLOCK_R], tl.int64) + block) * BLOCK_R + tl.arange(0, BLOCK_R)
    return (tl.load(items + w * 4).to(tl.int64), tl.load(items + w * 4 + 1).to(tl.int64),
            tl.load(items + w * 4 + 2).to(tl.int64), tl.load(items + w * 4 + 3).to(tl.int64))


@triton.jit
def _rows(ptr, row, mask, H: tl.constexpr, HR: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr):
    """Rows ``row`` ``[R]`` of a ``[*, HR, C]`` tensor as an ``[R, HP, BC]`` tile, zero where
    masked or padded. ``HR`` 1: one row that every head reads, loaded once per head, so that
    every tile of a kernel has one shape (and layout) and wide loads."""
    HP: tl.constexpr = triton.next_power_of_2(H)
    BC: tl.constexpr = triton.next_power_of_2(C)
    h = tl.arange(0, HP)[None, :, None]
    c = tl.arange(0, BC)[None, None, :]
    off = (row[:, None, None] * HR + h * (1 if HR > 1 else 0)) * C + c
    return tl.load(ptr + off, mask=mask[:, None, None] & (h < H) & (c < C), other=0).to(ACC)


@triton.jit
def _put(ptr, row, mask, x, HR: tl.constexpr, C: tl.constexpr):
    """Store the ``[R, HR', BC]`` tile ``x`` at rows ``row`` of a ``[*, HR, C]`` tensor."""
    h = tl.arange(0, x.shape[1])[None, :, None]
    c = tl.arange(0, x.shape[2])[None, None, :]
    tl.store(ptr + (row[:, None, None] * HR + h) * C + c, x,
             mask=mask[:, None, None] & (h < HR) & (c < C))


@triton.jit
def _heads(ptr, row, mask, H: tl.constexpr, ACC: tl.constexpr):
    """Rows ``row`` ``[R]`` of an ``[*, H]`` tensor as ``[R, HP]``."""
    h = tl.arange(0, triton.next_power_of_2(H))[None, :]
    return tl.load(ptr + row[:, None] * H + h, mask=mask[:, None] & (h < H), other=0).to(ACC)


@triton.jit
def _put_heads(ptr, row, mask, x, H: tl.constexpr):  # (_put of an [R, HP])
    h = tl.arange(0, x.shape[1])[None, :]
    tl.store(ptr + row[:, None] * H + h, x, mask=mask[:, None] & (h < H))


@triton.jit
def _head_sum(x, H: tl.constexpr):
    """``x`` ``[R, HP, C]`` summed over its ``H`` heads, in head order (each head picked out
    exactly), whatever the tile's layout: ``[R, 1, C]``."""
    h = tl.arange(0, x.shape[1])[None, :, None]
    out = tl.sum(tl.where(h == 0, x, 0.0), 1, keep_dims=True)
    for j in tl.static_range(1, H):
        out += tl.sum(tl.where(h == j, x, 0.0), 1, keep_dims=True)
    return out


@triton.jit
def _terms(KIND: tl.constexpr, ptr, row, mask, H: tl.constexpr, HR: tl.constexpr, CK: tl.constexpr,
           ACC: tl.constexpr):
    """A score's per-node or per-edge terms at ``row``: GAT's ``[R, HP]``, else an ``[R, HP, BCK]``
    tile; ``None`` where ``ptr`` is."""
    x = None
    if ptr is not None:
        if KIND == 0:
            x = _heads(ptr, row, mask, H, ACC)
        else:
            x = _rows(ptr, row, mask, H, HR, CK, ACC)
    return x


@triton.jit
def _score(KIND: tl.constexpr, xs, xd, xe, att, scale, slope):
    """``(e, z)``: the scores ``[R, HP]`` of one edge per item from its loaded terms (source
    ``xs``, destination ``xd``, edge ``xe``, GATv2's ``att``) and what the backward reuses: GAT's
    and GATv2's pre-activation ``z``, the dot kind's key ``k_j + e_ij``."""
    z = xs
    if KIND == 2:  # q_i . (k_j + e_ij) * scale
        if xe is not None:
            z = z + xe
        e = tl.sum(xd * z, 2) * scale
    else:  # GAT: LeakyReLU(s_j + t_i + w_ij); GATv2: att . LeakyReLU(x_j + y_i + w_ij)
        if xd is not None:
            z = z + xd
        if xe is not None:
            z = z + xe
        e = tl.where(z > 0, z, z * slope)
        if KIND == 1:
            e = tl.sum(e * att, 2)
    return e, z


@triton.jit
def _coef(coef, ACC: tl.constexpr):
    """``(scale, negative_slope, 1 / (1 - p), p)``, loaded so that float64 runs use exact values."""
    return (tl.load(coef).to(ACC), tl.load(coef + 1).to(ACC), tl.load(coef + 2).to(ACC),
            tl.load(coef + 3).to(tl.float32))


@triton.jit
def _dropped(seed, k, p_drop, keep_scale, H: tl.constexpr):
    """``[R, HP]``: ``1 / (1 - p)`` where the mask keeps CSR position ``k`` ``[R]`` for each head,
    else 0 (the stream: seed, CSR position * H + head, as :func:`_keep_kernel`'s)."""
    h = tl.arange(0, triton.next_power_of_2(H))[None, :]
    return tl.where(tl.rand(tl.load(seed), k[:, None] * H + h) >= p_drop, keep_scale, 0.0)


@triton.jit
def _fwd_kernel(items, graph, score, value, value_edge, coef, seed, outs,
                H: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr, KIND: tl.constexpr,
                SHARE_V: tl.constexpr, SHARE_VE: tl.constexpr, ONE_K: tl.constexpr,
                ONE_V: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                STAGES: tl.constexpr):
    """Each item's online softmax and weighted sum: ``out`` and ``lse`` of a whole row, a split
    row's piece into the partial rows (``graph``: CSR sources and edge ids; ``score``: the
    score's ``(src, dst, edge, att)``; ``outs``: ``(out, lse, part_out, part_lse)``; ``SHARE_V``:
    the value is ``src``, ``SHARE_VE``: ``value_edge`` is ``edge``; ``ONE_K``, ``ONE_V``: the key or
    the value has one head, which every head reads)."""
    csr_src, csr_eid = graph
    s_src, s_dst, s_edge, s_att = score
    out, lse, part_out, part_lse = outs
    HP: tl.constexpr = triton.next_power_of_2(H)
    row, start, length, slot = _items(items, tl.program_id(0), BLOCK_R)
    valid = length >= 0
    scale, slope, keep_scale, p_drop = _coef(coef, ACC)
    xd = _terms(KIND, s_dst, row, valid, H, H, CK, ACC)
    att = _terms(KIND, s_att, row * 0, valid, H, H, CK, ACC)  # GATv2's [H, CK], per lane
    m = tl.full([BLOCK_R, HP], float("-inf"), ACC)
    den = tl.zeros([BLOCK_R, HP], ACC)  # the running sum
    acc = tl.zeros([BLOCK_R, HP, triton.next_power_of_2(CV)], ACC)
    for e in tl.range(0, tl.max(length, 0), num_stages=STAGES):
        em = e < length
        k = start + e  # CSR positions
        j = tl.load(csr_src + k, mask=em, other=0).to(tl.int64)
        eid = k
        if s_edge is not None or value_edge is not None:  # per-edge inputs: edge-list order
            eid = tl.load(csr_eid + k, mask=em, other=0).to(tl.int64)
        xs = _terms(KIND, s_src, j, em, H, 1 if ONE_K else H, CK, ACC)
        xe = _terms(KIND, s_edge, eid, em, H, H, CK, ACC)
        s, z = _score(KIND, xs, xd, xe, att, scale, slope)
        # online softmax (FlashAttention's), one exp per edge: where s exceeds the running max
        # it is the new max (its weight 1, the sums so far rescaled), else its weight exp(s - m)
        d = s - m
        up = d > 0
        t = tl.exp(tl.where(up, -d, d))
        em2 = em[:, None]
        corr = tl.where(up, t, 1.0)
        p = tl.where(up, 1.0, t)
        m = tl.where(em2 & up, s, m)
        den = tl.where(em2, den * corr + p, den)
        if seed is not None:
            p = p * _dropped(seed, k, p_drop, keep_scale, H)
        if SHARE_V:
            v = xs
        else:
            v = _rows(value, j, em, H, 1 if ONE_V else H, CV, ACC)
        if value_edge is not None:
            if SHARE_VE:
                v = v + xe
            else:
                v = v + _rows(value_edge, eid, em, H, H, CV, ACC)
        acc = tl.where(em[:, None, None], acc * corr[:, :, None] + p[:, :, None] * v, acc)
    den_safe = tl.where(den > 0, den, 1.0)  # a row without edges: zeros, lse -inf
    o = acc / den_safe[:, :, None]
    row_lse = tl.where(den > 0, m + tl.log(den_safe), float("-inf"))
    whole = valid & (slot < 0)
    piece = valid & (slot >= 0)
    _put(out, row, whole, o, H, CV)
    _put_heads(lse, row, whole, row_lse, H)
    _put(part_out, slot, piece, o, H, CV)
    _put_heads(part_lse, slot, piece, row_lse, H)


@triton.jit
def _bwd_dst_kernel(items, graph, score, value, value_edge, coef, seed, grads, outs,
                    H: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr, KIND: tl.constexpr,
                    SHARE_V: tl.constexpr, SHARE_VE: tl.constexpr, ONE_K: tl.constexpr,
                    ONE_V: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                    STAGES: tl.constexpr):
    """Each item's in-edges again, weights recomputed from the log-sum-exp: the softmax
    gradient per edge into ``buf`` ``[E, 2, H]`` (the dropped weight and the score gradient, GAT's
    through its LeakyReLU) for :func:`_bwd_src_kernel`, the per-edge inputs' gradients, the
    destination terms' (a split row's piece into partial rows) and per program GATv2's att
    partial. ``grads``: ``(grad_out, out, lse, grad_alpha, delta_alpha)``; ``outs``: ``(buf,
    d_edge, d_value_edge, d_dst, part_dst, part_att)``."""
    csr_src, csr_eid = graph
    s_src, s_dst, s_edge, s_att = score
    grad_out, out, lse, grad_alpha, delta_alpha = grads
    buf, d_edge, d_vedge, d_dst, part_dst, part_att = outs
    HP: tl.constexpr = triton.next_power_of_2(H)
    BCK: tl.constexpr = triton.next_power_of_2(CK)
    CHUNKS: tl.constexpr = _ATT_ROWS // BLOCK_R if part_att is not None else 1
    scale, slope, keep_scale, p_drop = _coef(coef, ACC)
    att_sum = tl.zeros([HP, BCK], ACC)
    for chunk in range(CHUNKS):
        row, start, length, slot = _items(items, tl.program_id(0).to(tl.int64) * CHUNKS + chunk,
                                          BLOCK_R)
        valid = length >= 0
        g = _rows(grad_out, row, valid, H, H, CV, ACC)
        # Delta_i = <g_i, out_i> + sum_j alpha_ij dL/dalpha_ij
        delta = tl.sum(g * _rows(out, row, valid, H, H, CV, ACC), 2)
        if delta_alpha is not None:
            delta += _heads(delta_alpha, row, valid, H, ACC)
        row_lse = _heads(lse, row, valid, H, ACC)
        xd = _terms(KIND, s_dst, row, valid, H, H, CK, ACC)
        att = _terms(KIND, s_att, row * 0, valid, H, H, CK, ACC)
        if KIND == 0:
            d_acc = tl.zeros([BLOCK_R, HP], ACC)
        else:
            d_acc = tl.zeros([BLOCK_R, HP, BCK], ACC)
        att_acc = tl.zeros([BLOCK_R, HP, BCK], ACC)
        for e in tl.range(0, tl.max(length, 0), num_stages=STAGES):
            em = e < length
            em2 = em[:, None]
            k = start + e
            j = tl.load(csr_src + k, mask=em, other=0).to(tl.int64)
            eid = k
            if s_edge is not None or value_edge is not None or grad_alpha is not None:
                eid = tl.load(csr_eid + k, mask=em, other=0).to(tl.int64)
            xs = _terms(KIND, s_src, j, em, H, 1 if ONE_K else H, CK, ACC)
            xe = _terms(KIND, s_edge, eid, em, H, H, CK, ACC)
            s, z = _score(KIND, xs, xd, xe, att, scale, slope)
            p = tl.where(em2, tl.exp(s - row_lse), 0.0)  # alpha_ij
            if SHARE_V:
                v = xs
            else:
                v = _rows(value, j, em, H, 1 if ONE_V else H, CV, ACC)
            if value_edge is not None:
                if SHARE_VE:
                    v = v + xe
                else:
                    v = v + _rows(value_edge, eid, em, H, H, CV, ACC)
            dp = tl.sum(g * v, 2)  # dL/dalpha'_ij = <g_i, v_j + u_ij>
            a = p
            if seed is not None:
                drop = _dropped(seed, k, p_drop, keep_scale, H)
                a = p * drop
                dp = dp * drop
            if grad_alpha is not None:
                dp += _heads(grad_alpha, eid, em, H, ACC)
            ds = p * (dp - delta)  # the softmax's gradient
            if KIND == 0:  # through the LeakyReLU: dz, the sum of the terms' gradient
                ds = ds * tl.where(z > 0, 1.0, slope)
                d_acc += ds
                de = ds
            elif KIND == 1:
                lz = ds[:, :, None] * tl.where(z > 0, 1.0, slope)  # through the LeakyReLU
                de = lz * att  # dz [R, HP, CK]
                d_acc += de
                if part_att is not None:
                    att_acc += lz * z  # ds * LeakyReLU(z)
            else:
                d_acc += ds[:, :, None] * z  # dq_i, scaled below
                de = ds[:, :, None] * xd * scale
            if buf is not None:
                _put_heads(buf, k * 2, em, a, H)
                _put_heads(buf, k * 2 + 1, em, ds, H)
            if d_vedge is not None:
                _put(d_vedge, eid, em, a[:, :, None] * g, H, CV)
            if d_edge is not None:
                if KIND == 0:
                    _put_heads(d_edge, eid, em, de, H)
                else:
                    if SHARE_VE:  # the tensor is also the value's edge term
                        de = de + a[:, :, None] * g
                    _put(d_edge, eid, em, de, H, CK)
        if KIND == 2:
            d_acc = d_acc * scale
        if d_dst is not None:
            whole = valid & (slot < 0)
            piece = valid & (slot >= 0)
            if KIND == 0:
                _put_heads(d_dst, row, whole, d_acc, H)
                _put_heads(part_dst, slot, piece, d_acc, H)
            else:
                _put(d_dst, row, whole, d_acc, H, CK)
                _put(part_dst, slot, piece, d_acc, H, CK)
        if part_att is not None:  # each item's in order: a sum independent of BLOCK_R
            lane = tl.arange(0, BLOCK_R)[:, None, None]
            for r in tl.static_range(BLOCK_R):
                att_sum += tl.sum(tl.where(lane == r, att_acc, 0.0), 0)
    if part_att is not None:
        ha = tl.arange(0, HP)[:, None]
        ca = tl.arange(0, BCK)[None, :]
        tl.store(part_att + (tl.program_id(0).to(tl.int64) * H + ha) * CK + ca, att_sum,
                 mask=(ha < H) & (ca < CK))


@triton.jit
def _bwd_src_kernel(items, graph, score, grad_out, buf, coef, outs,
                    H: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr, KIND: tl.constexpr,
                    SUM_SRC: tl.constexpr, ONE_K: tl.constexpr, ONE_V: tl.constexpr,
                    ACC: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr):
    """Each source item's out-edges (CSC, in CSR order), gathering :func:`_bwd_dst_kernel`'s
    ``buf``: the value's gradient ``sum_i A_ij g_i`` and the source terms' (a split row's piece
    into partial rows). ``graph``: each CSC position's CSR position, destination and edge id;
    ``outs``: ``(d_value, part_value, d_src, part_src)``; ``SUM_SRC``: the value is the source
    terms, one gradient in ``d_value``."""
    csc_edge, csc_dst, csc_eid = graph
    s_src, s_dst, s_edge, s_att = score
    d_value, part_value, d_src, part_src = outs
    HP: tl.constexpr = triton.next_power_of_2(H)
    NEED_SRC: tl.constexpr = d_src is not None or SUM_SRC
    row, start, length, slot = _items(items, tl.program_id(0), BLOCK_R)
    valid = length >= 0
    scale, slope, keep_scale, p_drop = _coef(coef, ACC)
    if KIND == 1:
        xs = _rows(s_src, row, valid, H, H, CK, ACC)
        att = _rows(s_att, row * 0, valid, H, H, CK, ACC)
    dv = tl.zeros([BLOCK_R, HP, triton.next_power_of_2(CV)], ACC)
    if KIND == 0:
        dsrc = tl.zeros([BLOCK_R, HP], ACC)
    else:
        dsrc = tl.zeros([BLOCK_R, HP, triton.next_power_of_2(CK)], ACC)
    for e in tl.range(0, tl.max(length, 0), num_stages=STAGES):
        em = e < length
        t = start + e  # CSC positions
        k = tl.load(csc_edge + t, mask=em, other=0).to(tl.int64)  # CSR positions
        i = tl.load(csc_dst + t, mask=em, other=0).to(tl.int64)
        if d_value is not None:
            a = _heads(buf, k * 2, em, H, ACC)
            dv += a[:, :, None] * _rows(grad_out, i, em, H, H, CV, ACC)
        if NEED_SRC:
            ds = _heads(buf, k * 2 + 1, em, H, ACC)
            if KIND == 0:
                dsrc += ds
            elif KIND == 1:
                z = xs + _rows(s_dst, i, em, H, H, CK, ACC)
                if s_edge is not None:
                    eid = tl.load(csc_eid + t, mask=em, other=0).to(tl.int64)
                    z = z + _rows(s_edge, eid, em, H, H, CK, ACC)
                dsrc += ds[:, :, None] * att * tl.where(z > 0, 1.0, slope)
            else:
                dsrc += ds[:, :, None] * _rows(s_dst, i, em, H, H, CK, ACC)  # dk_j, scaled below
    if KIND == 2:
        dsrc = dsrc * scale
    whole = valid & (slot < 0)
    piece = valid & (slot >= 0)
    if SUM_SRC:
        dv += dsrc
    if d_value is not None:
        if ONE_V:  # every head read the one row: its gradient is their sum
            dv = _head_sum(dv, H)
        _put(d_value, row, whole, dv, 1 if ONE_V else H, CV)
        _put(part_value, slot, piece, dv, 1 if ONE_V else H, CV)
    if d_src is not None:
        if KIND == 0:
            _put_heads(d_src, row, whole, dsrc, H)
            _put_heads(part_src, slot, piece, dsrc, H)
        else:
            if ONE_K:
                dsrc = _head_sum(dsrc, H)
            _put(d_src, row, whole, dsrc, 1 if ONE_K else H, CK)
            _put(part_src, slot, piece, dsrc, 1 if ONE_K else H, CK)


@triton.jit
def _merge_kernel(splits, part, part_lse, out, lse, HR: tl.constexpr, C: tl.constexpr,
                  ACC: tl.constexpr):
    """One program per split row combines its pieces' partial rows in piece order (no atomics):
    with ``part_lse`` the forward's ``(out_p, lse_p)`` weighted by ``exp(lse_p - lse)``, else sums.
    ``splits`` ``[S, 3]``: each split row, its first partial row and its pieces (0 or 1: not split)."""
    s = tl.program_id(0).to(tl.int64)
    count = tl.load(splits + s * 3 + 2)
    if count > 1:
        row = tl.load(splits + s * 3).to(tl.int64)
        first = tl.load(splits + s * 3 + 1).to(tl.int64)
        h = tl.arange(0, triton.next_power_of_2(HR))[:, None]
        c = tl.arange(0, triton.next_power_of_2(C))[None, :]
        cm = (h < HR) & (c < C)
        acc = tl.zeros([triton.next_power_of_2(HR), triton.next_power_of_2(C)], ACC)
        m = tl.full([triton.next_power_of_2(HR), 1], float("-inf"), ACC)
        den = tl.zeros([triton.next_power_of_2(HR), 1], ACC)
        for q in range(count):
            po = tl.load(part + ((first + q) * HR + h) * C + c, mask=cm, other=0).to(ACC)
            if part_lse is not None:
                pl = tl.load(part_lse + (first + q) * HR + h, mask=h < HR, other=0).to(ACC)
                m_new = tl.maximum(m, pl)
                corr = tl.exp(m - m_new)
                w = tl.exp(pl - m_new)
                acc = acc * corr + w * po
                den = den * corr + w
                m = m_new
            else:
                acc += po
        if part_lse is not None:
            acc = acc / den
            tl.store(lse + row * HR + h, m + tl.log(den), mask=h < HR)
        tl.store(out + (row * HR + h) * C + c, acc, mask=cm)


@triton.jit(do_not_specialize=["E"])
def _alpha_kernel(graph, score, coef, lse, alpha, E, H: tl.constexpr, CK: tl.constexpr,
                  KIND: tl.constexpr, ONE_K: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """``alpha[eid, h] = exp(e_ij - lse_i)`` for ``BLOCK_K`` CSR positions (``graph``: their
    sources, destinations and edge ids)."""
    csr_src, csr_dst, csr_eid = graph
    s_src, s_dst, s_edge, s_att = score
    k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = k < E
    j = tl.load(csr_src + k, mask=m, other=0).to(tl.int64)
    i = tl.load(csr_dst + k, mask=m, other=0).to(tl.int64)
    eid = tl.load(csr_eid + k, mask=m, other=0).to(tl.int64)
    scale, slope, keep_scale, p_drop = _coef(coef, ACC)
    s, z = _score(KIND, _terms(KIND, s_src, j, m, H, 1 if ONE_K else H, CK, ACC),
                  _terms(KIND, s_dst, i, m, H, H, CK, ACC), _terms(KIND, s_edge, eid, m, H, H, CK, ACC),
                  _terms(KIND, s_att, k * 0, m, H, H, CK, ACC), scale, slope)
    _put_heads(alpha, eid, m, tl.exp(s - _heads(lse, i, m, H, ACC)), H)


@triton.jit(do_not_specialize=["E"])
def _keep_kernel(csr_eid, E, keep, seed, p_drop, H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dropout mask the row kernels apply, as ``[E, H]`` in edge-list order."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    k = lane // H
    m = k < E
    eid = tl.load(csr_eid + k, mask=m, other=0).to(tl.int64)
    kept = tl.rand(tl.load(seed), lane) >= p_drop
    tl.store(keep + eid * H + lane % H, kept.to(tl.int8), mask=m)
