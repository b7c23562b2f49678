// Helpers shared by the CPU handlers (ffi/cpu/*.cc): the exact reference
// implementation of every handler, straightforward loops over the arithmetic
// of numerics/nvfp4.h; the CUDA kernels compute the same bytes.
#ifndef JAX_NVFP4_FFI_CPU_COMMON_H_
#define JAX_NVFP4_FFI_CPU_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "checks.h"
#include "numerics/nvfp4.h"
#include "options.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace cpu {

// Float32 subnormals flushed to zero, as inputs and results (FTZ and DAZ;
// see numerics/nvfp4.h), for the lifetime of the object; the previous mode
// is restored after. XLA runs its CPU computations in this mode already; the
// handlers set it themselves so that their bytes do not depend on the
// calling thread. x86-64 and AArch64 only (elsewhere the thread's mode,
// XLA's, applies). No compiler promises not to move float arithmetic across
// the mode switch without FENV_ACCESS; the work here reads and writes the
// XLA buffers between the switches, which keeps it in place in practice (and
// the thread's mode is XLA's flushing one anyway).
class ScopedFlushSubnormals {
 public:
  ScopedFlushSubnormals() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero);
#elif defined(__aarch64__)
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    asm volatile("msr fpcr, %0" : : "r"(fpcr | kFlushToZeroArm));
#endif
  }
  ~ScopedFlushSubnormals() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    _mm_setcsr(static_cast<unsigned int>(saved_));
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedFlushSubnormals(const ScopedFlushSubnormals&) = delete;
  ScopedFlushSubnormals& operator=(const ScopedFlushSubnormals&) = delete;

 private:
  static constexpr unsigned int kFlushToZero = 1u << 15;      // MXCSR.FTZ
  static constexpr unsigned int kDenormalsAreZero = 1u << 6;  // MXCSR.DAZ
  static constexpr uint64_t kFlushToZeroArm = 1ull << 24;     // FPCR.FZ
  uint64_t saved_ = 0;
};

inline float LoadAsFloat(const void* data, ffi::DataType type, int64_t i) {
  switch (type) {
    case ffi::DataType::BF16:
      return Bfloat16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case ffi::DataType::F16:
      return Float16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

// The [rows, len] float matrix that one output quantizes along len: x[b] for
// a row-wise output, x[b] transposed for a column-wise one (`cols`); with the
// Random Hadamard Transform applied to each 16-chunk along len when asked.
inline std::vector<float> OrientedMatrix(const ffi::AnyBuffer& x, int64_t b,
                                         const MatrixDims& d, bool cols,
                                         bool rht) {
  const int64_t rows = cols ? d.k : d.m;
  const int64_t len = cols ? d.m : d.k;
  const void* data = x.untyped_data();
  const int64_t base = b * d.m * d.k;
  std::vector<float> q(rows * len);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t l = 0; l < len; ++l) {
      const int64_t src = cols ? l * d.k + r : r * d.k + l;
      q[r * len + l] = LoadAsFloat(data, x.element_type(), base + src);
    }
  }
  if (rht) {
    for (int64_t c = 0; c < rows * len; c += kBlock) {
      float y[kBlock];
      RandomHadamard16(&q[c], y);
      std::copy(y, y + kBlock, &q[c]);
    }
  }
  return q;
}

// out[flat] = value, rounded to out's type (float32 or bfloat16).
inline void StoreFloat(ffi::AnyBuffer& out, int64_t flat, float value) {
  if (out.element_type() == ffi::DataType::F32) {
    static_cast<float*>(out.untyped_data())[flat] = value;
  } else {
    static_cast<uint16_t*>(out.untyped_data())[flat] =
        FloatToBfloat16Bits(value);
  }
}

}  // namespace cpu
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CPU_COMMON_H_
