// Row-at-a-time sparse passes of the fused CPU attention kernel.
//
// Every tensor of features is [rows, H, C] contiguous: one edge's source row
// is H*C adjacent values, read once for all heads. A source operand may have
// one head that all H heads share ([rows, 1, C]: input-space aggregation,
// gatlib/layers.py); its row is then C values, and a gradient written for it
// sums over the heads. Per-edge tensors are
// [E, H] in the CSR edge order of the graph. Rows run in parallel on ATen's
// intra-op pool; a row's result is written by the thread that owns the row,
// so nothing is atomic and results do not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

// Rows per task: enough edges that a task outweighs its scheduling.
constexpr int64_t PF = 8;  // edges ahead whose source row is prefetched

int64_t grain(int64_t rows, int64_t edges, int64_t width) {
  const int64_t per_row = rows > 0 ? std::max<int64_t>(1, edges * width / rows) : 1;
  return std::max<int64_t>(1, (int64_t(1) << 15) / per_row);
}

// at::parallel_for inlines its body twice, in its OpenMP region and (on one thread)
// in the caller, and the compiler may vectorise the two copies' reductions in another
// order: results would then depend on the thread count. Every pass runs its body
// through one out-of-line copy instead.
template <typename F>
__attribute__((noinline)) void run_rows(const F& f, int64_t begin, int64_t end) {
  f(begin, end);
}

template <typename F>
void for_rows(int64_t n, int64_t grain, const F& f) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { run_rows(f, begin, end); });
}

template <typename T>
inline void axpy(T* __restrict y, const T* __restrict x, T a, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c];
}

template <typename T>
inline T dot(const T* __restrict x, const T* __restrict y, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; ++c) s += x[c] * y[c];
  return s;
}

// GATv2's score of one edge and head: sum_c att_c * lrelu(x_c + y_c (+ w_c)).
template <typename T, bool EDGE>
inline T gatv2_edge(const T* __restrict att, const T* __restrict x, const T* __restrict y,
                    const T* __restrict w, T slope, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; ++c) {
    const T z = x[c] + y[c] + (EDGE ? w[c] : T(0));
    s += att[c] * z * (z > 0 ? T(1) : slope);
  }
  return s;
}

// Its gradient for one edge and head, with g = dL/de:
//   dz = g * att * lrelu'(z);  o += dz;  dw = dz (DW);  da += g * lrelu(z) (DA)
template <typename T, bool EDGE, bool DW, bool DA>
inline void gatv2_edge_grad(T* __restrict o, T* __restrict dw, T* __restrict da,
                            const T* __restrict att, const T* __restrict x,
                            const T* __restrict y, const T* __restrict w, T g, T slope,
                            int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    const T z = x[c] + y[c] + (EDGE ? w[c] : T(0));
    const T d = z > 0 ? T(1) : slope;
    const T dz = g * att[c] * d;
    o[c] += dz;
    if (DW) dw[c] = dz;
    if (DA) da[c] += g * z * d;
  }
}

// Asks for a whole row of n values ahead of its use. An edge walk reads
// scattered rows (and, walking the transpose, scattered [E, H] entries at the
// edges' CSR positions), which the hardware prefetcher cannot predict; each
// walk asks for what edge k + PF will read while it works on edge k.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

void check_rows(const Tensor& t, const char* name, int64_t H, int64_t C) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == H && t.size(2) == C && t.is_contiguous(), name,
              " must be a contiguous [*, ", H, ", ", C, "] tensor; got ", t.sizes());
}

// A source operand of H heads or of one head shared by all H: its heads (1 or H).
int64_t check_shared_rows(const Tensor& t, const char* name, int64_t H, int64_t C) {
  const int64_t heads = t.dim() == 3 && t.size(1) == 1 ? 1 : H;
  check_rows(t, name, heads, C);
  return heads;
}

