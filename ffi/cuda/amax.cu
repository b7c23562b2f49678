// CUDA handler of jax_nvfp4_amax: the same values as the CPU handler
// (cpu/amax.cc). Kernels: AmaxKernel, one thread per 16-element chunk along
// the transformed axis, a block reduction, then one atomicMax per block and
// output; AmaxColumnsBf16Kernel: the recipe's case, 16 x 8 chunks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bindings.h"
#include "checks.h"
#include "cuda/device.cuh"
#include "cuda/launch.cuh"
#include "numerics/fast.cuh"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// ---------------------------------------------------------------------------
// AmaxKernel: out[b] = (max |x[b]|, max |bf16(RHT(x[b]))|), each over the
// finite values only (NaN and +-inf ignored: FiniteAbsOrZero, the header's
// MaxAbsFinite; a chunk holding one has no finite transformed value). The CTAs
// blockIdx.x / ctas_per_batch == b cover batch item b; thread chunks are 16
// elements along the transformed axis: contiguous along k (!kCols, as
// quantize_rows transforms), or 16 rows of one column (kCols, as
// quantize_cols; consecutive threads: consecutive columns).
// All values are >= +0 and finite, so the float maximum is the unsigned
// maximum of the bit patterns (the output is zeroed first).
// ---------------------------------------------------------------------------
struct AmaxArgs {
  const void* x;
  int64_t m, k;
  int64_t chunks;  // per batch item: m * k / 16
  int64_t ctas_per_batch;
  bool x_vec;  // x is 16-byte aligned (chunks along k start on 32 bytes)
  float* out;  // [batch, 2]
};

// The CTA's maxima of its threads' (plain, transformed) into out[0..1]: a
// warp and a block reduction, then one atomicMax per output (every value is
// >= +0 and not NaN, so the float maximum is the maximum of the bit
// patterns). Every thread of the CTA calls it.
__device__ __forceinline__ void StoreAmaxPair(float plain, float transformed,
                                              float* out) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    plain = fmaxf(plain, __shfl_xor_sync(0xFFFFFFFFu, plain, offset));
    transformed =
        fmaxf(transformed, __shfl_xor_sync(0xFFFFFFFFu, transformed, offset));
  }
  __shared__ float partial[2][kThreads / 32];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    partial[0][warp] = plain;
    partial[1][warp] = transformed;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 1; i < kThreads / 32; ++i) {
      plain = fmaxf(plain, partial[0][i]);
      transformed = fmaxf(transformed, partial[1][i]);
    }
    unsigned int* bits = reinterpret_cast<unsigned int*>(out);
    atomicMax(bits, FloatBits(plain));
    atomicMax(bits + 1, FloatBits(transformed));
  }
}

template <InType T, bool kCols>
__global__ void __launch_bounds__(kThreads) AmaxKernel(const AmaxArgs args) {
  const int64_t b = blockIdx.x / args.ctas_per_batch;
  const int64_t cta = blockIdx.x % args.ctas_per_batch;
  const int64_t base = b * args.m * args.k;
  float plain = 0.0f, transformed = 0.0f;
  for (int64_t c = cta * kThreads + threadIdx.x; c < args.chunks;
       c += args.ctas_per_batch * kThreads) {
    float v[kBlock];
    if (!kCols) {
      uint32_t w[kWords<T>];
      LoadBlockWords<T>(args.x, base + c * kBlock, kBlock, args.x_vec, w);
      WordsToFloats<T>(w, v);
    } else {
      const int64_t mb = Div(c, args.k);
      const int64_t col = c - mb * args.k;
      uint32_t w[kWords<T>];
#pragma unroll
      for (int j = 0; j < kWords<T>; ++j) w[j] = 0;
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const uint32_t e =
            LoadRawElement<T>(args.x, base + (mb * kBlock + j) * args.k + col);
        if constexpr (In<T>::kBytes == 4) {
          w[j] = e;
        } else {
          w[j >> 1] |= e << (16 * (j & 1));
        }
      }
      WordsToFloats<T>(w, v);
    }
    float y[kBlock];
    RandomHadamard16Fast(v, y);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      plain = fmaxf(plain, FiniteAbsOrZero(v[i]));
      transformed = fmaxf(transformed, FiniteAbsOrZero(y[i]));
    }
  }
  StoreAmaxPair(plain, transformed, args.out + 2 * b);
}

