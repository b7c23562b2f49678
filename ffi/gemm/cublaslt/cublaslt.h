// The cuBLASLt plumbing under the GEMM handlers' shared body (gemm_call.h):
// the bf16 GEMM with alpha in the epilogue for GPUs without FP4 tensor cores
// (bf16_gemm.cu, "jax_nvfp4_matmul_bf16"), the block-scaled FP4 GEMM on
// Blackwell (fp4_gemm.cu, "jax_nvfp4_matmul_fp4_sm100") and its grouped form
// (fp4_grouped_gemm.cu, "jax_nvfp4_grouped_gemm_fp4_sm100").
//
// * cuBLASLt is loaded when a handler first runs (dlopen), so the extension
//   has no link-time dependency on it and imports where it is absent. Lookup
//   order: $JAX_NVFP4_CUBLASLT (a path), then a libcublasLt already loaded in
//   the process (jaxlib's CUDA plugin loads it from the nvidia-cublas wheel),
//   then the dynamic loader's search for libcublasLt.so.13, .so.12, .so.
// * One cuBLASLt handle per device and the algorithms chosen by cuBLASLt's
//   heuristic, cached for the life of the process.
// * CUDA graphs: XLA may call a handler for the first time while it captures
//   the stream into a command buffer. The setup (dlopen, cublasLtCreate, the
//   heuristic) enqueues nothing on the stream, but cublasLtCreate may
//   allocate, which the capture's thread-local mode forbids; the setup runs
//   with this thread's capture mode relaxed (CaptureSafeSetup), and what is
//   enqueued (the alpha kernel, cublasLtMatmul on XLA's workspace) is
//   capturable. CaptureCounts says how often that happened (for tests).
// * The alpha kernel: alpha = (amax_a / 2688) * (amax_b / 2688) of each batch
//   item, with IEEE division as in the CPU handler (XLA would turn a division
//   by 2688 into an inexact multiplication), and beta = 0, written to the head
//   of the handler's workspace result (gemm_plan.h), where cuBLASLt's
//   device pointer mode reads them.
// * Errors: every failure becomes an ffi::Error that names the handler and,
//   for failures at run time, says how to bypass it.
#ifndef JAX_NVFP4_FFI_GEMM_CUBLASLT_CUBLASLT_H_
#define JAX_NVFP4_FFI_GEMM_CUBLASLT_CUBLASLT_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

// The cuBLASLt entry points used by the handlers, resolved with dlsym.
struct CublasLt {
  decltype(&cublasLtCreate) Create;
  decltype(&cublasLtGetVersion) GetVersion;
  decltype(&cublasLtGetStatusString) GetStatusString;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute;
  decltype(&cublasLtMatmulPreferenceCreate) PreferenceCreate;
  decltype(&cublasLtMatmulPreferenceDestroy) PreferenceDestroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) PreferenceSetAttribute;
  decltype(&cublasLtMatmulAlgoGetHeuristic) AlgoGetHeuristic;
  decltype(&cublasLtMatmul) Matmul;
  size_t version = 0;  // cublasLtGetVersion(), e.g. 130000
  std::string path;    // the file the symbols came from
};

// How a handler's errors read: "jax_nvfp4 (<target>): <message>", with
// `bypass` (a sentence saying how to run without the handler) appended to
// failures that happen at run time.
struct GemmErrors {
  const char* target;  // e.g. "matmul_bf16"
  const char* bypass;  // e.g. " To use ..., set JAX_NVFP4_..=0 before ..."

  ffi::Error Fail(ffi::ErrorCode code, const std::string& message) const;
  // Fail with the bypass hint appended.
  ffi::Error FailAtRunTime(ffi::ErrorCode code,
                           const std::string& message) const;
  ffi::Error Cuda(const char* what, cudaError_t err) const;
};

// The library, loaded once per process; kFailedPrecondition (saying how to
// install it) if it cannot be loaded or lacks a symbol.
ffi::Error LoadCublasLt(const GemmErrors& errors, const CublasLt** lt);

// Relaxes the calling thread's stream-capture mode for its lifetime
// (cudaThreadExchangeStreamCaptureMode), so that one-time setup that may
// allocate or query the device is legal inside a capture on this thread; a
// no-op cost outside captures.
class CaptureSafeSetup {
 public:
  CaptureSafeSetup();
  ~CaptureSafeSetup();
  CaptureSafeSetup(const CaptureSafeSetup&) = delete;
  CaptureSafeSetup& operator=(const CaptureSafeSetup&) = delete;

 private:
  cudaStreamCaptureMode previous_;
  bool exchanged_;
};

// How many GEMM handler calls ran while their stream was being captured into
// a CUDA graph, and how many one-time setups (a handle or a heuristic query)
// ran there; for tests (jax_nvfp4._ffi_testing.gemm_capture_counts, through
// the C functions at the end of cublaslt.cu).
struct CaptureCounts {
  int64_t captured_calls = 0;
  int64_t captured_setups = 0;
};
CaptureCounts GemmCaptureCounts();
// Records a handler call, or a setup, while its stream was being captured.
void CountCapturedCall();
void CountCapturedSetup();
// For tests: forgets every cached handle and algorithm, so that the next
// call does the whole setup again (the handles are leaked, not destroyed).
void ForgetGemmSetup();
// Whether the stream is being captured (false if the query fails).
bool StreamCapturing(cudaStream_t stream);