// softmax_aggregate: for each destination row i (CSR), over its in-edges k:
//   alpha_k = exp(e_k - m_i) / sum_k' exp(e_k' - m_i),  m_i = max_k e_k   (in place of e)
//   out_i   = sum_k alpha_k * drop_k * v[col_k]
//   lse_i   = m_i + log(sum_k exp(e_k - m_i))   (when lse is non-empty)
template <typename T, typename I>
void softmax_aggregate_impl(const I* ptr, const I* col, T* e, const T* drop, const T* v, T* out,
                            T* lse, int64_t R, int64_t E, int64_t H, int64_t C, int64_t HV) {
  const int64_t HC = H * C, VC = HV * C, vh = HV == 1 ? 0 : C;
  for_rows(R, grain(R, E, HC), [&](int64_t r0, int64_t r1) {
    std::vector<T> m(H), s(H);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t k0 = ptr[r], k1 = ptr[r + 1];
      T* o = out + r * HC;
      std::fill(o, o + HC, T(0));
      for (int64_t h = 0; h < H; ++h) {
        m[h] = -std::numeric_limits<T>::infinity();
        s[h] = 0;
      }
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t h = 0; h < H; ++h) m[h] = std::max(m[h], e[k * H + h]);
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t h = 0; h < H; ++h) {
          const T x = std::exp(e[k * H + h] - m[h]);
          e[k * H + h] = x;
          s[h] += x;
        }
      if (lse != nullptr)
        for (int64_t h = 0; h < H; ++h) lse[r * H + h] = std::log(s[h]) + m[h];
      for (int64_t h = 0; h < H; ++h) s[h] = T(1) / s[h];
      for (int64_t k = k0; k < k1; ++k) {
        const T* vj = v + int64_t(col[k]) * VC;
        if (k + PF < E) prefetch_row(v + int64_t(col[k + PF]) * VC, VC);
        for (int64_t h = 0; h < H; ++h) {
          const T a = e[k * H + h] * s[h];
          e[k * H + h] = a;
          axpy(o + h * C, vj + h * vh, drop != nullptr ? a * drop[k * H + h] : a, C);
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> softmax_aggregate(const Tensor& ptr, const Tensor& col, Tensor e,
                                             const std::optional<Tensor>& drop, const Tensor& v,
                                             bool need_lse) {
  const int64_t R = ptr.numel() - 1, E = col.numel(), H = e.size(1), C = v.size(2);
  TORCH_CHECK(e.is_contiguous() && e.dim() == 2 && e.size(0) == E,
              "e must be a contiguous [E, H] tensor");
  const int64_t HV = check_shared_rows(v, "v", H, C);
  auto out = at::empty({R, H, C}, v.options());
  auto lse = need_lse ? at::empty({R, H}, v.options()) : at::empty({0}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "softmax_aggregate", [&] {
    AT_DISPATCH_INDEX_TYPES(col.scalar_type(), "softmax_aggregate", [&] {
      softmax_aggregate_impl<scalar_t, index_t>(
          ptr.data_ptr<index_t>(), col.data_ptr<index_t>(), e.data_ptr<scalar_t>(),
          drop ? drop->data_ptr<scalar_t>() : nullptr, v.data_ptr<scalar_t>(),
          out.data_ptr<scalar_t>(), need_lse ? lse.data_ptr<scalar_t>() : nullptr, R, E, H, C,
          HV);
    });
  });
  return {out, lse};
}

// spmm: out_r = sum_{k in row r} w[pos_k] * dense[col_k], per head (dense may have
// one shared head); with sum_heads, out_r has one head: the sum over the H heads.
// pos_k = pos[k] where pos is non-empty (a CSC walk of CSR-ordered weights), else k.
template <typename T, typename I>
void spmm_impl(const I* ptr, const I* col, const I* pos, const T* w, const T* dense, T* out,
               int64_t R, int64_t E, int64_t H, int64_t C, int64_t HD, int64_t HO) {
  const int64_t DC = HD * C, OC = HO * C, dh = HD == 1 ? 0 : C, oh = HO == 1 ? 0 : C;
  for_rows(R, grain(R, E, H * C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* o = out + r * OC;
      std::fill(o, o + OC, T(0));
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k) {
        const int64_t p = pos != nullptr ? int64_t(pos[k]) : k;
        const T* x = dense + int64_t(col[k]) * DC;
        if (k + PF < E) {
          prefetch_row(dense + int64_t(col[k + PF]) * DC, DC);
          if (pos != nullptr) __builtin_prefetch(w + int64_t(pos[k + PF]) * H);
        }
        for (int64_t h = 0; h < H; ++h) axpy(o + h * oh, x + h * dh, w[p * H + h], C);
      }
    }
  });
}

Tensor spmm(const Tensor& ptr, const Tensor& col, const Tensor& pos, const Tensor& w,
            const Tensor& dense, bool sum_heads) {
  const int64_t R = ptr.numel() - 1, E = col.numel(), H = w.size(1), C = dense.size(2);
  const int64_t HD = check_shared_rows(dense, "dense", H, C), HO = sum_heads ? 1 : H;
  auto out = at::empty({R, HO, C}, dense.options());
  AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "spmm", [&] {
    AT_DISPATCH_INDEX_TYPES(col.scalar_type(), "spmm", [&] {
      spmm_impl<scalar_t, index_t>(ptr.data_ptr<index_t>(), col.data_ptr<index_t>(),
                                   pos.numel() ? pos.data_ptr<index_t>() : nullptr,
                                   w.data_ptr<scalar_t>(), dense.data_ptr<scalar_t>(),
                                   out.data_ptr<scalar_t>(), R, E, H, C, HD, HO);
    });
  });
  return out;
}

