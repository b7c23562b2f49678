// Helpers shared by the CPU handlers (ffi/cpu/*.cc): the subnormal mode,
// the split of a handler's work over XLA's intra-op thread pool and the choice
// of the kernels' instruction set. The handlers compute the bytes of
// numerics/nvfp4.h exactly; the CUDA kernels compute the same bytes.
#ifndef JAX_NVFP4_FFI_CPU_COMMON_H_
#define JAX_NVFP4_FFI_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif

// The x86 kernels of several instruction sets, chosen at run time (BestIsa),
// are built with GCC's target pragmas; elsewhere (other compilers, other
// architectures) the portable variant, compiled for the build's baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JAX_NVFP4_X86_KERNELS 1
#else
#define JAX_NVFP4_X86_KERNELS 0
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

// Runs body(chunk) for chunk = 0 .. chunks - 1, each exactly once, on the
// calling thread and on XLA's intra-op thread pool, and returns when all are
// done. Results must not depend on which thread runs a chunk: each chunk
// writes its own outputs (bytes and sums are the same for any split).
//
// The caller takes chunks itself and waits only for chunks that another
// thread has started, never for a task still queued: a pool whose threads are
// all busy (for example, with other handlers doing the same) just leaves the
// work to the caller, so no handler can wait forever on the pool. Tasks that
// start after the last chunk was taken return at once; they share ownership
// of the state, which outlives the call.
class ParallelRun {
 public:
  template <typename Body>
  static void Run(ffi::ThreadPool& pool, int64_t chunks, const Body& body) {
    if (chunks <= 0) return;
    const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
    if (helpers <= 0) {
      for (int64_t c = 0; c < chunks; ++c) body(c);
      return;
    }
    auto state =
        std::make_shared<State>(chunks, [&body](int64_t c) { body(c); });
    for (int64_t t = 0; t < helpers; ++t) {
      pool.Schedule([state] {
        const ScopedFlushSubnormals flush_subnormals;  // a pool thread's mode
        state->Work();
      });
    }
    state->Work();
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->finished.load() == chunks; });
  }

 private:
  struct State {
    State(int64_t n, std::function<void(int64_t)> f)
        : chunks(n), run(std::move(f)) {}
    // Takes chunks until none is left. `run` is called only for a chunk
    // taken before the caller's wait ends, so the body it refers to is alive.
    void Work() {
      for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
        run(c);
        if (finished.fetch_add(1) + 1 == chunks) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }
    const int64_t chunks;
    const std::function<void(int64_t)> run;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    std::mutex mu;
    std::condition_variable cv;
  };
};

template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t chunks, const Body& body) {
  ParallelRun::Run(pool, chunks, body);
}

// How many chunks to split `items` units of work into: about `per_thread`
// chunks for each thread that may run them (load balance), none smaller than
// `min_items` units (scheduling costs a few microseconds).
inline int64_t ChunkCount(ffi::ThreadPool& pool, int64_t items,
                          int64_t min_items, int64_t per_thread = 16) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t by_size =
      std::max<int64_t>(1, items / std::max<int64_t>(1, min_items));
  return std::max<int64_t>(
      1, std::min(items, std::min(by_size, threads * per_thread)));
}

// Calls body(b, first, last) over the tiles of an input [batch, m, k] in
// chunks of whole tile rows (16 rows of x, all of k), first <= tile row < last
// of batch item b; every tile row of every item once.
template <typename Body>
void ForTileRows(ffi::ThreadPool& pool, const MatrixDims& d, const Body& body) {
  const int64_t tile_rows = (d.m + 15) / 16;
  const int64_t total = d.batch * tile_rows;
  if (total == 0 || d.k == 0) return;
  // About 16K elements a chunk at least.
  const int64_t chunks =
      ChunkCount(pool, total, std::max<int64_t>(1, 1024 / d.k));
  const int64_t size = (total + chunks - 1) / chunks;
  const int64_t per_item = (tile_rows + size - 1) / size;
  ParallelFor(pool, d.batch * per_item, [&](int64_t c) {
    const int64_t b = c / per_item;
    const int64_t first = (c % per_item) * size;
    body(b, first, std::min(first + size, tile_rows));
  });
}

// The instruction set the kernels (cpu/*_kernels.inc) are compiled for, chosen
// once per process: the best the CPU supports, or a lower one named by
// JAX_NVFP4_CPU_KERNELS (base, avx2, avx512; for tests and comparisons).
// Every variant computes the same bytes and sums (the kernel files say why).
enum class Isa { kBase, kAvx2, kAvx512 };

inline Isa BestIsa() {
#if JAX_NVFP4_X86_KERNELS
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa best = Isa::kBase;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")) {
      best = Isa::kAvx2;
      if (__builtin_cpu_supports("avx512f") &&
          __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512vl")) {
        best = Isa::kAvx512;
      }
    }
    const char* asked = std::getenv("JAX_NVFP4_CPU_KERNELS");
    const std::string name = asked != nullptr ? asked : "";
    const Isa wanted = name == "base"   ? Isa::kBase
                       : name == "avx2" ? Isa::kAvx2
                                        : Isa::kAvx512;
    return std::min(best, wanted);
  }();
  return isa;
#else
  return Isa::kBase;
#endif
}

// Calls fn of the kernel variant BestIsa() chose (cpu/isa_variants.inc).
#if JAX_NVFP4_X86_KERNELS
#define JAX_NVFP4_CALL_KERNEL(fn, ...)                     \
  (BestIsa() == Isa::kAvx512 ? isa_avx512::fn(__VA_ARGS__) \
   : BestIsa() == Isa::kAvx2 ? isa_avx2::fn(__VA_ARGS__)   \
                             : isa_base::fn(__VA_ARGS__))
#else
#define JAX_NVFP4_CALL_KERNEL(fn, ...) isa_base::fn(__VA_ARGS__)
#endif

// A float16 input element (its bits), a type of its own for the kernels.
struct Float16Bits {
  uint16_t bits;
};

// One batch item of a quantize or amax input x [m, k], row-major.
struct MatrixInput {
  const void* data;
  ffi::DataType type;  // F32, BF16 or F16
  int64_t m;
  int64_t k;
};

// One quantized output of one batch item: codes [rows, len/2] and scale
// bytes [rows, len/16], quantized along k (rows = m) or, for a column-wise
// output, along m (rows = k). Element (r, l) draws its stochastic-rounding
// bits at flat index index_base + r * index_row_stride + l of the whole
// quantized tensor.
struct QuantizeTarget {
  QuantizeOptions options;
  GlobalScale scale;
  uint32_t key0;
  uint32_t key1;
  uint64_t index_base;
  int64_t index_row_stride;
  uint8_t* codes;
  uint8_t* scales;
};

}  // namespace cpu
}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_CPU_COMMON_H_