// The device the stream belongs to and its compute capability.
struct StreamDevice {
  int ordinal = 0;
  int major = 0;
  int minor = 0;
  bool capturing = false;  // the stream is being captured into a CUDA graph
};
ffi::Error GetStreamDevice(cudaStream_t stream, const GemmErrors& errors,
                           StreamDevice* device);

// Largest power of two, at most 256, that divides every value (addresses and
// byte strides; zeros are ignored): the alignment cuBLASLt may assume.
uint32_t CommonAlignment(std::initializer_list<uint64_t> values);
inline uint64_t Address(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

// A cuBLASLt call that failed: which one, and its status.
struct CublasFailure {
  const char* call = nullptr;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  // Records a call's status; false once a call has failed, so that a chain
  // `ok(...) && ok(...)` stops at the first failure.
  bool operator()(const char* name, cublasStatus_t s) {
    if (s != CUBLAS_STATUS_SUCCESS && call == nullptr) {
      call = name;
      status = s;
    }
    return call == nullptr;
  }
  // The error: the call, cuBLASLt's status string, the problem, the library
  // and the bypass hint.
  ffi::Error Error(const CublasLt& lt, const GemmErrors& errors,
                   const std::string& problem) const;
};

// The cuBLASLt descriptors of one handler call (destroyed with it): the
// operation, and the layouts of cuBLASLt's A, B and D (C shares D's).
struct MatmulDescriptors {
  const CublasLt* lt;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  explicit MatmulDescriptors(const CublasLt* l) : lt(l) {}
  ~MatmulDescriptors();
  MatmulDescriptors(const MatmulDescriptors&) = delete;
  MatmulDescriptors& operator=(const MatmulDescriptors&) = delete;

  template <typename T>
  cublasStatus_t Set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    return lt->MatmulDescSetAttribute(op, attribute, &value, sizeof(value));
  }
  // Creates the operation: compute CUBLAS_COMPUTE_32F, scale type
  // CUDA_R_32F, D = op(A) op(B) with op(A) = A^T ("TN"), alpha and beta
  // read from device memory.
  bool CreateTnOperation(CublasFailure& ok);
  // Creates a column-major rows x cols layout (leading dimension ld) in
  // `*layout`; batch > 1 makes it a strided batch, `stride` elements apart.
  bool CreateLayout(cublasLtMatrixLayout_t* layout, const char* name,
                    cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                    int64_t batch, int64_t stride, CublasFailure& ok);
};

// What cuBLASLt's heuristic choice depends on (besides the TN operation with
// device-pointer alpha/beta and float32 compute, which every handler uses, and
// the FP4 handlers' block-scale mode, implied by ab_type).
struct AlgoKey {
  int device;
  cudaDataType_t ab_type, d_type;
  int64_t m, n, k, batch;  // of cuBLASLt's D = n x m
  size_t workspace;
  uint32_t align_a, align_b, align_d;  // cuBLASLt's A, B and C = D
  int64_t ld;                          // A's and B's leading dimension
  bool operator<(const AlgoKey& o) const;
};

// The device's cuBLASLt handle (created on first use, with that device
// current) and the algorithm for the problem of `desc` (cached, else asked of
// cuBLASLt's heuristic with the key's alignments and workspace), the setup
// under CaptureSafeSetup. Returns false when a cuBLASLt call failed (see
// `ok`); `found` is false when the heuristic has no algorithm for the
// problem; `did_setup` is set when a handle was created or the heuristic
// asked.
bool HandleAndAlgo(const MatmulDescriptors& desc, const AlgoKey& key,
                   cublasLtHandle_t* handle, cublasLtMatmulAlgo_t* algo,
                   bool* found, CublasFailure& ok, bool* did_setup);

// Writes head[0] = beta = 0 and head[1 + i] = (a_amax[i * a_stride] / 2688) *
// (b_amax[i * b_stride] / 2688) for i < count, on the stream.
cudaError_t LaunchGemmAlphas(cudaStream_t stream, const float* a_amax,
                             int64_t a_stride, const float* b_amax,
                             int64_t b_stride, int64_t count, float* head);

// cuBLASLt's part of a handler's workspace result: it must be 256-byte
// aligned, and XLA aligns results less strictly, so it starts at the first
// 256-byte boundary after the head; its size, the `bytes_after_head` planned
// less 256 and rounded down to whole 4 KiB, is the same for any base address
// (it is part of the algorithm cache's key).
struct CublasWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
};
CublasWorkspace AlignedCublasWorkspace(void* head_end,
                                       int64_t bytes_after_head);

}  // namespace jax_nvfp4

#endif  // JAX_NVFP4_FFI_GEMM_CUBLASLT_CUBLASLT_H_
