// Packed attention as one MLX primitive on the CPU (mlx_grpo/cpu/native.py).
//
// The update's packed pass (logprobs._Packed) holds every position of a micro-batch once,
// as rows of [N, heads, head_dim]: each group's prompt, then each completion's inputs
// (those it does not share with an earlier completion of its group). A position attends
// to the keys of R runs of rows, then of its own run up to itself: its prompt (no run for
// a prompt position), then the runs of the earlier completions whose first inputs it
// shares, then its own. `meta` [N, 2R + 1] (int32) holds, per position, each run's first
// row and length (length 0: no run), then its own run's first row.
//
// Built from MLX's own ops, that attention is hundreds of small ops a layer (a layout of
// rows into padded blocks, scores, masks, an exp, their gradients), each dispatched on its
// own; here it is one op forward and one backward, over the keys each position sees and
// no others. The forward keeps the log of each row's normaliser; the backward recomputes
// the probabilities from it (flash attention's), so nothing of [N, keys] size is stored.
// Sums run in one fixed order, so a result does not depend on the threads or the rest of
// the batch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// 2^t for t in [-127, 128], as fastmath.exp computes it: 2^n 2^f with n = round(t) and
// Cephes' polynomial for 2^f on [-1/2, 1/2]; 2^n from the exponent field, which is 0 (the
// float 0) at n = -127 and 255 (inf) at n = 128.
inline float exp2_clamped(float t) {
  float r = t + 12582912.0f;  // 1.5 * 2^23: its low mantissa bits hold n
  float f = t - (r - 12582912.0f);
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &r, 4);
  bits = (bits - (0x4B400000 - 127)) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// e^x for x <= 0 (a score less its row's maximum): 0 below about -88.
inline float exp_nonpositive(float x) {
  float t = x * 1.4426950408889634f;
  return exp2_clamped(t < -127.0f ? -127.0f : t);
}

// e^x for any x: 0 below about -88, inf above about 88.4 (NaN gives NaN).
inline float exp_any(float x) {
  float t = x * 1.4426950408889634f;
  return exp2_clamped(t < -127.0f ? -127.0f : (t > 128.0f ? 128.0f : t));
}

inline float dot(const float* a, const float* b, int d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < d; i++) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float c, const float* __restrict x, int d) {
#pragma omp simd
  for (int i = 0; i < d; i++) y[i] += c * x[i];
}

// Eight floats as one vector (GCC and Clang vector extensions: an AVX register on x86-64,
// two NEON registers on ARM), loaded and stored at any alignment.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

inline v8 load(const float* p) { return *(const v8u*)p; }
inline void store(float* p, v8 x) { *(v8u*)p = x; }
inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// The loops over one head's row of D floats: as W vectors where D = 8 W (W a constant,
// so that they unroll and a row of sums stays in registers), else one float at a time
// (W = 0). Key t is the row at base + rows[t] * step.
template <int W>
struct Head {
  static float dot(const float* a, const float* b, int d) {
    if constexpr (W == 0) {
      return ::dot(a, b, d);
    } else {
      v8 acc = load(a) * load(b);
      for (int w = 1; w < W; w++) acc += load(a + 8 * w) * load(b + 8 * w);
      return hsum(acc);
    }
  }