// sddmm: out[pos_k] = scale * <a_r, b[col_k]> per head (b may have one shared
// head), for k in row r.
template <typename T, typename I>
void sddmm_impl(const I* ptr, const I* col, const I* pos, const T* a, const T* b, T scale, T* out,
                int64_t R, int64_t E, int64_t H, int64_t C, int64_t HB) {
  const int64_t HC = H * C, BC = HB * C, bh = HB == 1 ? 0 : C;
  for_rows(R, grain(R, E, HC), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* ar = a + r * HC;
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k) {
        const int64_t p = pos != nullptr ? int64_t(pos[k]) : k;
        const T* x = b + int64_t(col[k]) * BC;
        if (k + PF < E) {
          prefetch_row(b + int64_t(col[k + PF]) * BC, BC);
          if (pos != nullptr) __builtin_prefetch(out + int64_t(pos[k + PF]) * H, 1);
        }
        for (int64_t h = 0; h < H; ++h) out[p * H + h] = scale * dot(ar + h * C, x + h * bh, C);
      }
    }
  });
}

Tensor sddmm(const Tensor& ptr, const Tensor& col, const Tensor& pos, const Tensor& a,
             const Tensor& b, double scale) {
  const int64_t R = ptr.numel() - 1, E = col.numel(), H = a.size(1), C = a.size(2);
  check_rows(a, "a", H, C);
  const int64_t HB = check_shared_rows(b, "b", H, C);
  auto out = at::empty({E, H}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "sddmm", [&] {
    AT_DISPATCH_INDEX_TYPES(col.scalar_type(), "sddmm", [&] {
      sddmm_impl<scalar_t, index_t>(ptr.data_ptr<index_t>(), col.data_ptr<index_t>(),
                                    pos.numel() ? pos.data_ptr<index_t>() : nullptr,
                                    a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
                                    scalar_t(scale), out.data_ptr<scalar_t>(), R, E, H, C, HB);
    });
  });
  return out;
}

