// CUDA handlers of jax_nvfp4_dequantize (the same values as the CPU handler,
// cpu/dequantize.cc) and jax_nvfp4_decode_bf16 (the Hopper GEMM's operands).
// Kernels: DequantizeKernel, one thread per 16-element block;
// DecodeBf16Kernel, 8 elements per lane, 16-byte stores.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bindings.h"
#include "checks.h"
#include "cuda/decode.cuh"
#include "cuda/device.cuh"
#include "cuda/launch.cuh"
#include "numerics/nvfp4.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// ---------------------------------------------------------------------------
// DecodeBf16Kernel: out = e2m1(code) * E4M3 block scale as bfloat16, without
// the amax -- the operands of the Hopper GEMM
// (jax_nvfp4/backends/bf16_gemm.py), the same values as its pure-JAX twin
// reference.decode_bf16. Every such product is exact in bfloat16 (2 + 4
// significant bits; 2^-10 .. 2688). Lane q takes the 8 elements of 4 code bytes
// (half a block): its 16-byte store lies next to its neighbours', so a warp
// writes 512 contiguous bytes; kDecodeUnroll such groups per lane are loaded
// before any is decoded (DecodeCodes8Bf16).
// ---------------------------------------------------------------------------
constexpr int kDecodeUnroll = 4;

__device__ __forceinline__ uint4 DecodeHalfBlockBf16(uint32_t codes,
                                                     uint8_t scale_byte) {
  return DecodeCodes8Bf16(codes, ScaleBf16Pair(E4M3Decode(scale_byte)));
}

__global__ void __launch_bounds__(kThreads)
    DecodeBf16Kernel(const uint32_t* codes, const uint8_t* scales, uint4* out,
                     int64_t groups) {
  // Lane t takes groups t, t + stride, ... (kDecodeUnroll of them per loop
  // step); the host's grid covers every group in one step (GridFor allows
  // 2^31 - 1 CTAs), so the loop runs once but stays correct for any grid.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t first =
           static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       first < groups; first += kDecodeUnroll * stride) {
    uint32_t c[kDecodeUnroll];
    uint8_t s[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int64_t q = first + u * stride;
      if (q < groups) {
        c[u] = __ldg(codes + q);
        s[u] = __ldg(scales + q / 2);
      }
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int64_t q = first + u * stride;
      if (q < groups) out[q] = DecodeHalfBlockBf16(c[u], s[u]);
    }
  }
}

// ---------------------------------------------------------------------------
// DequantizeKernel: codes [batch, rows, len / 2], scales [batch, rows,
// len / 16] -> out [batch, rows, len]. Thread i takes the 16-element block i.
// ---------------------------------------------------------------------------
struct DequantizeArgs {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* amax;
  int64_t blocks;            // batch * rows * len / 16
  int64_t blocks_per_batch;  // rows * len / 16
  int64_t batch_per_amax;
  bool codes_aligned;         // 8-byte aligned
  bool out_aligned;           // 16-byte aligned
  uint32_t host_default_nan;  // what 0 * inf gives on the host CPU
  void* out;
};

// float32 NaN results carry bits that differ between processors: a GPU
// writes 0x7FFFFFFF, x86-64 the "default NaN" 0xFFC00000 for an invalid
// operation (0 * inf) and the quieted operand when one operand is NaN. A
// dequantized value is NaN only through amax (NaN: propagated, quieted), a
// NaN scale byte (0x7F, a block that held a NaN or +-inf, or 0xFF: the
// scale's NaN propagated, E4M3Decode's 0x7FC00000 or 0xFFC00000) or 0 * inf
// (default NaN), so the CPU handler's bits are reproduced (where both amax
// and the scale are NaN, the amax's: which operand x86 propagates then is
// the compiler's choice).
__device__ __forceinline__ float HostNan(float amax, float scale,
                                         uint32_t default_nan) {
  return BitsToFloat(amax != amax     ? FloatBits(amax) | 0x00400000u
                     : scale != scale ? FloatBits(scale)
                                      : default_nan);
}