  // out[t] = q . key t, four keys at a time (four independent sums).
  static void dots(const float* q, const float* base, const int* rows, int nk, size_t step,
                   int d, float* out) {
    int t = 0;
    if constexpr (W > 0) {
      for (; t + 4 <= nk; t += 4) {
        const float *k0 = base + rows[t] * step, *k1 = base + rows[t + 1] * step;
        const float *k2 = base + rows[t + 2] * step, *k3 = base + rows[t + 3] * step;
        v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int w = 0; w < W; w++) {
          const v8 x = load(q + 8 * w);
          a0 += x * load(k0 + 8 * w), a1 += x * load(k1 + 8 * w);
          a2 += x * load(k2 + 8 * w), a3 += x * load(k3 + 8 * w);
        }
        out[t] = hsum(a0), out[t + 1] = hsum(a1), out[t + 2] = hsum(a2), out[t + 3] = hsum(a3);
      }
    }
    for (; t < nk; t++) out[t] = dot(q, base + rows[t] * step, d);
  }

  // out = sum over t of c[t] key t.
  static void weighted_sum(const float* c, const float* base, const int* rows, int nk,
                           size_t step, int d, float* out) {
    if constexpr (W > 0) {
      v8 acc[W] = {};
      for (int t = 0; t < nk; t++) {
        const float* x = base + rows[t] * step;
        const v8 ct = v8{} + c[t];
        for (int w = 0; w < W; w++) acc[w] += ct * load(x + 8 * w);
      }
      for (int w = 0; w < W; w++) store(out + 8 * w, acc[w]);
    } else {
      std::memset(out, 0, sizeof(float) * d);
      for (int t = 0; t < nk; t++) axpy(out, c[t], base + rows[t] * step, d);
    }
  }

  // key t += c[t] x, for every t.
  static void add_to_keys(float* base, const int* rows, int nk, size_t step, const float* c,
                          const float* x, int d) {
    if constexpr (W > 0) {
      v8 xv[W];
      for (int w = 0; w < W; w++) xv[w] = load(x + 8 * w);
      for (int t = 0; t < nk; t++) {
        float* y = base + rows[t] * step;
        const v8 ct = v8{} + c[t];
        for (int w = 0; w < W; w++) store(y + 8 * w, load(y + 8 * w) + ct * xv[w]);
      }
    } else {
      for (int t = 0; t < nk; t++) axpy(base + rows[t] * step, c[t], x, d);
    }
  }
};

struct Shape {
  int n, h, hk, d;
  float scale;
  int runs;  // R: meta is [n, 2R + 1]
};

// Throws unless every position's keys lie within the batch: each run inside [0, n), its
// own run starting at or before itself, and n keys at most in all (no write past `rows`
// or dk, dv).
inline void check_meta(const int32_t* meta, int n, int runs) {
  const int width = 2 * runs + 1;
  for (int i = 0; i < n; i++) {
    const int32_t* m = meta + (size_t)width * i;
    const int32_t own = m[2 * runs];
    bool ok = own >= 0 && own <= i;
    int64_t keys = (int64_t)i - own + 1;
    for (int r = 0; r < runs && ok; r++) {
      ok = m[2 * r] >= 0 && m[2 * r + 1] >= 0 && m[2 * r] <= n - m[2 * r + 1];
      keys += m[2 * r + 1];
    }
    if (!ok || keys > n)
      throw std::invalid_argument("packed_attention: meta row " + std::to_string(i) +
                                  " names keys outside the batch");
  }
}

// The rows of the keys position i sees (each run's, then its own run's up to itself),
// into `rows`; returns how many.
inline int keys_of(const int32_t* meta, int runs, int i, int* rows) {
  const int32_t* m = meta + (size_t)(2 * runs + 1) * i;
  int nk = 0;
  for (int r = 0; r < runs; r++)
    for (int j = m[2 * r]; j < m[2 * r] + m[2 * r + 1]; j++) rows[nk++] = j;
  for (int j = m[2 * runs]; j <= i; j++) rows[nk++] = j;
  return nk;
}

template <int W>
void forward(const float* q, const float* k, const float* v, const int32_t* meta, float* out,
             float* lse, Shape s) {
  using H = Head<W>;
  check_meta(meta, s.n, s.runs);
  const int rep = s.h / s.hk, d = s.d;
  const size_t step = (size_t)s.hk * d;
  std::vector<float> p(s.n);
  std::vector<int> rows(s.n);
  // key head by key head, so that one head's keys and values stay in cache
  for (int kh = 0; kh < s.hk; kh++)
  for (int i = 0; i < s.n; i++) {
    const int nk = keys_of(meta, s.runs, i, rows.data());
    for (int hh = kh * rep; hh < (kh + 1) * rep; hh++) {
      const size_t row = (size_t)i * s.h + hh, head = (size_t)kh * d;
      H::dots(q + row * d, k + head, rows.data(), nk, step, d, p.data());
      float top = -INFINITY;
      for (int t = 0; t < nk; t++) {
        p[t] *= s.scale;
        top = p[t] > top ? p[t] : top;
      }
      float total = 0.0f;
      for (int t = 0; t < nk; t++) {
        p[t] = exp_nonpositive(p[t] - top);
        total += p[t];
      }
      const float inv = 1.0f / total;
      for (int t = 0; t < nk; t++) p[t] *= inv;
      H::weighted_sum(p.data(), v + head, rows.data(), nk, step, d, out + row * d);
      lse[row] = top + std::log(total);
    }
  }
}