// sddmm_spmm: both products of the aggregation's backward in one walk of the
// transpose (rows r are sources, k their out-edges, pos_k the CSR position):
//   dot[pos_k] = <g[col_k], v_r>          per head
//   dv_r       = sum_k w[pos_k] g[col_k]  per head (summed over heads where v has one)
// so each g row is read once per edge instead of twice.
template <typename T, typename I>
void sddmm_spmm_impl(const I* ptr, const I* col, const I* pos, const T* w, const T* g, const T* v,
                     T* dot_out, T* dv, int64_t R, int64_t E, int64_t H, int64_t C, int64_t HV) {
  const int64_t HC = H * C, VC = HV * C, vh = HV == 1 ? 0 : C;
  for_rows(R, grain(R, E, 2 * HC), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* vr = v + r * VC;
      T* o = dv != nullptr ? dv + r * VC : nullptr;
      if (o != nullptr) std::fill(o, o + VC, T(0));
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k) {
        const int64_t p = pos[k];
        const T* x = g + int64_t(col[k]) * HC;
        if (k + PF < E) {
          prefetch_row(g + int64_t(col[k + PF]) * HC, HC);
          __builtin_prefetch(w + int64_t(pos[k + PF]) * H);
          __builtin_prefetch(dot_out + int64_t(pos[k + PF]) * H, 1);
        }
        for (int64_t h = 0; h < H; ++h) {
          dot_out[p * H + h] = dot(x + h * C, vr + h * vh, C);
          if (o != nullptr) axpy(o + h * vh, x + h * C, w[p * H + h], C);
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> sddmm_spmm(const Tensor& ptr, const Tensor& col, const Tensor& pos,
                                      const Tensor& w, const Tensor& g, const Tensor& v,
                                      bool need_dv) {
  const int64_t R = ptr.numel() - 1, E = col.numel(), H = g.size(1), C = g.size(2);
  check_rows(g, "g", H, C);
  const int64_t HV = check_shared_rows(v, "v", H, C);
  auto dot_out = at::empty({E, H}, g.options());
  auto dv = need_dv ? at::empty({R, HV, C}, g.options()) : at::empty({0}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "sddmm_spmm", [&] {
    AT_DISPATCH_INDEX_TYPES(col.scalar_type(), "sddmm_spmm", [&] {
      sddmm_spmm_impl<scalar_t, index_t>(ptr.data_ptr<index_t>(), col.data_ptr<index_t>(),
                                         pos.data_ptr<index_t>(), w.data_ptr<scalar_t>(),
                                         g.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                         dot_out.data_ptr<scalar_t>(),
                                         need_dv ? dv.data_ptr<scalar_t>() : nullptr, R, E, H, C,
                                         HV);
    });
  });
  return {dot_out, dv};
}

// gatv2_score: e_k = sum_c att_hc * lrelu(x[col_k] + y_r + w[wpos_k])_hc for k in row r
// (w optional: [E, H, C] in the order wpos maps CSR positions to).
template <typename T, typename I>
void gatv2_score_impl(const I* ptr, const I* col, const int64_t* wpos, const T* x, const T* y,
                      const T* w, const T* att, T slope, T* e, int64_t R, int64_t E, int64_t H,
                      int64_t C) {
  const int64_t HC = H * C;
  for_rows(R, grain(R, E, HC), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* yr = y + r * HC;
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k) {
        const T* xj = x + int64_t(col[k]) * HC;
        const T* wk = w != nullptr ? w + wpos[k] * HC : nullptr;
        if (k + PF < E) {
          prefetch_row(x + int64_t(col[k + PF]) * HC, HC);
          if (w != nullptr) prefetch_row(w + wpos[k + PF] * HC, HC);
        }
        for (int64_t h = 0; h < H; ++h)
          e[k * H + h] = wk != nullptr
              ? gatv2_edge<T, true>(att + h * C, xj + h * C, yr + h * C, wk + h * C, slope, C)
              : gatv2_edge<T, false>(att + h * C, xj + h * C, yr + h * C, nullptr, slope, C);
      }
    }
  });
}

Tensor gatv2_score(const Tensor& ptr, const Tensor& col, const Tensor& wpos, const Tensor& x,
                   const Tensor& y, const std::optional<Tensor>& w, const Tensor& att,
                   double slope) {
  const int64_t R = ptr.numel() - 1, E = col.numel(), H = x.size(1), C = x.size(2);
  check_rows(x, "x", H, C);
  check_rows(y, "y", H, C);
  if (w) check_rows(*w, "w", H, C);
  TORCH_CHECK(att.is_contiguous() && att.numel() == H * C, "att must be a contiguous [H, C] tensor");
  auto e = at::empty({E, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gatv2_score", [&] {
    AT_DISPATCH_INDEX_TYPES(col.scalar_type(), "gatv2_score", [&] {
      gatv2_score_impl<scalar_t, index_t>(
          ptr.data_ptr<index_t>(), col.data_ptr<index_t>(),
          w ? wpos.data_ptr<int64_t>() : nullptr, x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
          w ? w->data_ptr<scalar_t>() : nullptr, att.data_ptr<scalar_t>(), scalar_t(slope),
          e.data_ptr<scalar_t>(), R, E, H, C);
    });
  });
  return e;
}

