r"""The Triton kernels of :mod:`gatlib._triton` over the plan's CSR/CSC layout and the work
items of :mod:`gatlib._triton_schedule` (docs/gpu.md has their design). :func:`_score` writes
:mod:`gatlib._scores`' formulas again in Triton; tests/test_triton.py holds them to it."""
from __future__ import annotations

import triton
import triton.language as tl

# Integer arguments that change with the graph (DEG: its degree bucket, a tuning key only): not
# specialised on their value, which would compile anew for many a mini-batch. Heads and channels
# are fixed per layer and constexprs: row offsets are known multiples (vector loads), no division.
_PER_CALL = ("E", "P_ROWS", "DEG")


# A program owns BLOCK_R lanes: lane l is (work item l // H, head l % H), so a source's [H, C]
# row is read contiguously; or (LANE_HEADS) one work item with every head. The items are
# loaded in the kernels' own bodies: AOT autograd refused a compiled step whose helpers took
# the arrays (docs/design.md, "Compiled calls launch the eager kernels").
@triton.jit
def _lane_items(blk, n_items, H, BLOCK_R: tl.constexpr):
    """``(lane, valid, item, head)`` of block ``blk``'s lanes, in int64 (E·H can pass 2**31)."""
    lane = (tl.zeros([BLOCK_R], tl.int64) + blk) * BLOCK_R + tl.arange(0, BLOCK_R)
    local = lane // H
    return lane, local < n_items, local, lane % H


@triton.jit
def _lane_slots(valid, slot, length):
    """``(final, piece, slot, longest)``: a lane writes its row's result (``final``) or a
    split row's partial in ``slot`` (``piece``)."""
    final = valid & (slot < 0)
    piece = valid & (slot >= 0)
    return final, piece, tl.where(piece, slot, 0), tl.max(length, 0)