template <int W>
void backward(const float* q, const float* k, const float* v, const int32_t* meta,
              const float* out, const float* lse, const float* dout, float* dq, float* dk,
              float* dv, Shape s) {
  using H = Head<W>;
  check_meta(meta, s.n, s.runs);
  const int rep = s.h / s.hk, d = s.d;
  const size_t step = (size_t)s.hk * d;
  std::memset(dk, 0, sizeof(float) * (size_t)s.n * s.hk * d);
  std::memset(dv, 0, sizeof(float) * (size_t)s.n * s.hk * d);
  std::vector<float> p(s.n), ds(s.n);
  std::vector<int> rows(s.n);
  // key head by key head, so that one head's keys, values and their gradients stay in cache
  for (int kh = 0; kh < s.hk; kh++)
  for (int i = 0; i < s.n; i++) {
    const int nk = keys_of(meta, s.runs, i, rows.data());
    for (int hh = kh * rep; hh < (kh + 1) * rep; hh++) {
      const size_t row = (size_t)i * s.h + hh, head = (size_t)kh * d;
      const float *qi = q + row * d, *doi = dout + row * d;
      const float delta = H::dot(doi, out + row * d, d), norm = lse[row];
      H::dots(qi, k + head, rows.data(), nk, step, d, p.data());
      H::dots(doi, v + head, rows.data(), nk, step, d, ds.data());
      for (int t = 0; t < nk; t++) {
        p[t] = exp_nonpositive(p[t] * s.scale - norm);
        ds[t] = p[t] * (ds[t] - delta) * s.scale;
      }
      H::add_to_keys(dk + head, rows.data(), nk, step, ds.data(), qi, d);
      H::add_to_keys(dv + head, rows.data(), nk, step, p.data(), doi, d);
      H::weighted_sum(ds.data(), k + head, rows.data(), nk, step, d, dq + row * d);
    }
  }
}

// One decode step: each of B rows has H queries (pre-scaled) over its cache's C columns
// of keys and values (Hkv heads), of which those with bias -inf are not seen; the others
// add their bias to the score.
template <int W>
void decode(const float* q, const float* k, const float* v, const float* bias, float* out,
            int b, int h, int hk, int c, int d) {
  using H = Head<W>;
  const int rep = h / hk;
  std::vector<float> p(c);
  std::vector<int> cols(c);
  for (int r = 0; r < b; r++) {
    const float* br = bias + (size_t)r * c;
    int nk = 0;
    for (int t = 0; t < c; t++)
      if (br[t] != -INFINITY) cols[nk++] = t;
    for (int hh = 0; hh < h; hh++) {
      const float* qi = q + ((size_t)r * h + hh) * d;
      const size_t head = ((size_t)r * hk + hh / rep) * c * d;
      H::dots(qi, k + head, cols.data(), nk, d, d, p.data());
      float top = -INFINITY;
      for (int t = 0; t < nk; t++) {
        p[t] += br[cols[t]];
        top = p[t] > top ? p[t] : top;
      }
      float total = 0.0f;
      for (int t = 0; t < nk; t++) {
        p[t] = exp_nonpositive(p[t] - top);
        total += p[t];
      }
      const float inv = 1.0f / total;
      for (int t = 0; t < nk; t++) p[t] *= inv;
      H::weighted_sum(p.data(), v + head, cols.data(), nk, d, d, out + ((size_t)r * h + hh) * d);
    }
  }
}

// silu(g) u = g u / (1 + e^-g), and its gradient: with s = sigmoid(g), dg = c u (s + g s
// (1 - s)) and du = c g s (fastmath's kernels, one pass each).
void swiglu_forward(const float* g, const float* u, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; i++) out[i] = g[i] * u[i] / (1.0f + exp_any(-g[i]));
}

void swiglu_backward(const float* g, const float* u, const float* c, float* dg, float* du,
                     size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; i++) {
    const float s = 1.0f / (1.0f + exp_any(-g[i])), gs = g[i] * s;
    dg[i] = c[i] * u[i] * (s + gs * (1.0f - s));
    du[i] = c[i] * gs;
  }
}

// The kernels for the head width: as vectors for 64 and 128, any other a float at a time.
template <typename... A>
void forward_any(Shape s, A... a) {
  s.d == 64 ? forward<8>(a..., s) : s.d == 128 ? forward<16>(a..., s) : forward<0>(a..., s);
}

template <typename... A>
void backward_any(Shape s, A... a) {
  s.d == 64 ? backward<8>(a..., s) : s.d == 128 ? backward<16>(a..., s) : backward<0>(a..., s);
}

