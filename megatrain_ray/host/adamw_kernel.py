"""The host AdamW step as one pass over a layer's state: a small C++ kernel built on the node.

Per parameter it reads the fp32 master weight, both fp32 moments and the gradient (bf16 or fp32,
in the compute buffer), and writes the three fp32 values and the new compute-dtype weight over
the gradient: 28 bytes with bf16, the least the update can move, so it runs at the speed of the
host's memory where torch's fused AdamW needs a gradient upcast and a weight cast around it
(three passes). The arithmetic is torch.optim.AdamW's, in fp32, op by op in its order (torch's
CPU sqrt, MKL's, may differ from IEEE's in a last bit), and bf16 is rounded to nearest even as
torch's `.to(torch.bfloat16)`.

The kernel is compiled with torch.utils.cpp_extension.load_inline, with -march=native so that it
vectorises for the CPU it runs on, on a thread of its own that a store starts as its process starts
(`start_native_kernel`): the build overlaps the run's start, and the first update waits for it only
if it is still running (`native_kernel`). One process of a node compiles it; the node's others (its
stores, its RAM-node raylets) wait for that build and load it. It is cached under
~/.cache/torch_extensions/megatrain (or $TORCH_EXTENSIONS_DIR). The build's name carries a digest
of the source, flags, torch version and the CPU's model and flags, so nodes of a cluster that
share a home directory never load a build made for another CPU. Threads are torch's
(torch.set_num_threads); they share the buffer out in tiles, as each becomes free.

The lean modes (host/precision.py: a bf16 master with stochastic rounding, bf16 or int8 moments) run
a second op over the same tiles, a block of 256 elements at a time: each element's moments widened,
updated in fp32 as above and narrowed in the loop that updates its master (int8 blocks are
quantized by a second loop over the block, once its scales are known), the master rounded at random
from its element's noise. Every loop vectorises; one pass over memory still, reading and writing 10
(6-byte mode) to 20 (10-byte mode) bytes a parameter where the exact mode moves 28.

A third op applies Muon's orthogonalized update (host/muon.py, `apply_update`: W <- W decay + alpha O)
in the same way, in one pass over the same tiles: 12 bytes a parameter with an fp32 master and bf16
update and copy, where torch's ops take four passes and an fp32 temporary of the bf16 update
(measured on the development machine, 2 shared cores, one 3,584 x 18,944 matrix: 0.155 s with torch's
ops, 0.028 s in one pass, against AdamW's 0.047 s here).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

import torch

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTile = 65536;  // elements: a buffer of one tile stays on one thread

struct Scalars {  // AdamW's Python scalars, as torch's fp32 kernels receive them
  float grad_scale, lerp_weight, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // round to nearest even, NaN stays NaN: c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (x != x) ? 0x7FC00000u : u + 0x7FFFu + ((u >> 16) & 1u);
  p[i] = uint16_t(u >> 16);
}

// sqrt(v) / sqrt(1 - beta2**step), Adam's bias-corrected root. Past a few hundred updates the
// correction is 1.0f exactly and x / 1.0f is x: the division, a costly instruction, is skipped then
// (the same bits).
template <bool kUnitBias2>
inline float unbiased(float root, const Scalars& s) {
  return kUnitBias2 ? root : root / s.bias2_sqrt;
}

// torch.optim.AdamW (single-tensor path) step by step, with the fused multiply-adds of torch's
// vectorised lerp and addcmul: p *= 1 - lr*wd; m.lerp_(g, 1 - beta1); v.mul_(beta2).addcmul_(g, g,
// value=1 - beta2); p.addcdiv_(m, sqrt(v) / sqrt(bias2) + eps, value=-step_size).
// The gradient is read before the new weight is written over it.
template <bool kUnitBias2, typename T>
void update(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v, T* __restrict__ gw,
            int64_t n, float decay, Scalars s) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = load(gw, i) * s.grad_scale;
    const float mi = std::fma(s.lerp_weight, g - m[i], m[i]);
    const float vi = std::fma(s.one_minus_beta2 * g, g, v[i] * s.beta2);
    const float pi = p[i] * decay + s.neg_step_size * mi / (unbiased<kUnitBias2>(std::sqrt(vi), s) + s.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    store(gw, i, pi);
  }
}

// Threads take tiles of 64 Ki elements (256 KiB of each fp32 stream) from a shared counter until
// none is left: a thread slowed by a neighbour (the GPU actor's copies, Ray) takes fewer tiles, where
// equal static ranges would make the whole layer wait for it (on the H100 machine, 16 threads:
// 5.6 G params/s against 5.2 static).
template <typename F>
void over_tiles(int64_t n, const F& f) {  // f(lo, hi) for each tile [lo, hi) of [0, n)
  const int64_t tiles = (n + kTile - 1) / kTile;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tiles, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tiles;) f(t * kTile, std::min(n, (t + 1) * kTile));
  });
}

template <typename T>
void step(float* p, float* m, float* v, T* gw, int64_t n, c10::ArrayRef<int64_t> ends,
          c10::ArrayRef<double> decays, Scalars s) {
  over_tiles(n, [&](int64_t lo, int64_t hi) {
    int64_t start = 0;
    for (size_t k = 0; k < ends.size(); start = ends[k++]) {  // the parameters this tile overlaps
      const int64_t a = std::max(lo, start), b = std::min(hi, ends[k]);
      if (a < b && s.bias2_sqrt == 1.0f) update<true>(p + a, m + a, v + a, gw + a, b - a, float(decays[k]), s);
      else if (a < b) update<false>(p + a, m + a, v + a, gw + a, b - a, float(decays[k]), s);
    }
  });
}

// ---- lean state (host/precision.py): bf16 master with stochastic rounding, bf16 or int8 moments ----
//
// A tile is updated a block of kBlock elements at a time, in loops the compiler vectorises: each
// element's moments widened, updated and (fp32 or bf16) narrowed again in the one loop that updates
// its master; int8 moments wait in two small fp32 arrays for a second loop that finds the block's
// scales and quantizes it. Inside a block, indices and the rounding noise's counter are 32-bit.
// (The int8 modes do three square roots and two divisions an element where fp32 does one and two:
// past the memory's speed, those bound them.)

constexpr int64_t kBlock = 256;  // precision.QUANT_BLOCK: an int8 block's elements; kTile is a multiple

inline uint32_t mix32(uint32_t x) {  // lowbias32: a bijection of 32 bits whose outputs look random
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Element i's noise is mix32(low32(i) * 0x9E3779B9 + key + high32(i) * 0x85EBCA6B)'s low 16 bits
// (precision.noise16). A block never straddles a multiple of 2**32, so its high word is folded into
// the key once and the lanes count only low words.
inline uint32_t block_key(uint32_t key, int64_t b0) { return key + uint32_t(uint64_t(b0) >> 32) * 0x85EBCA6Bu; }

// x rounded to bf16 up or down at random in proportion (precision.stochastic_round_bf16): 16 bits
// of the element's noise added under bf16's mantissa, then truncated. NaN stays NaN.
inline uint16_t round_stochastic(float x, uint32_t low, uint32_t key) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t r = mix32(low * 0x9E3779B9u + key) & 0xFFFFu;
  return (x != x) ? uint16_t(0x7FC0) : uint16_t((u + r) >> 16);
}

// Masters and moments hand out views of one block (`at`), indexed from the block's first element.

template <typename W>
struct MasterF32 {  // fp32 master; the compute copy W (bf16 or fp32) receives the new weights
  float* p;
  W* w;
  struct Block {
    float* p;
    W* w;
    float get(int k) const { return p[k]; }
    void put(int k, float x) const {
      p[k] = x;
      store(w, k, x);
    }
  };
  Block at(int64_t b0) const { return {p + b0, w + b0}; }
};

struct MasterBF16 {  // bf16 master, itself the compute copy
  uint16_t* p;
  uint32_t key;
  int64_t origin;  // p[0]'s index in its layer (a multiple of kBlock): the noise follows the layer's indices
  struct Block {
    uint16_t* p;
    uint32_t low, key;  // the block's first index's low word; the key with its high word folded in
    float get(int k) const { return load(p, k); }
    void put(int k, float x) const { p[k] = round_stochastic(x, low + uint32_t(k), key); }
  };
  Block at(int64_t b0) const { return {p + b0, uint32_t(origin + b0), block_key(key, origin + b0)}; }
};

template <typename T>
struct Plain {  // moments in fp32 or bf16 (rounded to nearest even), read and written in place
  T* m;
  T* v;
  struct Scratch {};
  struct Block {
    T* m;
    T* v;
    float m_at(int k) const { return load(m, k); }
    float v_at(int k) const { return load(v, k); }
    void put(int k, float mi, float vi, float) const {
      store(m, k, mi);
      store(v, k, vi);
    }
    void finish(int) const {}
  };
  Block at(int64_t b0, Scratch&) const { return {m + b0, v + b0}; }
};

// Round to nearest, ties to even, for 0 <= x < 2**22: adding 1.5 * 2**23 leaves no bits below the
// unit, and the hardware's rounding of that sum is the rounding wanted (no libm call, vectorises).
inline float round_even(float x) { return (x + 12582912.0f) - 12582912.0f; }

typedef float Lanes __attribute__((vector_size(64)));  // 16 floats: GCC's vectors, any SIMD width
typedef int32_t LaneBits __attribute__((vector_size(64)));

// The largest |x| and y of n values, 16 lanes at a time. `a < x ? x : a` passes NaN by, as a scalar
// loop written so would (the compiler vectorises no max reduction of floats by itself); a maximum is
// exact in any order.
inline void peaks(const float* xs, const float* ys, int n, float& a, float& c) {
  Lanes am = {}, cm = {};
  int k = 0;
  for (; k + 16 <= n; k += 16) {
    Lanes x, y;
    std::memcpy(&x, xs + k, sizeof x);
    std::memcpy(&y, ys + k, sizeof y);
    x = (Lanes)((LaneBits)x & 0x7FFFFFFF);  // |x|
    am = am < x ? x : am;
    cm = cm < y ? y : cm;
  }
  a = 0.0f;
  c = 0.0f;
  for (int j = 0; j < 16; ++j) {
    a = a < am[j] ? am[j] : a;
    c = c < cm[j] ? cm[j] : c;
  }
  for (; k < n; ++k) {
    const float x = std::fabs(xs[k]);
    a = a < x ? x : a;
    c = c < ys[k] ? ys[k] : c;
  }
}

struct Int8 {  // precision.quantize_signed / quantize_sqrt, block by block
  int8_t* m;
  uint8_t* v;
  float* m_scale;
  float* v_scale;
  struct Scratch {  // a block's new moments (the second as its square root)
    float m[kBlock], root[kBlock];
  };
  struct Block {
    // Restrict pointers: a store through an int8 pointer may alias anything, which would keep the
    // quantizing loop scalar.
    int8_t* __restrict__ qm;
    uint8_t* __restrict__ qv;
    float* m_scale;
    float* v_scale;
    Scratch* t;
    float a, c;  // the block's scales as read
    float m_at(int k) const {
      const float x = float(qm[k]) * (1.0f / 127.0f);
      return a * (x * std::fabs(x));
    }
    float v_at(int k) const {
      const float x = float(qv[k]) * (1.0f / 255.0f);
      const float s = c * (x * x);
      return s * s;
    }
    void put(int k, float mi, float, float root) const {
      t->m[k] = mi;
      t->root[k] = root;
    }
    void finish(int n) const {
      float na, nc;
      peaks(t->m, t->root, n, na, nc);
      *m_scale = na;
      *v_scale = nc;
      const float ra = 1.0f / (na > 0.0f ? na : 1.0f), rc = 1.0f / (nc > 0.0f ? nc : 1.0f);
      const float* __restrict__ mi = t->m;
      const float* __restrict__ vi = t->root;
#pragma omp simd
      for (int k = 0; k < n; ++k) {
        const float q = round_even(std::sqrt(std::fabs(mi[k]) * ra) * 127.0f);
        qm[k] = int8_t(int32_t(mi[k] < 0.0f ? -q : q));
        float r = round_even(std::sqrt(vi[k] * rc) * 255.0f);
        r = (vi[k] > 0.0f && r < 1.0f) ? 1.0f : r;  // a second moment that was not zero never becomes zero
        qv[k] = uint8_t(int32_t(r));
      }
    }
  };
  Block at(int64_t b0, Scratch& t) const {
    return {m + b0, v + b0, m_scale + b0 / kBlock, v_scale + b0 / kBlock, &t, m_scale[b0 / kBlock],
            v_scale[b0 / kBlock]};
  }
};

// The same AdamW arithmetic as `update`, over [i, e) of one block, whose parameter decays by
// `decay`. The gradient is read before the new weight is written (with an fp32 master they share
// the compute buffer).
template <bool kUnitBias2, typename P, typename M, typename G>
inline void update_range(const P& master, const M& moments, const G* g, int i, int e, float decay, Scalars s) {
#pragma omp simd
  for (int k = i; k < e; ++k) {
    const float gi = load(g, k) * s.grad_scale;
    const float m0 = moments.m_at(k), v0 = moments.v_at(k);
    const float mi = std::fma(s.lerp_weight, gi - m0, m0);
    const float vi = std::fma(s.one_minus_beta2 * gi, gi, v0 * s.beta2);
    const float root = std::sqrt(vi);
    const float pi = master.get(k) * decay + s.neg_step_size * mi / (unbiased<kUnitBias2>(root, s) + s.eps);
    moments.put(k, mi, vi, root);
    master.put(k, pi);
  }
}

template <typename Master, typename Moments, typename G>
void update_blocks(const Master& P, const Moments& M, const G* g, int64_t lo, int64_t hi,
                   c10::ArrayRef<int64_t> ends, c10::ArrayRef<double> decays, Scalars s) {
  typename Moments::Scratch scratch;
  size_t seg = 0;
  for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
    const int n = int(std::min(hi - b0, kBlock));
    const auto master = P.at(b0);
    const auto moments = M.at(b0, scratch);
    for (int i = 0; i < n;) {  // the parameters this block overlaps
      while (ends[seg] <= b0 + i) ++seg;
      const int e = int(std::min<int64_t>(n, ends[seg] - b0));
      if (s.bias2_sqrt == 1.0f) update_range<true>(master, moments, g + b0, i, e, float(decays[seg]), s);
      else update_range<false>(master, moments, g + b0, i, e, float(decays[seg]), s);
      i = e;
    }
    moments.finish(n);
  }
}

template <typename Master, typename Moments, typename G>
void step_lean(const Master& P, const Moments& M, const G* g, int64_t n, c10::ArrayRef<int64_t> ends,
               c10::ArrayRef<double> decays, Scalars s) {
  over_tiles(n, [&](int64_t lo, int64_t hi) { update_blocks(P, M, g, lo, hi, ends, decays, s); });
}

template <typename Master, typename G>
void with_moments(const Master& P, const G* g, const at::Tensor& m, const at::Tensor& v,
                  const c10::optional<at::Tensor>& m_scale, const c10::optional<at::Tensor>& v_scale, int64_t n,
                  c10::ArrayRef<int64_t> ends, c10::ArrayRef<double> decays, Scalars s) {
  if (m.scalar_type() == at::kFloat) {
    step_lean(P, Plain<float>{m.data_ptr<float>(), v.data_ptr<float>()}, g, n, ends, decays, s);
  } else if (m.scalar_type() == at::kBFloat16) {
    step_lean(P, Plain<uint16_t>{reinterpret_cast<uint16_t*>(m.data_ptr<at::BFloat16>()),
                                 reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>())}, g, n, ends, decays, s);
  } else {
    step_lean(P, Int8{m.data_ptr<int8_t>(), v.data_ptr<uint8_t>(), m_scale->data_ptr<float>(),
                      v_scale->data_ptr<float>()}, g, n, ends, decays, s);
  }
}

// ---- Muon's application of an orthogonalized update (host/muon.py, apply_update) ----
//
// W <- W * decay + alpha * O per element, as torch's `mul_(decay)` then `add_(O, alpha=alpha)` (its
// vectorised add is a fused multiply-add), the new weight published into the compute copy (fp32
// master) or rounded at random into the bf16 master from its element's noise (as
// precision.stochastic_round_bf16 from `origin`, the tensor's first index in its layer). One pass over
// 12 bytes a parameter (fp32 master, bf16 update and copy) where the torch ops take four with an fp32
// temporary for the bf16 update. O is read before W's copy is written over it (they may share a buffer).

template <typename O, typename W>
void apply_f32(float* p, const O* o, W* w, int64_t lo, int64_t hi, float decay, float alpha) {
  for (int64_t i = lo; i < hi; ++i) {
    const float pi = std::fma(alpha, load(o, i), p[i] * decay);
    p[i] = pi;
    store(w, i, pi);
  }
}

template <typename O>
void apply_bf16(uint16_t* p, const O* o, int64_t lo, int64_t hi, float decay, float alpha, uint32_t key,
                int64_t origin) {
  for (int64_t i = lo; i < hi; ++i) {
    const float pi = std::fma(alpha, load(o, i), load(p, i) * decay);
    const int64_t j = origin + i;
    p[i] = round_stochastic(pi, uint32_t(j), block_key(key, j));
  }
}

template <typename O>
void apply_update_from(const at::Tensor& master, const O* o, const c10::optional<at::Tensor>& weights, int64_t n,
                       float decay, float alpha, int64_t rounding_key, int64_t origin) {
  if (master.scalar_type() == at::kBFloat16) {
    uint16_t* p = reinterpret_cast<uint16_t*>(master.data_ptr<at::BFloat16>());
    over_tiles(n, [&](int64_t lo, int64_t hi) { apply_bf16(p, o, lo, hi, decay, alpha, uint32_t(rounding_key), origin); });
  } else if (weights->scalar_type() == at::kBFloat16) {
    float* p = master.data_ptr<float>();
    uint16_t* w = reinterpret_cast<uint16_t*>(weights->data_ptr<at::BFloat16>());
    over_tiles(n, [&](int64_t lo, int64_t hi) { apply_f32(p, o, w, lo, hi, decay, alpha); });
  } else {
    float* p = master.data_ptr<float>();
    float* w = weights->data_ptr<float>();
    over_tiles(n, [&](int64_t lo, int64_t hi) { apply_f32(p, o, w, lo, hi, decay, alpha); });
  }
}

}  // namespace

void check_state(const at::Tensor& t, int64_t n, std::initializer_list<at::ScalarType> dtypes, const char* what) {
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  TORCH_CHECK(ok && t.device().is_cpu() && t.is_contiguous() && t.numel() == n, what,
              " must be a contiguous CPU tensor of the expected dtype and size");
}

// The lean modes' one pass (host/precision.py). master: fp32 or bf16; the moments: fp32, bf16, or
// int8 (exp_avg) and uint8 (exp_avg_sq) with an fp32 scale per kBlock; grad: the gradient (bf16 or
// fp32); weights: the compute copy to publish (with an fp32 master: the gradient's own buffer;
// with a bf16 master: none, the master is the copy). rounding_key: this update's noise; origin: the
// index of the master's first element in its layer (a piece of it, host/store.py), where its noise starts.
void adamw_step_lean(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const c10::optional<at::Tensor>& exp_avg_scale, const c10::optional<at::Tensor>& exp_avg_sq_scale,
                     const at::Tensor& grad, const c10::optional<at::Tensor>& weights, c10::ArrayRef<int64_t> ends,
                     c10::ArrayRef<double> decays, double grad_scale, double beta1, double beta2, double bias2_sqrt,
                     double eps, double step_size, int64_t rounding_key, int64_t origin) {
  const int64_t n = master.numel();
  check_state(master, n, {at::kFloat, at::kBFloat16}, "the master");
  check_state(grad, n, {at::kFloat, at::kBFloat16}, "the gradient");
  const bool int8 = exp_avg.scalar_type() == at::kChar;
  check_state(exp_avg, n, {at::kFloat, at::kBFloat16, at::kChar}, "exp_avg");
  check_state(exp_avg_sq, n, {int8 ? at::kByte : exp_avg.scalar_type()}, "exp_avg_sq");
  if (int8) {
    TORCH_CHECK(exp_avg_scale && exp_avg_sq_scale, "int8 moments need their scales");
    check_state(*exp_avg_scale, (n + kBlock - 1) / kBlock, {at::kFloat}, "exp_avg_scale");
    check_state(*exp_avg_sq_scale, (n + kBlock - 1) / kBlock, {at::kFloat}, "exp_avg_sq_scale");
  }
  TORCH_CHECK(!ends.empty() && ends.size() == decays.size() && ends.back() == n, "segments must cover the buffer");
  const Scalars s{float(grad_scale), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
                  float(bias2_sqrt), float(eps), float(-step_size)};
  if (master.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(grad.scalar_type() == at::kBFloat16 && !weights, "a bf16 master takes a bf16 gradient and no weights");
    TORCH_CHECK(origin >= 0 && origin % kBlock == 0, "a piece of a bf16 master starts at a multiple of ", kBlock);
    const MasterBF16 P{reinterpret_cast<uint16_t*>(master.data_ptr<at::BFloat16>()), uint32_t(rounding_key), origin};
    with_moments(P, reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()), exp_avg, exp_avg_sq,
                 exp_avg_scale, exp_avg_sq_scale, n, ends, decays, s);
    return;
  }
  TORCH_CHECK(weights && weights->is_same(grad), "an fp32 master publishes into the gradient's buffer");
  if (grad.scalar_type() == at::kBFloat16) {
    uint16_t* w = reinterpret_cast<uint16_t*>(grad.data_ptr<at::BFloat16>());
    with_moments(MasterF32<uint16_t>{master.data_ptr<float>(), w}, w, exp_avg, exp_avg_sq, exp_avg_scale,
                 exp_avg_sq_scale, n, ends, decays, s);
  } else {
    float* w = grad.data_ptr<float>();
    with_moments(MasterF32<float>{master.data_ptr<float>(), w}, w, exp_avg, exp_avg_sq, exp_avg_scale,
                 exp_avg_sq_scale, n, ends, decays, s);
  }
}

void adamw_step(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const at::Tensor& grad_weights, c10::ArrayRef<int64_t> ends, c10::ArrayRef<double> decays,
                double grad_scale, double beta1, double beta2, double bias2_sqrt, double eps, double step_size) {
  const int64_t n = master.numel();
  for (const at::Tensor* t : {&master, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == n,
                "master and moments must be contiguous fp32 CPU tensors of one size");
  }
  TORCH_CHECK(grad_weights.device().is_cpu() && grad_weights.is_contiguous() && grad_weights.numel() == n,
              "the gradient/weights buffer must be a contiguous CPU tensor of the master's size");
  TORCH_CHECK(!ends.empty() && ends.size() == decays.size() && ends.back() == n, "segments must cover the buffer");
  const Scalars s{float(grad_scale), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
                  float(bias2_sqrt), float(eps), float(-step_size)};
  float *p = master.data_ptr<float>(), *m = exp_avg.data_ptr<float>(), *v = exp_avg_sq.data_ptr<float>();
  if (grad_weights.scalar_type() == at::kBFloat16) {
    step(p, m, v, reinterpret_cast<uint16_t*>(grad_weights.data_ptr<at::BFloat16>()), n, ends, decays, s);
  } else {
    TORCH_CHECK(grad_weights.scalar_type() == at::kFloat, "the gradient/weights buffer must be bf16 or fp32");
    step(p, m, v, grad_weights.data_ptr<float>(), n, ends, decays, s);
  }
}

// master: fp32 (publishing into `weights`, the compute copy) or bf16 (itself the copy: no weights);
// update: the orthogonalized update, bf16 or fp32.
void muon_apply(const at::Tensor& master, const at::Tensor& update, const c10::optional<at::Tensor>& weights,
                double decay, double alpha, int64_t rounding_key, int64_t origin) {
  const int64_t n = master.numel();
  check_state(master, n, {at::kFloat, at::kBFloat16}, "the master");
  check_state(update, n, {at::kFloat, at::kBFloat16}, "the update");
  if (master.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!weights && origin >= 0, "a bf16 master is its own compute copy: no weights");
  } else {
    TORCH_CHECK(weights.has_value(), "an fp32 master publishes into a compute copy");
    check_state(*weights, n, {at::kFloat, at::kBFloat16}, "the compute copy");
  }
  if (update.scalar_type() == at::kBFloat16) {
    apply_update_from(master, reinterpret_cast<const uint16_t*>(update.data_ptr<at::BFloat16>()), weights, n,
                      float(decay), float(alpha), rounding_key, origin);
  } else {
    apply_update_from(master, update.data_ptr<float>(), weights, n, float(decay), float(alpha), rounding_key, origin);
  }
}

TORCH_LIBRARY(megatrain, library) {
  library.def("adamw_step(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) grad_weights, "
              "int[] ends, float[] decays, float grad_scale, float beta1, float beta2, float bias2_sqrt, "
              "float eps, float step_size) -> ()", &adamw_step);
  library.def("adamw_step_lean(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
              "Tensor(d!)? exp_avg_scale, Tensor(e!)? exp_avg_sq_scale, Tensor(f!) grad, Tensor(g!)? weights, "
              "int[] ends, float[] decays, float grad_scale, float beta1, float beta2, float bias2_sqrt, "
              "float eps, float step_size, int rounding_key, int origin) -> ()", &adamw_step_lean);
  library.def("muon_apply(Tensor(a!) master, Tensor update, Tensor(b!)? weights, float decay, float alpha, "
              "int rounding_key, int origin) -> ()", &muon_apply);
}
"""