// ---------------------------------------------------------------------------
// AmaxColumnsBf16Kernel: AmaxKernel<kBf16, true> (the recipe's columns: the
// transform along m, the token axis) for a 16-byte aligned x with k % 8 ==
// 0. A thread's chunk is 16 rows x 8 columns, read with 16 16-byte loads
// (a warp reads 512 contiguous bytes of each row) instead of 16 2-byte
// loads per column. Fewer instructions per column, both exact for a column
// whose transformed values are all finite, also as bfloat16:
//   * the butterfly's last stage and the maximum of its two results:
//     max(|a + b|, |a - b|) = |a| + |b| as float sums (rounding is
//     symmetric and monotonic);
//   * the bfloat16 rounding once, of the thread's maximum: rounding (with
//     subnormals flushed) is monotonic, so max |bf16(y)| = bf16(max |y|).
// The column's maximum t of |a| + |b| is taken propagating NaN; t below
// kBf16RoundsFinite (the least float that rounds to bfloat16 inf) says that
// every transformed value of the column is finite (so are all earlier
// stages: an inf or NaN there reaches t) and so is its bfloat16 rounding.
// Otherwise -- a NaN or inf in the column, whose transformed values are then
// all non-finite, or an overflow at |x| ~ 1e38 -- the column takes the exact
// slow path: the last stage, the rounding and the finite test per value.
// ---------------------------------------------------------------------------
// The least float whose bfloat16 rounding (nearest even) is +inf: halfway
// between bfloat16's largest finite 0x7F7F and inf (a tie, to even: inf).
constexpr float kBf16RoundsFinite = 3.3961775292304957e38f;  // 0x7F7F8000

__global__ void __launch_bounds__(kThreads)
    AmaxColumnsBf16Kernel(const AmaxArgs args) {
  const int64_t b = blockIdx.x / args.ctas_per_batch;
  const int64_t cta = blockIdx.x % args.ctas_per_batch;
  const int64_t groups = args.k / 8;  // 16-byte column groups per row
  const int64_t chunks = args.m / kBlock * groups;
  const uint4* const x =
      static_cast<const uint4*>(args.x) + b * args.m * groups;
  float plain = 0.0f, transformed = 0.0f;
  for (int64_t c = cta * kThreads + threadIdx.x; c < chunks;
       c += args.ctas_per_batch * kThreads) {
    const int64_t mb = Div(c, groups);
    const uint4* const p = x + mb * kBlock * groups + (c - mb * groups);
    uint4 q[kBlock];
#pragma unroll
    for (int r = 0; r < kBlock; ++r) q[r] = __ldg(p + r * groups);
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      uint32_t w[kBlock];
#pragma unroll
      for (int r = 0; r < kBlock; ++r) {
        w[r] = word == 0   ? q[r].x
               : word == 1 ? q[r].y
               : word == 2 ? q[r].z
                           : q[r].w;
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // column 2 * word + s
        float z[kBlock];
#pragma unroll
        for (int r = 0; r < kBlock; ++r) {
          const float v = BitsToFloat(s == 0 ? w[r] << 16 : w[r] & 0xFFFF0000u);
          plain = fmaxf(plain, FiniteAbsOrZero(v));
          z[r] = v * (((kRhtSignMask >> r) & 1u) ? -0.25f : 0.25f);
        }
        // HadamardButterfly16's stages h = 1, 2, 4; then the last one's
        // maxima.
        ButterflyStages(z, /*end=*/kBlock / 2);
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < kBlock / 2; ++i) {
          t = MaxPropagatingNan(t, fabsf(z[i]) + fabsf(z[i + 8]));
        }
        if (t < kBf16RoundsFinite) {
          transformed = fmaxf(transformed, t);
        } else {  // rare: see above (unrolled: z stays in registers)
#pragma unroll
          for (int i = 0; i < kBlock / 2; ++i) {
            const float hi =
                __bfloat162float(__float2bfloat16_rn(z[i] + z[i + 8]));
            const float lo =
                __bfloat162float(__float2bfloat16_rn(z[i] - z[i + 8]));
            transformed = fmaxf(
                transformed, fmaxf(FiniteAbsOrZero(hi), FiniteAbsOrZero(lo)));
          }
        }
      }
    }
  }
  transformed = __bfloat162float(__float2bfloat16_rn(transformed));
  StoreAmaxPair(plain, transformed, args.out + 2 * b);
}

