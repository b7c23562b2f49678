// One operand / result / attribute list per FFI target (ffi/targets.inc),
// shared by the CPU and the CUDA handler of the target. Each function takes
// the binder to extend: ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() on the CPU
// (XLA's intra-op threads), and
// ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>() on CUDA (the
// context comes first), e.g.
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(
//       JaxNvfp4AmaxCpu, AmaxCpu,
//       AmaxBinding(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));
#ifndef JAX_NVFP4_FFI_BINDINGS_H_
#define JAX_NVFP4_FFI_BINDINGS_H_

#include <utility>

#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = xla::ffi;

// jax_nvfp4_quantize_rows ("rows": codes [b, m, k/2], quantized along k) and
// jax_nvfp4_quantize_cols ("cols": codes [b, k, m/2], quantized along m).
// `side` names the QuantizeOptions attribute: "rows" or "cols".
template <typename Binder>
auto QuantizeBinding(Binder binder, const char* side) {
  return std::move(binder)
      .template Arg<ffi::AnyBuffer>()         // x [b, m, k] f32/bf16/f16
      .template Arg<ffi::Buffer<ffi::F32>>()  // amax [n], n divides b
      .template Arg<ffi::Buffer<ffi::U32>>()  // key [n, 2], n divides b
      .template Arg<ffi::Buffer<ffi::S32>>()  // origin [3]: (b0, m0, k0)
      .template Ret<ffi::Buffer<ffi::U8>>()   // codes [b, rows, len/2]
      .template Ret<ffi::AnyBuffer>()         // e4m3 scales [b, rows, len/16]
      .template Attr<QuantizeOptions>(side)   // how the output is made
      .template Attr<GlobalPlace>("place");   // the shard's place
}

// jax_nvfp4_quantize_rows_cols: both outputs of one x; either side's codes
// may be its bfloat16 values instead (QuantizeOptions::decoded).
template <typename Binder>
auto QuantizeRowsColsBinding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::AnyBuffer>()         // x [b, m, k] f32/bf16/f16
      .template Arg<ffi::Buffer<ffi::F32>>()  // row amax [n]
      .template Arg<ffi::Buffer<ffi::F32>>()  // col amax [n]
      .template Arg<ffi::Buffer<ffi::U32>>()  // key [n, 2]
      .template Arg<ffi::Buffer<ffi::S32>>()  // origin [3]: (b0, m0, k0)
      // row codes u8 [b, m, k/2], or rows.decoded: bf16 values [b, m, k]
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()  // row scales [b, m, k/16]
      // col codes u8 [b, k, m/2], or cols.decoded: bf16 values [b, k, m]
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()          // col scales [b, k, m/16]
      .template Attr<QuantizeOptions>("rows")  // the row-wise output
      .template Attr<QuantizeOptions>("cols")  // the column-wise output
      .template Attr<GlobalPlace>("place");    // the shard's place
}

// jax_nvfp4_amax: (max |x[b]|, max |bf16(RHT(x[b]))|) per batch item.
template <typename Binder>
auto AmaxBinding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::AnyBuffer>()         // x [b, m, k] f32/bf16/f16
      .template Ret<ffi::Buffer<ffi::F32>>()  // [b, 2]
      // false: the RHT 16-chunks run along k (as quantize_rows transforms);
      // true: along m (as quantize_cols).
      .template Attr<bool>("cols");
}

// jax_nvfp4_dequantize: e2m1(code) * s_b * amax / 2688.
template <typename Binder>
auto DequantizeBinding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::U8>>()   // codes [b, r, l/2]
      .template Arg<ffi::AnyBuffer>()         // e4m3 scales [b, r, l/16]
      .template Arg<ffi::Buffer<ffi::F32>>()  // amax [n], n divides b
      .template Ret<ffi::AnyBuffer>();        // [b, r, l] f32 or bf16
}

// jax_nvfp4_matmul (CPU): out = alpha * e2m1(a) s_a . e2m1(b)^T s_b.
template <typename Binder>
auto MatmulBinding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::U8>>()   // a codes [b, m, k/2]
      .template Arg<ffi::AnyBuffer>()         // a scales [b, m, k/16]
      .template Arg<ffi::Buffer<ffi::F32>>()  // a amax [1|b]
      .template Arg<ffi::Buffer<ffi::U8>>()   // b codes [1|b, n, k/2]
      .template Arg<ffi::AnyBuffer>()         // b scales [1|b, n, k/16]
      .template Arg<ffi::Buffer<ffi::F32>>()  // b amax [1|b's batch]
      .template Ret<ffi::AnyBuffer>();        // [b, m, n] f32 or bf16
}

// jax_nvfp4_decode_bf16 (CUDA): e2m1(code) * s_b as bfloat16, no amax.
template <typename Binder>
auto DecodeBf16Binding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::U8>>()     // codes [n/2]
      .template Arg<ffi::AnyBuffer>()           // e4m3 scales [n/16]
      .template Ret<ffi::Buffer<ffi::BF16>>();  // values [n]
}

// jax_nvfp4_matmul_bf16 and jax_nvfp4_matmul_bf16_graph (CUDA, cuBLASLt).
template <typename Binder>
auto MatmulBf16Binding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // a [b, M, K], e2m1 * scale
      .template Arg<ffi::Buffer<ffi::BF16>>()  // b [1|b, N, K], likewise
      .template Arg<ffi::Buffer<ffi::F32>>()   // a amax [1|b]
      .template Arg<ffi::Buffer<ffi::F32>>()   // b amax [1|b's batch]
      .template Ret<ffi::AnyBuffer>()          // out [b, M, N], bf16 or f32
      .template Ret<ffi::Buffer<ffi::U8>>();   // workspace: beta, alphas,
                                               // cuBLASLt's
}