// gatv2_grad: one walk of the rows r of a CSR or a CSC, k their edges, p_k the
// edge's CSR position (pos, or k itself), n_k the node at the other end (col):
//   z      = x_src + y_dst + w[wpos[p_k]]            recomputed
//   dz     = de[p_k] * att * lrelu'(z)               per head
//   out_r += dz                                      (dy in the CSR walk, dx in the CSC walk)
//   dw[wpos[p_k]] = dz,  datt += de[p_k] * lrelu(z)  (where asked for, the CSR walk)
// `own` holds the rows of the walk (y for the CSR walk, x for the CSC walk),
// `other` the gathered ones.
template <typename T, typename I>
void gatv2_grad_impl(const I* ptr, const I* col, const I* pos, const int64_t* wpos,
                     const T* own, const T* other, const T* w, const T* att, const T* de,
                     T slope, T* out, T* dw, T* datt, int64_t R, int64_t E, int64_t H,
                     int64_t C) {
  const int64_t HC = H * C;
  // Chunks of about equal edge counts, each with its own datt partial, summed in
  // chunk order. Their number follows from the graph alone, so the result does
  // not depend on the thread count or on which thread ran which chunk.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>({R, int64_t(64), E / 2048}));
  std::vector<int64_t> bounds(chunks + 1);
  for (int64_t c = 0; c <= chunks; ++c)
    bounds[c] = std::lower_bound(ptr, ptr + R, I(E * c / chunks)) - ptr;
  bounds[chunks] = R;
  std::vector<T> datt_parts(datt != nullptr ? size_t(chunks) * HC : 0, T(0));
  for_rows(chunks, 1, [&](int64_t c0, int64_t c1) {
   for (int64_t chunk = c0; chunk < c1; ++chunk) {
    T* da = datt != nullptr ? datt_parts.data() + chunk * HC : nullptr;
    for (int64_t r = bounds[chunk]; r < bounds[chunk + 1]; ++r) {
      const T* a_r = own + r * HC;
      T* o = out + r * HC;
      std::fill(o, o + HC, T(0));
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k) {
        const int64_t p = pos != nullptr ? int64_t(pos[k]) : k;
        const T* b = other + int64_t(col[k]) * HC;
        const T* wk = w != nullptr ? w + wpos[p] * HC : nullptr;
        T* dwk = dw != nullptr ? dw + wpos[p] * HC : nullptr;
        if (k + PF < E) {
          prefetch_row(other + int64_t(col[k + PF]) * HC, HC);
          const int64_t q = pos != nullptr ? int64_t(pos[k + PF]) : k + PF;
          if (pos != nullptr) __builtin_prefetch(de + q * H);
          if (w != nullptr) prefetch_row(w + wpos[q] * HC, HC);
          if (dw != nullptr) prefetch_row(dw + wpos[q] * HC, HC);
        }
        for (int64_t h = 0; h < H; ++h) {
          const int64_t o_h = h * C;
          const T g = de[p * H + h];
          T* dwh = dwk != nullptr ? dwk + o_h : nullptr;
          T* dah = da != nullptr ? da + o_h : nullptr;
          const T* wh = wk != nullptr ? wk + o_h : nullptr;
          const T *ah = att + o_h, *xh = a_r + o_h, *yh = b + o_h;
          T* oh = o + o_h;
          // one loop per combination, so that none tests a pointer per channel
          if (wh == nullptr && dah == nullptr)
            gatv2_edge_grad<T, false, false, false>(oh, dwh, dah, ah, xh, yh, wh, g, slope, C);
          else if (wh == nullptr)
            gatv2_edge_grad<T, false, false, true>(oh, dwh, dah, ah, xh, yh, wh, g, slope, C);
          else if (dwh == nullptr && dah == nullptr)
            gatv2_edge_grad<T, true, false, false>(oh, dwh, dah, ah, xh, yh, wh, g, slope, C);
          else if (dwh == nullptr)
            gatv2_edge_grad<T, true, false, true>(oh, dwh, dah, ah, xh, yh, wh, g, slope, C);
          else if (dah == nullptr)
            gatv2_edge_grad<T, true, true, false>(oh, dwh, dah, ah, xh, yh, wh, g, slope, C);
          else
            gatv2_edge_grad<T, true, true, true>(oh, dwh, dah, ah, xh, yh, wh, g, slope, C);
        }
      }
    }
   }
  });
  if (datt != nullptr) {
    std::fill(datt, datt + HC, T(0));
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t c = 0; c < HC; ++c) datt[c] += datt_parts[chunk * HC + c];
  }
}