ffi::Error AmaxCuda(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, bool cols) {
  if (!IsSupportedInputType(x.element_type())) {
    return InvalidArgument("input must be float32, bfloat16 or float16");
  }
  MatrixDims d;
  if (!Rank3Dims(x, &d)) return InvalidArgument("expected a rank-3 input");
  if ((cols ? d.m : d.k) % kBlock != 0) {
    return InvalidArgument("the transformed axis must be a multiple of 16");
  }
  if (out->element_count() != 2 * d.batch) {
    return InvalidArgument("output must be [batch, 2]");
  }
  if (d.batch == 0) return ffi::Error::Success();
  float* out_data = out->typed_data();
  if (const cudaError_t err =
          cudaMemsetAsync(out_data, 0, 2 * d.batch * sizeof(float), stream);
      err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_nvfp4: amax memset failed: ") +
                          cudaGetErrorString(err));
  }
  AmaxArgs args;
  args.x = x.untyped_data();
  args.m = d.m;
  args.k = d.k;
  args.chunks = d.m * d.k / kBlock;
  if (args.chunks == 0) return ffi::Error::Success();
  args.x_vec = IsAligned(args.x, 16);
  args.out = out_data;
  // The recipe's columns in bfloat16, 16-byte aligned rows: chunks of 16 rows
  // x 8 columns (AmaxColumnsBf16Kernel).
  const bool columns_bf16 = cols && x.element_type() == ffi::DataType::BF16 &&
                            args.x_vec && d.k % 8 == 0;
  const int64_t thread_chunks = columns_bf16 ? args.chunks / 8 : args.chunks;
  // About 4 waves of CTAs in all (at least one per batch item), each CTA
  // striding over the chunks of its batch item.
  const int64_t wanted = std::max<int64_t>(1, 4096 / d.batch);
  args.ctas_per_batch =
      std::min<int64_t>((thread_chunks + kThreads - 1) / kThreads, wanted);
  args.ctas_per_batch =
      std::min<int64_t>(args.ctas_per_batch, kMaxGrid / d.batch);
  if (args.ctas_per_batch < 1) {
    return InvalidArgument("batch too large for the amax kernel grid");
  }
  const unsigned int grid =
      static_cast<unsigned int>(d.batch * args.ctas_per_batch);
  if (columns_bf16) {
    AmaxColumnsBf16Kernel<<<grid, kThreads, 0, stream>>>(args);
    return LaunchError("amax");
  }
#define JAX_NVFP4_LAUNCH_AMAX(T)                               \
  if (cols) {                                                  \
    AmaxKernel<T, true><<<grid, kThreads, 0, stream>>>(args);  \
  } else {                                                     \
    AmaxKernel<T, false><<<grid, kThreads, 0, stream>>>(args); \
  }
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      JAX_NVFP4_LAUNCH_AMAX(InType::kBf16);
      break;
    case ffi::DataType::F16:
      JAX_NVFP4_LAUNCH_AMAX(InType::kF16);
      break;
    default:
      JAX_NVFP4_LAUNCH_AMAX(InType::kF32);
      break;
  }
#undef JAX_NVFP4_LAUNCH_AMAX
  return LaunchError("amax");
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4AmaxCuda, jax_nvfp4::AmaxCuda,
    jax_nvfp4::AmaxBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