@triton.jit
def _softmax_step(score, m_i, l_i):
    """Online softmax over axis 1 of ``score`` (masked edges -inf): ``(p, corr, m, l)``, the
    step's weights, the factor rescaling the sums so far, the running max and sum."""
    m_new = tl.maximum(m_i, tl.max(score, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no edge seen yet
    p = tl.exp(score - tl.expand_dims(m_safe, 1))
    corr = tl.exp(m_i - m_safe)
    return p, corr, m_new, l_i * corr + tl.sum(p, 1)


@triton.jit
def _softmax_end(m_i, l_i):
    """``(l, lse)``: the sum (1 for a row without edges, whose output stays 0) and the
    log-sum-exp (-inf there)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return l_safe, tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))


@triton.jit
def _store_partials(part, acc, W, P_ROWS, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                    ACC: tl.constexpr):
    """Store this program's per-lane partials of a parameter's gradient in rows ``pid * BLOCK_R :``
    of ``part`` ``[P_ROWS, W]`` (the caller sums row ``r`` into head ``r % H``; the grid is a
    multiple of ``H``) and zero the rows no program writes: the buffer's size is the same for
    every config and grid."""
    w = tl.arange(0, BLOCK_W)[None, :]
    zero = tl.zeros([BLOCK_R], tl.int64)  # (row arithmetic in int64: rows * W of wide rows)
    base = tl.arange(0, BLOCK_R)
    pid = tl.program_id(0)
    tl.store(part + (base + (zero + pid) * BLOCK_R)[:, None] * W + w, acc, mask=w < W)
    zeros = tl.zeros([BLOCK_R, BLOCK_W], ACC)
    for v in range(pid + tl.num_programs(0), P_ROWS // BLOCK_R, tl.num_programs(0)):
        tl.store(part + (base + (zero + v) * BLOCK_R)[:, None] * W + w, zeros, mask=w < W)


@triton.jit
def _score(s_src, s_dst, s_edge, s_att, h, H, CK, src, dst, eid, m_src, m_dst, m_edge,
           scale, slope, KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr,
           ONE_K: tl.constexpr, ACC: tl.constexpr, BLOCK_CK: tl.constexpr):
    """Scores of a tile of edges ``src -> dst`` (original ids ``eid``), head ``h``: int64
    tiles broadcasting to ``[R, E]``, each with its mask; per-node terms load at their own
    shape (a row's query once per tile). ``KIND`` 0 GAT from node terms, 1 GATv2, 2 dot
    product, 3 GAT from the projected rows with ``s_att = [a_src; a_dst]``. ``ONE_K``: one
    source head shared by every head (input-space keys ``[N, 1, CK]``).

    Returns ``(score, z, xs, xd, xe)``: the scores, the pre-activation (``k_j + e_ij`` for the
    dot product) and the loaded source, destination and edge tiles, which callers reuse."""
    if KIND == 0:  # GAT: z = a_src[j] + a_dst[i] + a_edge[ij], per-node scalars
        z = tl.load(s_src + src * H + h, mask=m_src, other=0).to(ACC)
        if HAS_DST:
            z = z + tl.load(s_dst + dst * H + h, mask=m_dst, other=0).to(ACC)
        if HAS_EDGE:
            z = z + tl.load(s_edge + eid * H + h, mask=m_edge, other=0).to(ACC)
        score = tl.where(z > 0, z, z * slope)  # LeakyReLU
        xs = z
        xd = z
        xe = z
    else:
        ck = tl.arange(0, BLOCK_CK)[None, None, :]
        if ONE_K:
            srow = src
        else:
            srow = src * H + h
        cm = ck < CK
        xs = tl.load(s_src + srow[:, :, None] * CK + ck, mask=m_src[:, :, None] & cm,
                     other=0).to(ACC)
        xd = tl.load(s_dst + (dst * H + h)[:, :, None] * CK + ck, mask=m_dst[:, :, None] & cm,
                     other=0).to(ACC)
        if HAS_EDGE and KIND != 3:
            xe = tl.load(s_edge + (eid * H + h)[:, :, None] * CK + ck,
                         mask=m_edge[:, :, None] & cm, other=0).to(ACC)
        else:
            xe = xs
        if KIND == 1:  # GATv2: att . leaky(x_src[j] + x_dst[i] + e_ij)
            z = xs + xd
            if HAS_EDGE:
                z = z + xe
            att = tl.load(s_att + h[:, :, None] * CK + ck, mask=cm, other=0).to(ACC)
            score = tl.sum(tl.where(z > 0, z, z * slope) * att, 2)
        elif KIND == 2:  # dot product: q_i . (k_j + e_ij) * scale
            z = xs
            if HAS_EDGE:
                z = z + xe
            score = tl.sum(xd * z, 2) * scale
        else:  # GAT from the projected rows h (KIND 3): a_src.h_j + a_dst.h_i + a_edge[ij]
            a_s = tl.load(s_att + h[:, :, None] * CK + ck, mask=cm, other=0).to(ACC)
            a_d = tl.load(s_att + (H + h)[:, :, None] * CK + ck, mask=cm, other=0).to(ACC)
            z = tl.sum(xs * a_s, 2) + tl.sum(xd * a_d, 2)
            if HAS_EDGE:
                z = z + tl.load(s_edge + eid * H + h, mask=m_edge, other=0).to(ACC)
            score = tl.where(z > 0, z, z * slope)  # LeakyReLU
    return score, z, xs, xd, xe


@triton.jit
def _fwd_heads_block(
    row, start, length, valid, final, piece, slot, max_len, csr_src, s_src, s_dst, value, bias,
    out, out_b, lse, part_out, part_lse, scale, slope, keep_scale, seed, p_drop, H, CK, CV, KIND: tl.constexpr,
    HAS_DST: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, STAGES: tl.constexpr, BLOCK_CV: tl.constexpr,
    HP: tl.constexpr,
):
    """:func:`_fwd_kernel` with every head of an item in one lane (``HP``: heads padded to a
    power of two), for a value all heads share (``ONE_V``, input-space aggregation): each
    source row is gathered once for all heads. GAT from node terms or the dot product
    (``KIND`` 0, 2), no edge features; a head axis on ``[R, E, HP]`` and ``[R, HP, C]``."""
    hh = tl.arange(0, HP)
    hm = hh < H
    h3 = hh[None, None, :]  # [1, 1, HP]
    c = tl.arange(0, BLOCK_CV)
    cm = c < CV
    if DROPOUT:
        rng_seed = tl.load(seed)
    vh = valid[:, None] & hm[None, :]  # [R, HP]
    hrow = row[:, None] * H + hh[None, :]  # [R, HP]: the rows of [N, H] and [N, H, C]
    m_i = tl.full([BLOCK_R, HP], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_R, HP], ACC)
    acc = tl.zeros([BLOCK_R, HP, BLOCK_CV], ACC)
    for off in tl.range(0, max_len, BLOCK_E, num_stages=STAGES):
        pos = off + tl.arange(0, BLOCK_E)[None, :]
        emask = pos < length[:, None]  # [R, E]
        k = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # CSR positions, int64
        src = tl.load(csr_src + k, mask=emask, other=0).to(tl.int64)
        v = tl.load(value + src[:, :, None] * CV + c[None, None, :],
                    mask=emask[:, :, None] & cm[None, None, :], other=0).to(ACC)
        em3 = emask[:, :, None] & hm[None, None, :]  # [R, E, HP]
        if KIND == 0:  # GAT from node terms, every head: [R, E, HP]
            score, z, zs, zd, ze = _score(s_src, s_dst, s_src, s_src, h3, H, 1, src[:, :, None],
                                       row[:, None, None], src[:, :, None], em3,
                                       vh[:, None, :], em3, scale, slope, 0, HAS_DST, False,
                                       False, ACC, 1)
        else:  # dot product: q_i . k_j * scale, the key being the value; head by head,
            # so that no [R, E, HP, C] product is live (it spilled at 128 channels)
            score = tl.zeros([BLOCK_R, BLOCK_E, HP], ACC)
            for j in tl.static_range(HP):
                qm = (valid & (row * 0 + j < H))[:, None, None]  # [R, 1, 1]
                qj = tl.load(s_dst + (row * H + j)[:, None, None] * CK + c[None, None, :],
                             mask=qm & cm[None, None, :], other=0).to(ACC)
                score = tl.where(h3 == j, tl.sum(v * qj, 2)[:, :, None], score)
            score = score * scale
        score = tl.where(em3, score, float("-inf"))
        p, corr, m_i, l_i = _softmax_step(score, m_i, l_i)  # p: [R, E, HP]
        if DROPOUT:  # the stream of _fwd_kernel: (CSR position * H + head)
            keep = tl.rand(rng_seed, k[:, :, None] * H + h3) >= p_drop
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = acc * corr[:, :, None]
        for j in tl.static_range(HP):  # each head's weighted sum of the one gather
            pj = tl.sum(tl.where(h3 == j, p, 0.0), 2)  # [R, E]
            acc += tl.where(hh[None, :, None] == j,
                            tl.sum(pj[:, :, None] * v, 1)[:, None, :], 0.0)
    l_safe, row_lse = _softmax_end(m_i, l_i)
    o = acc / l_safe[:, :, None]  # [R, HP, CV]
    c3 = c[None, None, :]
    om = vh[:, :, None] & cm[None, None, :]
    orow = hrow[:, :, None] * CV + c3
    prow = (slot[:, None] * H + hh[None, :])[:, :, None] * CV + c3
    fm = final[:, None] & hm[None, :]
    pm = piece[:, None] & hm[None, :]
    tl.store(out + orow, o, mask=om & final[:, None, None])
    tl.store(lse + hrow, row_lse, mask=fm)
    tl.store(part_out + prow, o, mask=om & piece[:, None, None])
    tl.store(part_lse + slot[:, None] * H + hh[None, :], row_lse, mask=pm)
    if HAS_BIAS:
        o += tl.load(bias + hh[None, :, None] * CV + c3, mask=om, other=0).to(ACC)
        tl.store(out_b + orow, o, mask=om & final[:, None, None])


@triton.jit(do_not_specialize=_PER_CALL)
def _fwd_kernel(
    items, bounds, csr_src, csr_eid, s_src, s_dst, s_edge, s_att, value, value_edge, bias, coef,
    out, out_b, lse, part_out, part_lse, seed, p_drop, DEG,
    H: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr,
    KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr, HAS_VEDGE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SHARE_V: tl.constexpr, SHARE_VE: tl.constexpr, ONE_K: tl.constexpr,
    ONE_V: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr, HP: tl.constexpr,
    # the tuned config (_triton_schedule: PER_SM sizes the grid only)
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, LANE_HEADS: tl.constexpr, AHEAD: tl.constexpr,
    PER_SM: tl.constexpr,
):
    LH: tl.constexpr = 1 if LANE_HEADS else H  # heads per lane's item: all, or one
    n_items = tl.load(bounds)  # the schedule's work items
    n_blocks = tl.cdiv(n_items * LH, BLOCK_R).to(tl.int32)
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    if AHEAD:  # the first block's edge ranges; each block then loads its successor's
        lane0, valid0, it0, h0 = _lane_items(pid, n_items, LH, BLOCK_R)
        start_n = tl.load(items + it0 * 4 + 1, mask=valid0, other=0)
        length_n = tl.load(items + it0 * 4 + 2, mask=valid0, other=0)
    for blk in range(pid, n_blocks, n_prog):
        lane, valid, it, h = _lane_items(blk, n_items, LH, BLOCK_R)
        row = tl.load(items + it * 4, mask=valid, other=0).to(tl.int64)
        if AHEAD:  # the next block's, in flight while this block runs its edges
            start, length = start_n.to(tl.int64), length_n
            lane_n, valid_n, it_n, h_n = _lane_items(tl.cast(blk, tl.int64) + n_prog,
                                                     n_items, LH, BLOCK_R)
            start_n = tl.load(items + it_n * 4 + 1, mask=valid_n, other=0)
            length_n = tl.load(items + it_n * 4 + 2, mask=valid_n, other=0)
        else:
            start = tl.load(items + it * 4 + 1, mask=valid, other=0).to(tl.int64)
            length = tl.load(items + it * 4 + 2, mask=valid, other=0)
        final, piece, slot, max_len = _lane_slots(
            valid, tl.load(items + it * 4 + 3, mask=valid, other=-1).to(tl.int64), length)
        scale = tl.load(coef).to(ACC)
        slope = tl.load(coef + 1).to(ACC)
        keep_scale = tl.load(coef + 2).to(ACC)
        if LANE_HEADS:
            _fwd_heads_block(row, start, length, valid, final, piece, slot, max_len, csr_src, s_src,
                             s_dst, value, bias, out, out_b, lse, part_out, part_lse, scale, slope,
                             keep_scale, seed, p_drop, H, CK, CV, KIND, HAS_DST, HAS_BIAS, DROPOUT,
                             ACC, BLOCK_R, BLOCK_E, STAGES, BLOCK_CV, HP)
        else:
            if DROPOUT:
                rng_seed = tl.load(seed)
            h2 = h[:, None]  # [R, 1]
            dst = row[:, None]
            m_dst = valid[:, None]
            cv3 = tl.arange(0, BLOCK_CV)[None, None, :]
            m_i = tl.full([BLOCK_R], float("-inf"), ACC)
            l_i = tl.zeros([BLOCK_R], ACC)
            # the layout of the [R, E, CV] tile it sums: a 2-D slice spilled at wide C
            acc = tl.zeros([BLOCK_R, 1, BLOCK_CV], ACC)
            for off in tl.range(0, max_len, BLOCK_E, num_stages=STAGES):
                pos = off + tl.arange(0, BLOCK_E)[None, :]
                emask = pos < length[:, None]  # [R, E]
                k = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # CSR positions, int64
                src = tl.load(csr_src + k, mask=emask, other=0).to(tl.int64)
                if HAS_EDGE or HAS_VEDGE:  # per-edge inputs are in original edge order
                    eid = tl.load(csr_eid + k, mask=emask, other=0).to(tl.int64)
                else:
                    eid = k
                score, z, xs, xd, xe = _score(s_src, s_dst, s_edge, s_att, h2, H, CK, src, dst, eid,
                                              emask, m_dst, emask, scale, slope, KIND, HAS_DST,
                                              HAS_EDGE, ONE_K, ACC, BLOCK_CK)
                score = tl.where(emask, score, float("-inf"))
                p, corr, m_i, l_i = _softmax_step(score, m_i, l_i)  # p: [R, E]
                if DROPOUT:
                    keep = tl.rand(rng_seed, k * H + h2) >= p_drop
                    p = tl.where(keep, p * keep_scale, 0.0)
                # v_j + u_ij, reusing the scorer's tiles where value or value_edge is one
                if ONE_V:
                    vrow = src
                else:
                    vrow = src * H + h2
                vmask = emask[:, :, None] & (cv3 < CV)
                if SHARE_V:
                    v = xs
                else:
                    v = tl.load(value + vrow[:, :, None] * CV + cv3, mask=vmask, other=0).to(ACC)
                if HAS_VEDGE:
                    if SHARE_VE:
                        v = v + xe
                    else:
                        v = v + tl.load(value_edge + (eid * H + h2)[:, :, None] * CV + cv3, mask=vmask,
                                        other=0).to(ACC)
                acc = acc * corr[:, None, None] + tl.sum(p[:, :, None] * v, 1, keep_dims=True)
            l_safe, row_lse = _softmax_end(m_i, l_i)
            o = tl.sum(acc, 1) / l_safe[:, None]  # [R, CV]
            cv = tl.arange(0, BLOCK_CV)[None, :]
            cm = cv < CV
            orow = row * H + h
            prow = slot * H + h
            tl.store(out + orow[:, None] * CV + cv, o, mask=final[:, None] & cm)
            tl.store(lse + orow, row_lse, mask=final)
            tl.store(part_out + prow[:, None] * CV + cv, o, mask=piece[:, None] & cm)
            if HAS_BIAS:  # the layer's output bias [H * CV]: out_b = out + bias, and out (the
                # backward's Delta reads it) keeps the attention alone, whatever the precision
                o += tl.load(bias + h[:, None] * CV + cv, mask=valid[:, None] & cm, other=0).to(ACC)
                tl.store(out_b + orow[:, None] * CV + cv, o, mask=final[:, None] & cm)
            tl.store(part_lse + prow, row_lse, mask=piece)


@triton.jit(do_not_specialize=_PER_CALL)
def _alpha_kernel(
    csr_src, csr_dst, csr_eid, E, s_src, s_dst, s_edge, s_att, coef, lse, alpha,
    H: tl.constexpr, CK: tl.constexpr,
    KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr, ONE_K: tl.constexpr,
    ACC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CK: tl.constexpr,
):
    """``alpha[eid, h] = exp(e_ij - lse_i)``, one lane per (CSR position, head)."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]  # [K, 1]
    k = lane // H
    h = lane % H
    m = k < E
    src = tl.load(csr_src + k, mask=m, other=0).to(tl.int64)
    dst = tl.load(csr_dst + k, mask=m, other=0).to(tl.int64)
    eid = tl.load(csr_eid + k, mask=m, other=0).to(tl.int64)
    scale = tl.load(coef).to(ACC)
    slope = tl.load(coef + 1).to(ACC)
    score, z, xs, xd, xe = _score(s_src, s_dst, s_edge, s_att, h, H, CK, src, dst, eid, m, m, m,
                                  scale, slope, KIND, HAS_DST, HAS_EDGE, ONE_K, ACC, BLOCK_CK)
    row_lse = tl.load(lse + dst * H + h, mask=m, other=0)
    tl.store(alpha + eid * H + h, tl.exp(score - row_lse), mask=m)


@triton.jit(do_not_specialize=_PER_CALL)
def _keep_kernel(csr_eid, E, keep, seed, p_drop, H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dropout mask the fused kernels apply, as ``[E, H]`` in original order
    (the random stream is indexed by ``CSR position * H + head``)."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    k = lane // H
    m = k < E
    eid = tl.load(csr_eid + k, mask=m, other=0).to(tl.int64)
    kept = tl.rand(tl.load(seed), lane) >= p_drop
    tl.store(keep + eid * H + lane % H, kept.to(tl.int8), mask=m)


# C stays a runtime integer: as a constant, ptxas spilled the summing merge at 40 channels.
@triton.jit(do_not_specialize=("C",))
def _merge_kernel(bounds, split_row, split_first, split_count, part, part_lse, out, lse, bias,
                  out_b, H: tl.constexpr, C, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One lane per (split row, head) combines the row's partials in slot order (no atomics):
    ``SOFTMAX`` weighs the forward's ``(out_p, lse_p)`` by ``exp(lse_p - lse)``; else sums."""
    n = tl.load(bounds + 1)  # split rows (_Schedule.bounds: items, split rows)
    c = tl.arange(0, BLOCK_C)[None, :]
    cm = c < C
    for blk in range(tl.program_id(0), tl.cdiv(n * H, BLOCK_R).to(tl.int32), tl.num_programs(0)):
        lane = (tl.zeros([BLOCK_R], tl.int64) + blk) * BLOCK_R + tl.arange(0, BLOCK_R)
        s = lane // H
        h = lane % H
        valid = s < n
        row = tl.load(split_row + s, mask=valid, other=0).to(tl.int64)
        first = tl.load(split_first + s, mask=valid, other=0).to(tl.int64)
        count = tl.load(split_count + s, mask=valid, other=0)
        m = tl.full([BLOCK_R], float("-inf"), ACC)
        l_sum = tl.zeros([BLOCK_R], ACC)
        acc = tl.zeros([BLOCK_R, BLOCK_C], ACC)
        for j in range(0, tl.max(count, 0)):
            pm = valid & (j < count)
            prow = (first + j) * H + h
            po = tl.load(part + prow[:, None] * C + c, mask=pm[:, None] & cm, other=0).to(ACC)
            if SOFTMAX:
                pl = tl.load(part_lse + prow, mask=pm, other=float("-inf")).to(ACC)
                w, corr, m, l_sum = _softmax_step(pl[:, None], m, l_sum)  # w: [R, 1]
                acc = acc * corr[:, None] + w * po
            else:
                acc += po
        orow = row * H + h
        if SOFTMAX:
            l_safe, row_lse = _softmax_end(m, l_sum)
            acc = acc / l_safe[:, None]
            tl.store(lse + orow, row_lse, mask=valid)
        tl.store(out + orow[:, None] * C + c, acc, mask=valid[:, None] & cm)
        if HAS_BIAS:
            acc += tl.load(bias + h[:, None] * C + c, mask=valid[:, None] & cm, other=0).to(ACC)
            tl.store(out_b + orow[:, None] * C + c, acc, mask=valid[:, None] & cm)


@triton.jit
def _bwd_dst_heads_block(
    row, start, length, valid, final, piece, slot, max_len, csr_src, csr_eid, s_src, s_dst, value,
    grad_out, out, lse, delta_alpha, grad_alpha, a_buf, ds_buf, d_dst, part_dst, scale, slope,
    keep_scale, seed, p_drop,
    H, CV, KIND: tl.constexpr, HAS_DST: tl.constexpr, DROPOUT: tl.constexpr, GALPHA: tl.constexpr,
    NEED_DST: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_CV: tl.constexpr, HP: tl.constexpr,
):
    """:func:`_bwd_dst_kernel` with every head of an item in one lane, for the calls of
    :func:`_fwd_heads_block` that need no parameter's partials (the output bias's)."""
    hh = tl.arange(0, HP)
    hm = hh < H
    h3 = hh[None, None, :]  # [1, 1, HP]
    c = tl.arange(0, BLOCK_CV)
    cm = c < CV
    c3 = c[None, None, :]
    if DROPOUT:
        rng_seed = tl.load(seed)
    vh = valid[:, None] & hm[None, :]  # [R, HP]
    hrow = row[:, None] * H + hh[None, :]  # [R, HP]
    omask = vh[:, :, None] & cm[None, None, :]
    ooff = hrow[:, :, None] * CV + c3
    # Delta_i = <g_i, out_i> (+ sum_j alpha_ij dL/dalpha_ij), per head: [R, HP]
    row_delta = tl.sum(tl.load(grad_out + ooff, mask=omask, other=0).to(ACC)
                       * tl.load(out + ooff, mask=omask, other=0).to(ACC), 2)
    if GALPHA:
        row_delta += tl.load(delta_alpha + hrow, mask=vh, other=0).to(ACC)
    row_lse = tl.load(lse + hrow, mask=vh, other=0).to(ACC)
    row_lse = tl.where(row_lse == float("-inf"), 0.0, row_lse)  # rows without in-edges
    if KIND == 0:
        d_acc = tl.zeros([BLOCK_R, HP], ACC)
    else:
        d_acc = tl.zeros([BLOCK_R, HP, BLOCK_CV], ACC)
    for off in tl.range(0, max_len, BLOCK_E, num_stages=STAGES):
        pos = off + tl.arange(0, BLOCK_E)[None, :]
        emask = pos < length[:, None]  # [R, E]
        k = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # int64
        src = tl.load(csr_src + k, mask=emask, other=0).to(tl.int64)
        v = tl.load(value + src[:, :, None] * CV + c3,
                    mask=emask[:, :, None] & cm[None, None, :], other=0).to(ACC)
        em3 = emask[:, :, None] & hm[None, None, :]  # [R, E, HP]
        # per head, from the one gather: <g_i, v_j> and the dot kind's q_i . k_j
        dp = tl.zeros([BLOCK_R, BLOCK_E, HP], ACC)
        score = tl.zeros([BLOCK_R, BLOCK_E, HP], ACC)
        for j in tl.static_range(HP):
            jm = (valid & (row * 0 + j < H))[:, None, None]  # [R, 1, 1]
            jm3 = jm & cm[None, None, :]
            joff = (row * H + j)[:, None, None] * CV + c3
            gj = tl.load(grad_out + joff, mask=jm3, other=0).to(ACC)
            dp = tl.where(h3 == j, tl.sum(v * gj, 2)[:, :, None], dp)
            if KIND == 2:
                qj = tl.load(s_dst + joff, mask=jm3, other=0).to(ACC)
                score = tl.where(h3 == j, tl.sum(v * qj, 2)[:, :, None], score)
        if KIND == 0:  # GAT from node terms, every head: [R, E, HP]
            score, z, zs, zd, ze = _score(s_src, s_dst, s_src, s_src, h3, H, 1, src[:, :, None],
                                       row[:, None, None], src[:, :, None], em3,
                                       vh[:, None, :], em3, scale, slope, 0, HAS_DST, False,
                                       False, ACC, 1)
        else:
            score = score * scale
        p = tl.where(em3, tl.exp(score - row_lse[:, None, :]), 0.0)  # softmax, [R, E, HP]
        if DROPOUT:  # the forward's stream: (CSR position * H + head)
            keep = tl.rand(rng_seed, k[:, :, None] * H + h3) >= p_drop
            drop = tl.where(keep, keep_scale, 0.0)
            a = p * drop
            dp = dp * drop
        else:
            a = p
        if GALPHA:
            eid = tl.load(csr_eid + k, mask=emask, other=0).to(tl.int64)
            dp = dp + tl.load(grad_alpha + eid[:, :, None] * H + h3, mask=em3,
                              other=0).to(ACC)
        ds = p * (dp - row_delta[:, None, :])  # softmax backward
        eoff = k[:, :, None] * H + h3
        tl.store(a_buf + eoff, a, mask=em3)
        if KIND == 0:
            dz = ds * tl.where(z > 0, 1.0, slope)
            tl.store(ds_buf + eoff, dz, mask=em3)
            d_acc += tl.sum(dz, 1)
        else:
            tl.store(ds_buf + eoff, ds, mask=em3)
            for j in tl.static_range(HP):  # dq_i = sum_j ds_ij k_j, scaled below
                dsj = tl.sum(tl.where(h3 == j, ds, 0.0), 2)  # [R, E]
                d_acc += tl.where(hh[None, :, None] == j,
                                  tl.sum(dsj[:, :, None] * v, 1)[:, None, :], 0.0)
    if NEED_DST:
        prow = slot[:, None] * H + hh[None, :]
        fm = final[:, None] & hm[None, :]
        pm = piece[:, None] & hm[None, :]
        if KIND == 0:
            tl.store(d_dst + hrow, d_acc, mask=fm)
            tl.store(part_dst + prow, d_acc, mask=pm)
        else:
            d_acc = d_acc * scale
            cm3 = cm[None, None, :]
            tl.store(d_dst + hrow[:, :, None] * CV + c3, d_acc, mask=fm[:, :, None] & cm3)
            tl.store(part_dst + prow[:, :, None] * CV + c3, d_acc, mask=pm[:, :, None] & cm3)


@triton.jit(do_not_specialize=_PER_CALL)
def _bwd_dst_kernel(
    items, bounds, csr_src, csr_eid, ptr, s_src, s_dst, s_edge, s_att, value, value_edge, coef,
    grad_out, out, lse, delta_alpha, grad_alpha, a_buf, ds_buf, d_vedge, d_edge, d_dst, part_dst,
    seed, p_drop, part_att, part_bias, P_ROWS, DEG,
    H: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr,
    KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr, HAS_VEDGE: tl.constexpr,
    SHARE_V: tl.constexpr, SHARE_VE: tl.constexpr, ONE_K: tl.constexpr, ONE_V: tl.constexpr,
    DROPOUT: tl.constexpr, GALPHA: tl.constexpr,
    NEED_VEDGE: tl.constexpr, NEED_EDGE: tl.constexpr, NEED_DST: tl.constexpr,
    NEED_ATT: tl.constexpr, NEED_BIAS: tl.constexpr, SLOTS: tl.constexpr, ACC: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr, HP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, LANE_HEADS: tl.constexpr, AHEAD: tl.constexpr,
    PER_SM: tl.constexpr,
):
    LH: tl.constexpr = 1 if LANE_HEADS else H  # heads per lane's item: all, or one
    n_items = tl.load(bounds)  # the schedule's work items
    n_blocks = tl.cdiv(n_items * LH, BLOCK_R).to(tl.int32)
    # GATv2's att and the output bias's gradients over this program's blocks (a lane keeps
    # one head: the grid is a multiple of H)
    att_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
    bias_acc = tl.zeros([BLOCK_R, BLOCK_CV], ACC)
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    if AHEAD:  # as in _fwd_kernel: each block loads its successor's edge ranges
        lane0, valid0, it0, h0 = _lane_items(pid, n_items, LH, BLOCK_R)
        start_n = tl.load(items + it0 * 4 + 1, mask=valid0, other=0)
        length_n = tl.load(items + it0 * 4 + 2, mask=valid0, other=0)
    for blk in range(pid, n_blocks, n_prog):
        lane, valid, it, h = _lane_items(blk, n_items, LH, BLOCK_R)
        row = tl.load(items + it * 4, mask=valid, other=0).to(tl.int64)
        if AHEAD:
            start, length = start_n.to(tl.int64), length_n
            lane_n, valid_n, it_n, h_n = _lane_items(tl.cast(blk, tl.int64) + n_prog,
                                                     n_items, LH, BLOCK_R)
            start_n = tl.load(items + it_n * 4 + 1, mask=valid_n, other=0)
            length_n = tl.load(items + it_n * 4 + 2, mask=valid_n, other=0)
        else:
            start = tl.load(items + it * 4 + 1, mask=valid, other=0).to(tl.int64)
            length = tl.load(items + it * 4 + 2, mask=valid, other=0)
        final, piece, slot, max_len = _lane_slots(
            valid, tl.load(items + it * 4 + 3, mask=valid, other=-1).to(tl.int64), length)
        scale = tl.load(coef).to(ACC)
        slope = tl.load(coef + 1).to(ACC)
        keep_scale = tl.load(coef + 2).to(ACC)
        if LANE_HEADS:
            _bwd_dst_heads_block(row, start, length, valid, final, piece, slot, max_len, csr_src,
                                 csr_eid, s_src, s_dst, value, grad_out, out, lse, delta_alpha,
                                 grad_alpha, a_buf, ds_buf, d_dst, part_dst, scale, slope,
                                 keep_scale, seed, p_drop, H, CV, KIND, HAS_DST, DROPOUT, GALPHA,
                                 NEED_DST, ACC, BLOCK_R, BLOCK_E, STAGES, BLOCK_CV, HP)
        else:
            h2 = h[:, None]
            dst = row[:, None]
            m_dst = valid[:, None]
            orow = row * H + h  # [R]
            cv = tl.arange(0, BLOCK_CV)
            cvm = cv < CV
            cv3 = cv[None, None, :]
            ck = tl.arange(0, BLOCK_CK)
            ckm = ck < CK
            ck3 = ck[None, None, :]
            ooff = orow[:, None] * CV + cv[None, :]
            omask = valid[:, None] & cvm[None, :]
            g2 = tl.load(grad_out + ooff, mask=omask, other=0).to(ACC)  # [R, CV]
            g = g2[:, None, :]  # [R, 1, CV]
            row_lse = tl.load(lse + orow, mask=valid, other=0).to(ACC)
            row_lse = tl.where(row_lse == float("-inf"), 0.0, row_lse)  # rows without in-edges
            if DROPOUT:
                rng_seed = tl.load(seed)
            # Delta_i = <g_i, out_i> (+ sum_j alpha_ij dL/dalpha_ij), no [N, H, C] temporary
            row_delta = tl.sum(g2 * tl.load(out + ooff, mask=omask, other=0).to(ACC), 1)
            if NEED_BIAS:  # each row's gradient once: on a split row's first piece
                row_ptr = tl.load(ptr + row, mask=piece, other=-1).to(tl.int64)
                bias_acc += tl.where((final | (piece & (start == row_ptr)))[:, None], g2, 0.0)
            if GALPHA:
                row_delta += tl.load(delta_alpha + orow, mask=valid, other=0).to(ACC)
            # SLOTS: the dot kind's query gradient per edge slot, summed after the loop
            # (docs/design.md, "Per-slot sums in the backward")
            if KIND == 0 or KIND == 3:  # GAT: the destination term's gradient, a scalar
                d_acc = tl.zeros([BLOCK_R], ACC)
            elif KIND == 2 and SLOTS:
                d_acc = tl.zeros([BLOCK_R, BLOCK_E, BLOCK_CK], ACC)
            else:
                d_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
            if KIND == 1:  # only GATv2 has att (other kinds pass a placeholder pointer, maybe empty)
                att = tl.load(s_att + h[:, None, None] * CK + ck3, mask=valid[:, None, None] & (ck3 < CK),
                              other=0).to(ACC)  # [R, 1, CK]
            for off in tl.range(0, max_len, BLOCK_E, num_stages=STAGES):
                pos = off + tl.arange(0, BLOCK_E)[None, :]
                emask = pos < length[:, None]
                k = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # int64, as every offset
                src = tl.load(csr_src + k, mask=emask, other=0).to(tl.int64)
                if HAS_EDGE or HAS_VEDGE or GALPHA:
                    eid = tl.load(csr_eid + k, mask=emask, other=0).to(tl.int64)
                else:
                    eid = k
                score, z, xs, xd, xe = _score(s_src, s_dst, s_edge, s_att, h2, H, CK, src, dst, eid,
                                              emask, m_dst, emask, scale, slope, KIND, HAS_DST,
                                              HAS_EDGE, ONE_K, ACC, BLOCK_CK)
                p = tl.where(emask, tl.exp(score - row_lse[:, None]), 0.0)  # softmax, [R, E]
                vmask = emask[:, :, None] & (cv3 < CV)
                if SHARE_V:
                    v = xs
                elif ONE_V:  # (as in the forward)
                    v = tl.load(value + src[:, :, None] * CV + cv3, mask=vmask, other=0).to(ACC)
                else:
                    v = tl.load(value + (src * H + h2)[:, :, None] * CV + cv3, mask=vmask,
                                other=0).to(ACC)
                if HAS_VEDGE:
                    if SHARE_VE:
                        v = v + xe
                    else:
                        v = v + tl.load(value_edge + (eid * H + h2)[:, :, None] * CV + cv3, mask=vmask,
                                        other=0).to(ACC)
                dp = tl.sum(g * v, 2)  # <g_i, v_j + u_ij>
                if DROPOUT:
                    keep = tl.rand(rng_seed, k * H + h2) >= p_drop
                    drop = tl.where(keep, keep_scale, 0.0)
                    a = p * drop
                    dp = dp * drop
                else:
                    a = p
                if GALPHA:
                    dp = dp + tl.load(grad_alpha + eid * H + h2, mask=emask, other=0).to(ACC)
                ds = p * (dp - row_delta[:, None])  # softmax backward, [R, E]
                eoff = k * H + h2
                tl.store(a_buf + eoff, a, mask=emask)
                if NEED_VEDGE:
                    tl.store(d_vedge + (eid * H + h2)[:, :, None] * CV + cv3, a[:, :, None] * g, mask=vmask)
                if KIND == 0 or KIND == 3:
                    dz = ds * tl.where(z > 0, 1.0, slope)
                    tl.store(ds_buf + eoff, dz, mask=emask)
                    d_acc += tl.sum(dz, 1)
                    if NEED_EDGE:
                        tl.store(d_edge + eid * H + h2, dz, mask=emask)
                elif KIND == 1:
                    tl.store(ds_buf + eoff, ds, mask=emask)
                    dz = ds[:, :, None] * att * tl.where(z > 0, 1.0, slope)  # [R, E, CK]
                    d_acc += tl.sum(dz, 1)
                    if NEED_ATT:
                        att_acc += tl.sum(ds[:, :, None] * tl.where(z > 0, z, z * slope), 1)
                    if NEED_EDGE:
                        tl.store(d_edge + (eid * H + h2)[:, :, None] * CK + ck3, dz,
                                 mask=emask[:, :, None] & (ck3 < CK))
                else:
                    tl.store(ds_buf + eoff, ds, mask=emask)
                    if SLOTS:
                        d_acc += ds[:, :, None] * z  # dq_i, scaled below
                    else:
                        d_acc += tl.sum(ds[:, :, None] * z, 1)
                    if NEED_EDGE:
                        tl.store(d_edge + (eid * H + h2)[:, :, None] * CK + ck3, ds[:, :, None] * xd * scale,
                                 mask=emask[:, :, None] & (ck3 < CK))
            if KIND == 2 and SLOTS:
                d_acc = tl.sum(d_acc, 1)  # over the edge slots
            prow = slot * H + h
            if NEED_DST:
                if KIND == 0 or KIND == 3:  # (KIND 3: the per-node scalar, for the source kernel)
                    tl.store(d_dst + orow, d_acc, mask=final)
                    tl.store(part_dst + prow, d_acc, mask=piece)
                else:
                    if KIND == 2:
                        d_acc = d_acc * scale
                    km = ckm[None, :]
                    tl.store(d_dst + orow[:, None] * CK + ck[None, :], d_acc, mask=final[:, None] & km)
                    tl.store(part_dst + prow[:, None] * CK + ck[None, :], d_acc, mask=piece[:, None] & km)
    if NEED_ATT:  # one partial per lane of each program, summed by the caller
        _store_partials(part_att, att_acc, CK, P_ROWS, BLOCK_R, BLOCK_CK, ACC)
    if NEED_BIAS:  # (as att's)
        _store_partials(part_bias, bias_acc, CV, P_ROWS, BLOCK_R, BLOCK_CV, ACC)


@triton.jit(do_not_specialize=_PER_CALL)
def _bwd_src_kernel(
    items, bounds, csc_edge, csc_dst, csc_eid, csr_src, s_src, s_dst, s_edge, s_att, coef,
    grad_out, a_buf, ds_buf, d_value, part_value, d_src, part_src, d_dst, part_att, part_att_d,
    P_ROWS, DEG, H: tl.constexpr, CK: tl.constexpr, CV: tl.constexpr,
    KIND: tl.constexpr, HAS_EDGE: tl.constexpr, NEED_VALUE: tl.constexpr, NEED_SRC: tl.constexpr,
    SUM_SRC: tl.constexpr, NEED_ATT: tl.constexpr, SLOTS: tl.constexpr, ACC: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, AHEAD: tl.constexpr, PER_SM: tl.constexpr,
):
    n_items = tl.load(bounds)  # the schedule's work items
    n_blocks = tl.cdiv(n_items * H, BLOCK_R).to(tl.int32)
    # KIND 3's att gradients (a_src, a_dst) over this program's blocks, as the dst kernel's
    att_s_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
    att_d_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    if AHEAD:  # as in _fwd_kernel: each block loads its successor's edge ranges
        lane0, valid0, it0, h0 = _lane_items(pid, n_items, H, BLOCK_R)
        start_n = tl.load(items + it0 * 4 + 1, mask=valid0, other=0)
        length_n = tl.load(items + it0 * 4 + 2, mask=valid0, other=0)
    for blk in range(pid, n_blocks, n_prog):
        lane, valid, it, h = _lane_items(blk, n_items, H, BLOCK_R)
        row = tl.load(items + it * 4, mask=valid, other=0).to(tl.int64)
        if AHEAD:
            start, length = start_n.to(tl.int64), length_n
            lane_n, valid_n, it_n, h_n = _lane_items(tl.cast(blk, tl.int64) + n_prog,
                                                     n_items, H, BLOCK_R)
            start_n = tl.load(items + it_n * 4 + 1, mask=valid_n, other=0)
            length_n = tl.load(items + it_n * 4 + 2, mask=valid_n, other=0)
        else:
            start = tl.load(items + it * 4 + 1, mask=valid, other=0).to(tl.int64)
            length = tl.load(items + it * 4 + 2, mask=valid, other=0)
        final, piece, slot, max_len = _lane_slots(
            valid, tl.load(items + it * 4 + 3, mask=valid, other=-1).to(tl.int64), length)
        scale = tl.load(coef).to(ACC)
        slope = tl.load(coef + 1).to(ACC)
        h2 = h[:, None]
        orow = row * H + h  # this lane's source node and head
        cv = tl.arange(0, BLOCK_CV)
        cvm = cv < CV
        cv3 = cv[None, None, :]
        ck = tl.arange(0, BLOCK_CK)
        ckm = ck < CK
        ck3 = ck[None, None, :]
        # SLOTS: partials per edge slot, summed after the loop (GAT's scalar always: an [R] sum
        # per step failed Triton's compiler at C <= 4); SUM_SRC sums both gradients in dv_acc
        if SLOTS:
            dv_acc = tl.zeros([BLOCK_R, BLOCK_E, BLOCK_CV], ACC)
        else:
            dv_acc = tl.zeros([BLOCK_R, BLOCK_CV], ACC)
        if KIND == 0 or KIND == 3:  # GAT: the source term's gradient, a scalar
            ds_acc = tl.zeros([BLOCK_R, BLOCK_E], ACC)
        elif SLOTS:
            ds_acc = tl.zeros([BLOCK_R, BLOCK_E, BLOCK_CK], ACC)
        else:
            ds_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
        if KIND == 1:
            rmask = valid[:, None, None] & (ck3 < CK)
            att = tl.load(s_att + h[:, None, None] * CK + ck3, mask=rmask, other=0).to(ACC)  # [R, 1, CK]
            xs = tl.load(s_src + orow[:, None, None] * CK + ck3, mask=rmask, other=0).to(ACC)
        for off in tl.range(0, max_len, BLOCK_E, num_stages=STAGES):
            pos = off + tl.arange(0, BLOCK_E)[None, :]
            emask = pos < length[:, None]
            t = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # CSC positions, int64
            k = tl.load(csc_edge + t, mask=emask, other=0).to(tl.int64)  # CSR positions
            i = tl.load(csc_dst + t, mask=emask, other=0).to(tl.int64)  # destinations
            if NEED_VALUE:
                a = tl.load(a_buf + k * H + h2, mask=emask, other=0)
                gi = tl.load(grad_out + (i * H + h2)[:, :, None] * CV + cv3,
                             mask=emask[:, :, None] & (cv3 < CV), other=0).to(ACC)
                if SLOTS:
                    dv_acc += a[:, :, None] * gi
                else:
                    dv_acc += tl.sum(a[:, :, None] * gi, 1)
            if NEED_SRC:
                ds = tl.load(ds_buf + k * H + h2, mask=emask, other=0)
                if KIND == 0 or KIND == 3:
                    ds_acc += ds
                else:
                    cmask = emask[:, :, None] & (ck3 < CK)
                    xd = tl.load(s_dst + (i * H + h2)[:, :, None] * CK + ck3, mask=cmask,
                                 other=0).to(ACC)
                    if KIND == 1:
                        z = xs + xd
                        if HAS_EDGE:
                            eid = tl.load(csc_eid + t, mask=emask, other=0).to(tl.int64)
                            z = z + tl.load(s_edge + (eid * H + h2)[:, :, None] * CK + ck3, mask=cmask,
                                            other=0).to(ACC)
                        dz = ds[:, :, None] * att * tl.where(z > 0, 1.0, slope)
                        if SLOTS and SUM_SRC:  # (KIND 1 here)
                            dv_acc += dz
                        elif SLOTS:
                            ds_acc += dz
                        else:
                            ds_acc += tl.sum(dz, 1)
                    elif SLOTS and SUM_SRC:  # (KIND 2 here)
                        dv_acc += ds[:, :, None] * xd * scale
                    elif SLOTS:
                        ds_acc += ds[:, :, None] * xd  # dk_j, scaled below
                    else:
                        ds_acc += tl.sum(ds[:, :, None] * xd, 1)  # dk_j, scaled below
        if SLOTS:  # over the edge slots
            dv_acc = tl.sum(dv_acc, 1)
        if SLOTS or KIND == 0 or KIND == 3:
            ds_acc = tl.sum(ds_acc, 1)
        prow = slot * H + h
        if KIND == 3:
            # GAT from h: the source term's gradient ds_acc and, once per node, the destination
            # term's dt, times the attention vectors into h's gradient, times h_j into theirs
            km = valid[:, None] & ckm[None, :]
            a_s = tl.load(s_att + h[:, None] * CK + ck[None, :], mask=km, other=0).to(ACC)
            a_d = tl.load(s_att + (H + h)[:, None] * CK + ck[None, :], mask=km, other=0).to(ACC)
            prev = tl.load(csc_edge + tl.maximum(start - 1, 0), mask=piece, other=0).to(tl.int64)
            prev_src = tl.load(csr_src + prev, mask=piece & (start > 0), other=-1).to(tl.int64)
            once = final | (piece & (prev_src != row))
            dt = tl.load(d_dst + orow, mask=once, other=0).to(ACC)
            if SUM_SRC:
                dv_acc += ds_acc[:, None] * a_s + dt[:, None] * a_d
            if NEED_ATT:
                hj = tl.load(s_src + orow[:, None] * CK + ck[None, :], mask=km, other=0).to(ACC)
                att_s_acc += ds_acc[:, None] * hj
                att_d_acc += dt[:, None] * hj
        elif SUM_SRC and not SLOTS:  # value is the scorer's x_src: one gradient, two parts
            if KIND == 2:
                dv_acc += ds_acc * scale
            else:
                dv_acc += ds_acc
        if NEED_VALUE:
            vm = cvm[None, :]
            tl.store(d_value + orow[:, None] * CV + cv[None, :], dv_acc, mask=final[:, None] & vm)
            tl.store(part_value + prow[:, None] * CV + cv[None, :], dv_acc, mask=piece[:, None] & vm)
        if NEED_SRC and not SUM_SRC and KIND != 3:
            if KIND == 0:
                tl.store(d_src + orow, ds_acc, mask=final)
                tl.store(part_src + prow, ds_acc, mask=piece)
            else:
                if KIND == 2:
                    ds_acc = ds_acc * scale
                km = ckm[None, :]
                tl.store(d_src + orow[:, None] * CK + ck[None, :], ds_acc, mask=final[:, None] & km)
                tl.store(part_src + prow[:, None] * CK + ck[None, :], ds_acc, mask=piece[:, None] & km)
    if NEED_ATT:  # one partial per lane of each program and vector, summed by the caller
        _store_partials(part_att, att_s_acc, CK, P_ROWS, BLOCK_R, BLOCK_CK, ACC)
        _store_partials(part_att_d, att_d_acc, CK, P_ROWS, BLOCK_R, BLOCK_CK, ACC)