template <bool kBf16Out>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const DequantizeArgs args) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       i < args.blocks; i += stride) {
    const int64_t b = Div(i, args.blocks_per_batch);
    const float a = args.amax[Div(b, args.batch_per_amax)];
    const float scale = E4M3Decode(args.scales[i]);
    const float multiplier = BlockDecodeMultiplier(scale, a);
    uint64_t packed = 0;
    if (args.codes_aligned) {
      packed = reinterpret_cast<const uint64_t*>(args.codes)[i];
    } else {
#pragma unroll
      for (int byte = 0; byte < 8; ++byte) {
        packed |= static_cast<uint64_t>(args.codes[8 * i + byte]) << (8 * byte);
      }
    }
    float v[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      v[j] = E2M1Decode(static_cast<uint32_t>(packed >> (4 * j)) & 0xFu) *
             multiplier;
    }
    if (kBf16Out) {
      uint32_t w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        w[j] = static_cast<uint32_t>(FloatToBfloat16Bits(v[2 * j])) |
               (static_cast<uint32_t>(FloatToBfloat16Bits(v[2 * j + 1])) << 16);
      }
      uint16_t* out = static_cast<uint16_t*>(args.out) + kBlock * i;
      if (args.out_aligned) {
        uint4* p = reinterpret_cast<uint4*>(out);
        p[0] = make_uint4(w[0], w[1], w[2], w[3]);
        p[1] = make_uint4(w[4], w[5], w[6], w[7]);
      } else {
#pragma unroll
        for (int j = 0; j < kBlock; ++j) {
          out[j] = static_cast<uint16_t>(w[j >> 1] >> (16 * (j & 1)));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        if (v[j] != v[j]) v[j] = HostNan(a, scale, args.host_default_nan);
      }
      float* out = static_cast<float*>(args.out) + kBlock * i;
      if (args.out_aligned) {
        float4* p = reinterpret_cast<float4*>(out);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          p[c] =
              make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlock; ++j) out[j] = v[j];
      }
    }
  }
}

// The NaN that the host CPU makes of 0 * inf (0xFFC00000 on x86-64,
// 0x7FC00000 on Arm), computed at run time (volatile: not folded).
uint32_t HostDefaultNanBits() {
  volatile float zero = 0.0f;
  volatile float inf = INFINITY;
  const float nan = zero * inf;
  uint32_t bits;
  std::memcpy(&bits, &nan, sizeof(bits));
  return bits;
}

ffi::Error DequantizeCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                          ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> amax,
                          ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = out->dimensions();
  if (dims.size() != 3) return InvalidArgument("expected a rank-3 output");
  const int64_t batch = dims[0], rows = dims[1], len = dims[2];
  const int64_t n_amax = amax.element_count();
  if (len % kBlock != 0 || codes.element_count() != batch * rows * len / 2 ||
      scales.element_count() != batch * rows * len / kBlock ||
      scales.element_type() != ffi::DataType::F8E4M3FN || n_amax < 1 ||
      batch % n_amax != 0) {
    return InvalidArgument("dequantize operands have inconsistent shapes");
  }
  const ffi::DataType out_type = out->element_type();
  if (out_type != ffi::DataType::F32 && out_type != ffi::DataType::BF16) {
    return InvalidArgument("dequantize output must be float32 or bfloat16");
  }
  DequantizeArgs args;
  args.codes = codes.typed_data();
  args.scales = static_cast<const uint8_t*>(scales.untyped_data());
  args.amax = amax.typed_data();
  args.blocks = batch * rows * len / kBlock;
  if (args.blocks == 0) return ffi::Error::Success();
  args.blocks_per_batch = rows * len / kBlock;
  args.batch_per_amax = batch / n_amax;
  args.codes_aligned = IsAligned(args.codes, 8);
  args.out = out->untyped_data();
  args.out_aligned = IsAligned(args.out, 16);
  args.host_default_nan = HostDefaultNanBits();
  const unsigned int grid = GridFor(args.blocks);
  if (out_type == ffi::DataType::BF16) {
    DequantizeKernel<true><<<grid, kThreads, 0, stream>>>(args);
  } else {
    DequantizeKernel<false><<<grid, kThreads, 0, stream>>>(args);
  }
  return LaunchError("dequantize");
}

// The Hopper GEMM's operand decode (DecodeBf16Kernel): codes uint8 [n / 2],
// scales float8_e4m3fn [n / 16] -> bfloat16 [n], any shapes of those sizes.
ffi::Error DecodeBf16Cuda(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                          ffi::AnyBuffer scales,
                          ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  const int64_t n = out->element_count();
  if (n % kBlock != 0 || codes.element_count() * 2 != n ||
      scales.element_count() * kBlock != n ||
      scales.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(
        "decode_bf16 expects codes of n/2 bytes, float8_e4m3fn scales of "
        "n/16 and a bfloat16 output of n elements, n a multiple of 16");
  }
  if (n == 0) return ffi::Error::Success();
  // XLA buffers are at least 16-byte aligned; checked, not assumed.
  if (!IsAligned(codes.typed_data(), 4) || !IsAligned(out->typed_data(), 16)) {
    return InvalidArgument(
        "decode_bf16 needs 4-byte aligned codes and a "
        "16-byte aligned output");
  }
  const int64_t groups = n / 8;
  DecodeBf16Kernel<<<GridFor((groups + kDecodeUnroll - 1) / kDecodeUnroll),
                     kThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(codes.typed_data()),
      static_cast<const uint8_t*>(scales.untyped_data()),
      reinterpret_cast<uint4*>(out->typed_data()), groups);
  return LaunchError("decode_bf16");
}

}  // namespace
}  // namespace jax_nvfp4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4DequantizeCuda, jax_nvfp4::DequantizeCuda,
    jax_nvfp4::DequantizeBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxNvfp4DecodeBf16Cuda, jax_nvfp4::DecodeBf16Cuda,
    jax_nvfp4::DecodeBf16Binding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