Shape shape_of(const mx::array& q, const mx::array& k, const mx::array& meta, float scale) {
  return {q.shape(0), q.shape(1), k.shape(1), q.shape(2), scale, (meta.shape(1) - 1) / 2};
}

// An input's elements in row-major order: its own buffer where it is row-contiguous (as
// the ops' inputs almost always are), else a copy made on the stream, when its values are
// there. (Contiguity is known when the op is scheduled; the values only when it runs.)
template <typename T>
struct Dense {
  const T* data;
  mx::Shape shape;
  mx::Strides strides;
  bool strided;
  std::shared_ptr<std::vector<T>> copy;

  explicit Dense(const mx::array& a)
      : data(a.data<T>()), shape(a.shape()), strides(a.strides()),
        strided(!a.flags().row_contiguous) {}

  const T* get() {
    if (!strided) return data;
    size_t n = 1;
    for (int x : shape) n *= x;
    copy = std::make_shared<std::vector<T>>(n);
    T* out = copy->data();
    fill(data, 0, out);
    return copy->data();
  }

 private:
  void fill(const T* src, size_t dim, T*& out) const {
    if (dim + 1 == shape.size()) {
      for (int i = 0; i < shape[dim]; i++) *out++ = src[i * strides[dim]];
      return;
    }
    for (int i = 0; i < shape[dim]; i++) fill(src + i * strides[dim], dim + 1, out);
  }
};

// The default stream, where it is a CPU one; `op` names the op in the error otherwise.
mx::Stream cpu_stream(const char* op) {
  auto stream = mx::to_stream({});
  if (stream.device != mx::Device::cpu)
    throw std::invalid_argument(std::string(op) + ": runs on the CPU only");
  return stream;
}

// A primitive computed on the CPU stream: `encoder` allocates the outputs (so that a task
// made after it may capture their pointers) and names the buffers MLX holds while the
// task it then dispatches runs.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

 protected:
  mx::cpu::CommandEncoder& encoder(const std::vector<mx::array>& in,
                                   std::vector<mx::array>& outputs) {
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& a : outputs) enc.set_output_array(a);
    return enc;
  }
};

class PackedAttentionVJP : public CpuPrimitive {
 public:
  PackedAttentionVJP(mx::Stream stream, float scale) : CpuPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(in, outputs);
    enc.dispatch(
        [q = Dense<float>(in[0]), k = Dense<float>(in[1]), v = Dense<float>(in[2]),
         meta = Dense<int32_t>(in[3]), out = Dense<float>(in[4]), lse = Dense<float>(in[5]),
         dout = Dense<float>(in[6]), dq = outputs[0].data<float>(),
         dk = outputs[1].data<float>(), dv = outputs[2].data<float>(),
         s = shape_of(in[0], in[1], in[3], scale_)]() mutable {
          backward_any(s, q.get(), k.get(), v.get(), meta.get(), out.get(), lse.get(),
                       dout.get(), dq, dk, dv);
        });
  }
  const char* name() const override { return "PackedAttentionVJP"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[1].shape(), in[2].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const PackedAttentionVJP&>(other).scale_;
  }

 private:
  float scale_;
};

class PackedAttention : public CpuPrimitive {
 public:
  PackedAttention(mx::Stream stream, float scale) : CpuPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(in, outputs);
    enc.dispatch(
        [q = Dense<float>(in[0]), k = Dense<float>(in[1]), v = Dense<float>(in[2]),
         meta = Dense<int32_t>(in[3]), out = outputs[0].data<float>(),
         lse = outputs[1].data<float>(), s = shape_of(in[0], in[1], in[3], scale_)]() mutable {
          forward_any(s, q.get(), k.get(), v.get(), meta.get(), out, lse);
        });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override {
    auto grads = mx::array::make_arrays(
        {primals[0].shape(), primals[1].shape(), primals[2].shape()},
        {mx::float32, mx::float32, mx::float32},
        std::make_shared<PackedAttentionVJP>(stream(), scale_),
        {primals[0], primals[1], primals[2], primals[3], outputs[0], outputs[1],
         mx::astype(cotangents[0], mx::float32, stream())});
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(a < 3 ? grads[a] : mx::zeros_like(primals[a], stream()));
    return out;
  }
  const char* name() const override { return "PackedAttention"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), {in[0].shape(0), in[0].shape(1)}};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const PackedAttention&>(other).scale_;
  }

 private:
  float scale_;
};