// jax_nvfp4_matmul_fp4_sm100 (CUDA, cuBLASLt on Blackwell).
template <typename Binder>
auto MatmulFp4Binding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::U8>>()   // a codes [b, M, K/2], padded
      .template Arg<ffi::Buffer<ffi::U8>>()   // a scales [b, M*K/16], swizzled
      .template Arg<ffi::Buffer<ffi::F32>>()  // a amax [1|b]
      .template Arg<ffi::Buffer<ffi::U8>>()   // b codes [1|b, N, K/2], padded
      .template Arg<ffi::Buffer<ffi::U8>>()  // b scales [1|b, N*K/16], swizzled
      .template Arg<ffi::Buffer<ffi::F32>>()  // b amax [1|b]
      .template Ret<ffi::AnyBuffer>()         // out [b, M, N], bf16 or f32
      .template Ret<ffi::Buffer<ffi::U8>>();  // workspace: beta, alphas,
                                              // cuBLASLt's
}

// jax_nvfp4_grouped_gemm_fp4_sm100 (CUDA, cuBLASLt on Blackwell): ragged_dot's
// GEMMs on FP4 codes, one launch per group
// (gemm/cublaslt/fp4_grouped_gemm_plan.h).
template <typename Binder>
auto GroupedGemmFp4Binding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::U8>>()   // a codes: rows [R, K/2];
                                              // tokens [M, R/2]
      .template Arg<ffi::Buffer<ffi::U8>>()   // a scales, swizzled
      .template Arg<ffi::Buffer<ffi::U8>>()   // b codes: rows [G, N, K/2];
                                              // tokens [N, R/2]
      .template Arg<ffi::Buffer<ffi::U8>>()   // b scales, swizzled
      .template Arg<ffi::Buffer<ffi::S32>>()  // padded group sizes [G]
      .template Arg<ffi::Buffer<ffi::F32>>()  // a amax [G]
      .template Arg<ffi::Buffer<ffi::F32>>()  // b amax [G]
      .template Ret<ffi::AnyBuffer>()         // rows [R, N]; tokens [G, M, N]
      .template Ret<ffi::Buffer<ffi::U8>>()   // workspace: beta, alphas,
                                              // cuBLASLt's
      .template Attr<bool>("tokens");         // the form: rows or tokens
}

// jax_nvfp4_grouped_gemm_bf16 (CUDA): ragged_dot's grouped GEMM on decoded
// operands (ffi/gemm/mma/bf16_grouped_gemm.cu). Also
// jax_nvfp4_grouped_gemm_sm90, the same GEMM on the Hopper engine
// (ffi/gemm/engine/grouped_gemm.cu), whose tokens form takes a [lines, M,
// 64] and b [lines, N, 64] (64 tokens a line).
template <typename Binder>
auto GroupedGemmBf16Binding(Binder binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // a: rows [R, L]; tokens
                                               // [items, M, 16]
      .template Arg<ffi::Buffer<ffi::BF16>>()  // b: rows [G, N, L]; tokens
                                               // [items, N, 16]
      .template Arg<ffi::Buffer<ffi::S32>>()   // sizes [G], multiples of 16
      .template Arg<ffi::Buffer<ffi::F32>>()   // alpha [G]
      .template Ret<ffi::AnyBuffer>()          // rows [R, N]; tokens [G, M, N]
      .template Attr<bool>("tokens");          // the form: rows or tokens
}

// jax_nvfp4_matmul_w4a16_sm90 (CUDA): bf16 x times an NVFP4 weight decoded
// in registers on the Hopper engine (ffi/gemm/engine/w4a16_gemm.cu).
template <typename Binder>
auto MatmulW4A16Sm90Binding(Binder&& binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
      .template Arg<ffi::Buffer<ffi::U8>>()    // w codes [N, K/2]
      .template Arg<ffi::AnyBuffer>()          // w e4m3 scales [N, K/16]
      .template Arg<ffi::Buffer<ffi::F32>>()   // w amax [1]
      .template Ret<ffi::AnyBuffer>();         // out [M, N]
}

// jax_nvfp4_ragged_w4a16_sm90 (CUDA): the grouped form, x's rows in groups,
// group g's times weight g (ffi/gemm/engine/w4a16_gemm.cu).
template <typename Binder>
auto RaggedW4A16Sm90Binding(Binder&& binder) {
  return std::move(binder)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // x [T, K]
      .template Arg<ffi::Buffer<ffi::U8>>()    // w codes [G, N, K/2]
      .template Arg<ffi::AnyBuffer>()          // w e4m3 scales [G, N, K/16]
      .template Arg<ffi::Buffer<ffi::F32>>()   // w amax [G]
      .template Arg<ffi::Buffer<ffi::S32>>()   // group_sizes [G]
      .template Ret<ffi::AnyBuffer>();         // out [T, N]
}

// jax_nvfp4_matmul_w4a16 (CUDA): the same product by the mma.sync kernel
// (ffi/gemm/mma/w4a16_gemm.cu), which also takes a workspace.
template <typename Binder>
auto MatmulW4A16Binding(Binder binder) {
  return MatmulW4A16Sm90Binding(std::move(binder))
      .template Ret<ffi::Buffer<ffi::U8>>();  // workspace (plan_w4a16)
}

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_BINDINGS_H_