# -ffp-contract=off: no fused multiply-adds beyond those torch's kernels use, so that rounding
# follows torch's op by op; -fno-math-errno lets sqrt vectorise (torch builds with it too);
# -fopenmp: at::parallel_for runs on torch's own OpenMP threads (torch's libgomp, already loaded).
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags: a -march=native build is only valid on its like."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            lines = sorted({ln.strip() for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))})
    except OSError:
        pass
    return "\n".join([platform.machine(), *lines])


def _build_name() -> str:
    """Names one build: this source, flags, torch and CPU. A name once built never changes meaning."""
    key = "\n".join([_SOURCE, *_CFLAGS, torch.__version__, _cpu_signature()])
    return "megatrain_host_adamw_" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "megatrain"


def _ensure_ninja_on_path() -> None:
    """torch's JIT build calls `ninja`; the pip package's binary may sit outside PATH (an unactivated venv)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


class KernelBuild:
    """One load or build of the kernel (`build_kernel`) on a thread of its own: `start` begins it, at
    most once; `result` waits for it, starting it if nothing has. Callers on several threads share
    the one build: none builds or loads it a second time."""

    def __init__(self, cache_dir: Path | None = None, extra_cflags: tuple[str, ...] = ()):
        """`cache_dir` None: this node's (`_cache_dir`, found on the build's thread)."""
        self.cache_dir = cache_dir
        self.extra_cflags = extra_cflags
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._kernel = None

    def start(self) -> KernelBuild:
        with self._lock:
            if self._thread is None:  # a daemon: a store that ends mid-build does not wait for it
                self._thread = threading.Thread(target=self._build, name="host-adamw-kernel", daemon=True)
                self._thread.start()
        return self

    def _build(self) -> None:
        self._kernel = build_kernel(self.cache_dir, self.extra_cflags)

    def result(self):
        """torch.ops.megatrain, or None where it could not be built (`build_kernel` warned)."""
        self.start()._thread.join()
        return self._kernel


# This process's build: torch.ops holds one library of a name per process, so its build is per process too.
_THIS_PROCESS = KernelBuild()


def start_native_kernel() -> None:
    """Begin loading or building this node's kernel in the background (tens of seconds on a machine
    that never built it), so that it overlaps whatever the process does next; once per process."""
    _THIS_PROCESS.start()


def native_kernel():
    """torch.ops.megatrain (adamw_step, adamw_step_lean, muon_apply) for this node (built once, then loaded from
    the cache), or None; waits for the build `start_native_kernel` began, or runs it now."""
    return _THIS_PROCESS.result()


def build_kernel(cache_dir: Path | None = None, extra_cflags: tuple[str, ...] = ()):
    """Load the cached build, or compile one and publish it into the cache (None: this node's,
    `_cache_dir`); warn and return None where no compiler or ninja can.

    One process compiles at a time (`_build_lock`), so that the processes of a node that start
    together (its stores, each in a process of its own) compile once between them instead of each
    taking cores from the run's start: the others wait, then load what it published. A build runs
    in a directory of its own and is published with an atomic rename, so that no process loads a
    library half written.
    """
    name = _build_name()
    try:  # the cache's place too: torch.utils.cpp_extension needs setuptools, which a venv may lack
        cache_dir = cache_dir or _cache_dir()
        library = cache_dir / f"{name}.so"
        if library.exists():
            torch.ops.load_library(str(library))
            return torch.ops.megatrain
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(cache_dir / f"{name}.lock"):
            if library.exists():  # published by the process this one waited for
                torch.ops.load_library(str(library))
            else:
                _compile_and_publish(name, library, extra_cflags)  # the build loads what it compiled
        return torch.ops.megatrain
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"megatrain-ray: the one-pass host AdamW kernel could not be built ({first}); "
                      "using torch's fused AdamW in three passes (slower)", RuntimeWarning, stacklevel=2)
        return None


@contextlib.contextmanager
def _build_lock(path: Path):
    """Held while this process compiles (or finds a build published): an flock, which the kernel
    drops when the file closes or its process ends, killed or not, so no lock outlives its holder."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _compile_and_publish(name: str, library: Path, extra_cflags: tuple[str, ...]) -> None:
    """Compiles the kernel in a directory of its own beside `library`, loads it, and renames a copy
    into place (atomic: a process that finds `library` finds it whole)."""
    from torch.utils.cpp_extension import load_inline

    _ensure_ninja_on_path()
    with tempfile.TemporaryDirectory(prefix="build-", dir=library.parent) as build:
        load_inline(name, cpp_sources=[_SOURCE], extra_cflags=[*_CFLAGS, *extra_cflags],
                    extra_ldflags=["-fopenmp"], build_directory=build,
                    is_python_module=False)  # a torch op: no pybind, no Python headers, the GIL released
        shutil.copy(Path(build) / f"{name}.so", Path(build) / "publish.so")
        os.replace(Path(build) / "publish.so", library)