class SwigluVJP : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(in, outputs);
    enc.dispatch(
        [g = Dense<float>(in[0]), u = Dense<float>(in[1]), c = Dense<float>(in[2]),
         dg = outputs[0].data<float>(), du = outputs[1].data<float>(),
         n = in[0].size()]() mutable { swiglu_backward(g.get(), u.get(), c.get(), dg, du, n); });
  }
  const char* name() const override { return "SwigluVJP"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[0].shape()};
  }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

class Swiglu : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(in, outputs);
    enc.dispatch(
        [g = Dense<float>(in[0]), u = Dense<float>(in[1]), o = outputs[0].data<float>(),
         n = outputs[0].size()]() mutable { swiglu_forward(g.get(), u.get(), o, n); });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    auto grads = mx::array::make_arrays(
        {primals[0].shape(), primals[1].shape()}, {mx::float32, mx::float32},
        std::make_shared<SwigluVJP>(stream()),
        {primals[0], primals[1], mx::astype(cotangents[0], mx::float32, stream())});
    std::vector<mx::array> out;
    for (int a : argnums) out.push_back(grads[a]);
    return out;
  }
  const char* name() const override { return "Swiglu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
};

mx::array swiglu(const mx::array& g, const mx::array& u) {
  if (g.shape() != u.shape() || g.dtype() != mx::float32 || u.dtype() != mx::float32)
    throw std::invalid_argument("swiglu: float32 gate and input of one shape");
  return mx::array(g.shape(), mx::float32, std::make_shared<Swiglu>(cpu_stream("swiglu")),
                   {g, u});
}

class DecodeAttention : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outputs) override {
    auto& enc = encoder(in, outputs);
    enc.dispatch(
        [q_ = Dense<float>(in[0]), k_ = Dense<float>(in[1]), v_ = Dense<float>(in[2]),
         bias_ = Dense<float>(in[3]), o = outputs[0].data<float>(), b = in[0].shape(0),
         h = in[0].shape(1), hk = in[1].shape(1), c = in[1].shape(2),
         d = in[0].shape(2)]() mutable {
          const float *q = q_.get(), *k = k_.get(), *v = v_.get(), *bias = bias_.get();
          d == 64    ? decode<8>(q, k, v, bias, o, b, h, hk, c, d)
          : d == 128 ? decode<16>(q, k, v, bias, o, b, h, hk, c, d)
                     : decode<0>(q, k, v, bias, o, b, h, hk, c, d);
        });
  }
  const char* name() const override { return "DecodeAttention"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
};

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& bias) {
  if (q.ndim() != 3 || k.ndim() != 4 || v.shape() != k.shape() || bias.ndim() != 2 ||
      k.shape(0) != q.shape(0) || bias.shape(0) != q.shape(0) || bias.shape(1) != k.shape(2) ||
      q.shape(2) != k.shape(3) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument(
        "decode_attention: q [B, H, D], k and v [B, Hkv, C, D] (H a multiple of Hkv), "
        "bias [B, C]");
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32 ||
      bias.dtype() != mx::float32)
    throw std::invalid_argument("decode_attention: float32 q, k, v and bias");
  auto stream = cpu_stream("decode_attention");
  return mx::array(q.shape(), mx::float32, std::make_shared<DecodeAttention>(stream),
                   {q, k, v, bias});
}

mx::array packed_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& meta, float scale) {
  if (q.ndim() != 3 || k.ndim() != 3 || v.shape() != k.shape() || meta.ndim() != 2 ||
      meta.shape(1) % 2 != 1 || q.shape(0) != k.shape(0) || meta.shape(0) != q.shape(0) ||
      q.shape(2) != k.shape(2) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument(
        "packed_attention: q [N, H, D], k and v [N, Hkv, D] (H a multiple of Hkv), "
        "meta [N, 2R + 1]");
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32 ||
      meta.dtype() != mx::int32)
    throw std::invalid_argument("packed_attention: float32 q, k, v and int32 meta");
  auto stream = cpu_stream("packed_attention");
  auto outs = mx::array::make_arrays(
      {q.shape(), {q.shape(0), q.shape(1)}}, {mx::float32, mx::float32},
      std::make_shared<PackedAttention>(stream, scale),
      {q, k, v, meta});
  return outs[0];
}

}  // namespace

NB_MODULE(_packed_attention, m) {
  m.def("packed_attention", &packed_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("meta"), nb::arg("scale"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"));
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("bias"));
}