std::tuple<Tensor, Tensor, Tensor> gatv2_grad(const Tensor& ptr, const Tensor& col,
                                              const Tensor& pos, const Tensor& wpos,
                                              const Tensor& own, const Tensor& other,
                                              const std::optional<Tensor>& w, const Tensor& att,
                                              const Tensor& de, double slope, bool need_dw,
                                              bool need_datt) {
  const int64_t R = ptr.numel() - 1, E = col.numel(), H = own.size(1), C = own.size(2);
  check_rows(own, "own", H, C);
  check_rows(other, "other", H, C);
  if (w) check_rows(*w, "w", H, C);
  TORCH_CHECK(de.is_contiguous() && de.dim() == 2 && de.size(0) == E && de.size(1) == H,
              "de must be a contiguous [E, H] tensor");
  TORCH_CHECK(!need_dw || w, "dw needs w");
  auto out = at::empty({R, H, C}, own.options());
  auto dw = need_dw ? at::empty({E, H, C}, own.options()) : at::empty({0}, own.options());
  auto datt = need_datt ? at::empty({H, C}, own.options()) : at::empty({0}, own.options());
  AT_DISPATCH_FLOATING_TYPES(own.scalar_type(), "gatv2_grad", [&] {
    AT_DISPATCH_INDEX_TYPES(col.scalar_type(), "gatv2_grad", [&] {
      gatv2_grad_impl<scalar_t, index_t>(
          ptr.data_ptr<index_t>(), col.data_ptr<index_t>(),
          pos.numel() ? pos.data_ptr<index_t>() : nullptr,
          w ? wpos.data_ptr<int64_t>() : nullptr, own.data_ptr<scalar_t>(),
          other.data_ptr<scalar_t>(), w ? w->data_ptr<scalar_t>() : nullptr,
          att.data_ptr<scalar_t>(), de.data_ptr<scalar_t>(), scalar_t(slope),
          out.data_ptr<scalar_t>(), need_dw ? dw.data_ptr<scalar_t>() : nullptr,
          need_datt ? datt.data_ptr<scalar_t>() : nullptr, R, E, H, C);
    });
  });
  return {out, dw, datt};
}

// softmax_backward: de_k = alpha_k * (dalpha_k - sum_{k' in row} alpha_k' dalpha_k'),
// per head, in place of dalpha.
template <typename T, typename I>
void softmax_backward_impl(const I* ptr, const T* alpha, T* d, int64_t R, int64_t E, int64_t H) {
  for_rows(R, grain(R, E, H), [&](int64_t r0, int64_t r1) {
    std::vector<T> delta(H);
    for (int64_t r = r0; r < r1; ++r) {
      std::fill(delta.begin(), delta.end(), T(0));
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k)
        for (int64_t h = 0; h < H; ++h) delta[h] += alpha[k * H + h] * d[k * H + h];
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k)
        for (int64_t h = 0; h < H; ++h)
          d[k * H + h] = alpha[k * H + h] * (d[k * H + h] - delta[h]);
    }
  });
}

Tensor softmax_backward(const Tensor& ptr, const Tensor& alpha, Tensor d) {
  const int64_t R = ptr.numel() - 1, E = alpha.size(0), H = alpha.size(1);
  TORCH_CHECK(alpha.is_contiguous() && d.is_contiguous() && d.sizes() == alpha.sizes(),
              "alpha and dalpha must be contiguous [E, H] tensors");
  AT_DISPATCH_FLOATING_TYPES(alpha.scalar_type(), "softmax_backward", [&] {
    AT_DISPATCH_INDEX_TYPES(ptr.scalar_type(), "softmax_backward", [&] {
      softmax_backward_impl<scalar_t, index_t>(ptr.data_ptr<index_t>(),
                                               alpha.data_ptr<scalar_t>(),
                                               d.data_ptr<scalar_t>(), R, E, H);
    });
  });
  return d;
}

// segment_sum: out_r = sum_{k in row r} x[pos_k] (rows of [E, H]); pos empty: x[k].
template <typename T, typename I>
void segment_sum_impl(const I* ptr, const I* pos, const T* x, T* out, int64_t R, int64_t E,
                      int64_t H) {
  for_rows(R, grain(R, E, H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* o = out + r * H;
      std::fill(o, o + H, T(0));
      for (int64_t k = ptr[r]; k < ptr[r + 1]; ++k) {
        const int64_t p = pos != nullptr ? int64_t(pos[k]) : k;
        if (pos != nullptr && k + PF < E) __builtin_prefetch(x + int64_t(pos[k + PF]) * H);
        for (int64_t h = 0; h < H; ++h) o[h] += x[p * H + h];
      }
    }
  });
}

Tensor segment_sum(const Tensor& ptr, const Tensor& pos, const Tensor& x) {
  const int64_t R = ptr.numel() - 1, E = x.size(0), H = x.size(1);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "x must be a contiguous [E, H] tensor");
  auto out = at::empty({R, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "segment_sum", [&] {
    AT_DISPATCH_INDEX_TYPES(ptr.scalar_type(), "segment_sum", [&] {
      segment_sum_impl<scalar_t, index_t>(ptr.data_ptr<index_t>(),
                                          pos.numel() ? pos.data_ptr<index_t>() : nullptr,
                                          x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), R, E,
                                          H);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(gatlib_cpu, m) {
  m.def("softmax_aggregate(Tensor ptr, Tensor col, Tensor(a!) e, Tensor? drop, Tensor v, bool need_lse) -> (Tensor, Tensor)");
  m.def("spmm(Tensor ptr, Tensor col, Tensor pos, Tensor w, Tensor dense, bool sum_heads=False) -> Tensor");
  m.def("sddmm(Tensor ptr, Tensor col, Tensor pos, Tensor a, Tensor b, float scale) -> Tensor");
  m.def("sddmm_spmm(Tensor ptr, Tensor col, Tensor pos, Tensor w, Tensor g, Tensor v, bool need_dv) -> (Tensor, Tensor)");
  m.def("gatv2_score(Tensor ptr, Tensor col, Tensor wpos, Tensor x, Tensor y, Tensor? w, Tensor att, float slope) -> Tensor");
  m.def("gatv2_grad(Tensor ptr, Tensor col, Tensor pos, Tensor wpos, Tensor own, Tensor other, Tensor? w, Tensor att, Tensor de, float slope, bool need_dw, bool need_datt) -> (Tensor, Tensor, Tensor)");
  m.def("softmax_backward(Tensor ptr, Tensor alpha, Tensor(a!) d) -> Tensor(a!)");
  m.def("segment_sum(Tensor ptr, Tensor pos, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(gatlib_cpu, CPU, m) {
  m.impl("softmax_aggregate", &softmax_aggregate);
  m.impl("spmm", &spmm);
  m.impl("sddmm", &sddmm);
  m.impl("sddmm_spmm", &sddmm_spmm);
  m.impl("gatv2_score", &gatv2_score);
  m.impl("gatv2_grad", &gatv2_grad);
  m.impl("softmax_backward", &softmax_backward);
  m.impl("segment_sum", &segment_sum);
}
