// The cuBLASLt plumbing shared by the GEMM handlers (see cublaslt.h).
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "gemm/cublaslt/cublaslt.h"
#include "numerics/nvfp4.h"

namespace jax_nvfp4 {
namespace {

std::string DlError() {
  const char* e = dlerror();
  return e ? e : "unknown error";
}

template <typename F>
bool Resolve(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) *error = std::string("symbol ") + name + " is missing";
  return *fn != nullptr;
}

// Opens libcublasLt; returns nullptr and says why in `error`.
void* OpenCublasLt(std::string* error) {
  if (const char* path = std::getenv("JAX_NVFP4_CUBLASLT"); path && *path) {
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      *error = "JAX_NVFP4_CUBLASLT=" + std::string(path) + ": " + DlError();
    }
    return lib;
  }
  const char* names[] = {"libcublasLt.so.13", "libcublasLt.so.12",
                         "libcublasLt.so"};
  for (const char* name : names) {  // already in the process?
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
      return lib;
    }
  }
  std::string tried;
  for (const char* name : names) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return lib;
    tried += std::string(tried.empty() ? "" : "; ") + DlError();
  }
  *error = tried;
  return nullptr;
}

// Loads the library into `lt`; false and why (without a bypass hint) if not.
bool Load(CublasLt* lt, std::string* error) {
  void* lib = OpenCublasLt(error);
  if (lib == nullptr) {
    *error = "cannot load cuBLASLt (" + *error +
             "). Install it (pip install nvidia-cublas, which jax[cuda13] "
             "brings) or set JAX_NVFP4_CUBLASLT to the path of "
             "libcublasLt.so.";
    return false;
  }
  std::string missing;
  const bool ok =
      Resolve(lib, "cublasLtCreate", &lt->Create, &missing) &&
      Resolve(lib, "cublasLtGetVersion", &lt->GetVersion, &missing) &&
      Resolve(lib, "cublasLtGetStatusString", &lt->GetStatusString, &missing) &&
      Resolve(lib, "cublasLtMatmulDescCreate", &lt->MatmulDescCreate,
              &missing) &&
      Resolve(lib, "cublasLtMatmulDescDestroy", &lt->MatmulDescDestroy,
              &missing) &&
      Resolve(lib, "cublasLtMatmulDescSetAttribute",
              &lt->MatmulDescSetAttribute, &missing) &&
      Resolve(lib, "cublasLtMatrixLayoutCreate", &lt->MatrixLayoutCreate,
              &missing) &&
      Resolve(lib, "cublasLtMatrixLayoutDestroy", &lt->MatrixLayoutDestroy,
              &missing) &&
      Resolve(lib, "cublasLtMatrixLayoutSetAttribute",
              &lt->MatrixLayoutSetAttribute, &missing) &&
      Resolve(lib, "cublasLtMatmulPreferenceCreate", &lt->PreferenceCreate,
              &missing) &&
      Resolve(lib, "cublasLtMatmulPreferenceDestroy", &lt->PreferenceDestroy,
              &missing) &&
      Resolve(lib, "cublasLtMatmulPreferenceSetAttribute",
              &lt->PreferenceSetAttribute, &missing) &&
      Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &lt->AlgoGetHeuristic,
              &missing) &&
      Resolve(lib, "cublasLtMatmul", &lt->Matmul, &missing);
  Dl_info info;
  lt->path = (ok && dladdr(reinterpret_cast<void*>(lt->Matmul), &info) &&
              info.dli_fname)
                 ? info.dli_fname
                 : "libcublasLt";
  if (!ok) {
    *error = "the loaded cuBLASLt is unusable: " + missing +
             ". Install cuBLAS 12 or newer (pip install nvidia-cublas).";
    return false;
  }
  lt->version = lt->GetVersion();
  return true;
}

// Per-device cuBLASLt handles and the algorithms chosen so far, created on
// first use and kept for the life of the process (never destroyed: handlers
// may run until the process exits); guarded by cache_mutex.
std::mutex cache_mutex;
std::map<int, cublasLtHandle_t>& Handles() {
  static auto* handles = new std::map<int, cublasLtHandle_t>();
  return *handles;
}
std::map<AlgoKey, cublasLtMatmulAlgo_t>& Algos() {
  static auto* algos = new std::map<AlgoKey, cublasLtMatmulAlgo_t>();
  return *algos;
}

// The device's handle, created with that device current. Call with
// cache_mutex held.
bool DeviceHandle(const CublasLt& lt, int device, cublasLtHandle_t* handle,
                  CublasFailure& ok) {
  auto& handles = Handles();
  if (auto it = handles.find(device); it != handles.end()) {
    *handle = it->second;
    return true;
  }
  int current = -1;
  const bool switch_device =
      cudaGetDevice(&current) == cudaSuccess && current != device;
  if (switch_device) cudaSetDevice(device);
  const cublasStatus_t status = lt.Create(handle);
  if (switch_device) cudaSetDevice(current);
  if (!ok("cublasLtCreate", status)) return false;
  handles[device] = *handle;
  return true;
}

// Asks cuBLASLt's heuristic for its best algorithm; `found` is false when it
// has none for this problem.
bool Heuristic(cublasLtHandle_t handle, const MatmulDescriptors& desc,
               const AlgoKey& key, cublasLtMatmulAlgo_t* algo, bool* found,
               CublasFailure& ok) {
  const CublasLt& lt = *desc.lt;
  cublasLtMatmulPreference_t preference = nullptr;
  if (!ok("cublasLtMatmulPreferenceCreate", lt.PreferenceCreate(&preference))) {
    return false;
  }
  auto pref = [&](cublasLtMatmulPreferenceAttributes_t attribute,
                  const auto& value) {
    return lt.PreferenceSetAttribute(preference, attribute, &value,
                                     sizeof(value));
  };
  cublasLtMatmulHeuristicResult_t result = {};
  int count = 0;
  // Split K only with the partial sums kept in float32: the in-place and
  // output-type schemes round them to the output type (bfloat16) before the
  // final sum, and the spec rounds once.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  const bool success =
      ok("cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)",
         pref(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction)) &&
      ok("cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
         pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, key.workspace)) &&
      ok("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)",
         pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a)) &&
      ok("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)",
         pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b)) &&
      ok("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)",
         pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d)) &&
      ok("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_D_BYTES)",
         pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d)) &&
      ok("cublasLtMatmulAlgoGetHeuristic",
         lt.AlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d,
                             preference, 1, &result, &count));
  lt.PreferenceDestroy(preference);
  *found = success && count > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  if (*found) *algo = result.algo;
  return success;
}

// head[0] = beta = 0; head[1 + i] = alpha of batch item i, in the order of
// the spec (DESIGN.md "GEMM") and of the CPU handler.
__global__ void AlphaKernel(const float* a_amax, int64_t a_stride,
                            const float* b_amax, int64_t b_stride,
                            int64_t count, float* head) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i == 0) head[0] = 0.0f;
  if (i < count) {
    head[1 + i] = (a_amax[i * a_stride] / kScaleRange) *
                  (b_amax[i * b_stride] / kScaleRange);
  }
}

}  // namespace

ffi::Error GemmErrors::Fail(ffi::ErrorCode code,
                            const std::string& message) const {
  return ffi::Error(code,
                    std::string("jax_nvfp4 (") + target + "): " + message);
}

ffi::Error GemmErrors::FailAtRunTime(ffi::ErrorCode code,
                                     const std::string& message) const {
  return Fail(code, message + bypass);
}

ffi::Error GemmErrors::Cuda(const char* what, cudaError_t err) const {
  return FailAtRunTime(
      ffi::ErrorCode::kInternal,
      std::string(what) + " failed: " + cudaGetErrorString(err) + ".");
}

CaptureSafeSetup::CaptureSafeSetup()
    : previous_(cudaStreamCaptureModeRelaxed),
      exchanged_(cudaThreadExchangeStreamCaptureMode(&previous_) ==
                 cudaSuccess) {}

CaptureSafeSetup::~CaptureSafeSetup() {
  if (exchanged_) cudaThreadExchangeStreamCaptureMode(&previous_);
}

namespace {
std::atomic<int64_t> captured_calls{0}, captured_setups{0};
}  // namespace

CaptureCounts GemmCaptureCounts() {
  return {captured_calls.load(), captured_setups.load()};
}

void CountCapturedCall() { captured_calls.fetch_add(1); }

void CountCapturedSetup() { captured_setups.fetch_add(1); }

bool StreamCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

ffi::Error LoadCublasLt(const GemmErrors& errors, const CublasLt** lt) {
  static std::once_flag once;
  static CublasLt library;
  static bool loaded = false;
  static std::string load_error;
  std::call_once(once, [] {
    const CaptureSafeSetup relaxed;
    loaded = Load(&library, &load_error);
  });
  if (!loaded) {
    return errors.FailAtRunTime(ffi::ErrorCode::kFailedPrecondition,
                                load_error);
  }
  *lt = &library;
  return ffi::Error::Success();
}

ffi::Error GetStreamDevice(cudaStream_t stream, const GemmErrors& errors,
                           StreamDevice* device) {
#if CUDART_VERSION >= 12080
  // While XLA captures the stream into a CUDA graph (command buffers),
  // cudaStreamGetDevice is not permitted; the calling thread's current
  // device is the stream's then (XLA sets it).
  device->capturing = StreamCapturing(stream);
  if (!device->capturing) {
    if (cudaError_t err = cudaStreamGetDevice(stream, &device->ordinal);
        err != cudaSuccess) {
      return errors.Cuda("cudaStreamGetDevice", err);
    }
  } else if (cudaError_t err = cudaGetDevice(&device->ordinal);
             err != cudaSuccess) {
    return errors.Cuda("cudaGetDevice", err);
  }
#else
  device->capturing = StreamCapturing(stream);
  if (cudaError_t err = cudaGetDevice(&device->ordinal); err != cudaSuccess) {
    return errors.Cuda("cudaGetDevice", err);
  }
#endif
  if (cudaError_t err = cudaDeviceGetAttribute(
          &device->major, cudaDevAttrComputeCapabilityMajor, device->ordinal);
      err != cudaSuccess) {
    return errors.Cuda("cudaDeviceGetAttribute", err);
  }
  if (cudaError_t err = cudaDeviceGetAttribute(
          &device->minor, cudaDevAttrComputeCapabilityMinor, device->ordinal);
      err != cudaSuccess) {
    return errors.Cuda("cudaDeviceGetAttribute", err);
  }
  return ffi::Error::Success();
}

uint32_t CommonAlignment(std::initializer_list<uint64_t> values) {
  uint32_t alignment = 256;
  for (uint64_t v : values) {
    while (alignment > 1 && v % alignment != 0) alignment /= 2;
  }
  return alignment;
}

ffi::Error CublasFailure::Error(const CublasLt& lt, const GemmErrors& errors,
                                const std::string& problem) const {
  return errors.FailAtRunTime(
      ffi::ErrorCode::kInternal,
      std::string(call) + " failed: " + lt.GetStatusString(status) + " (" +
          problem + ", cuBLASLt " + std::to_string(lt.version) + " from " +
          lt.path + ").");
}

MatmulDescriptors::~MatmulDescriptors() {
  if (d) lt->MatrixLayoutDestroy(d);
  if (b) lt->MatrixLayoutDestroy(b);
  if (a) lt->MatrixLayoutDestroy(a);
  if (op) lt->MatmulDescDestroy(op);
}

bool MatmulDescriptors::CreateTnOperation(CublasFailure& ok) {
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  const cublasLtPointerMode_t pointer_mode = CUBLASLT_POINTER_MODE_DEVICE;
  return ok("cublasLtMatmulDescCreate",
            lt->MatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) &&
         ok("cublasLtMatmulDescSetAttribute(TRANSA)",
            Set(CUBLASLT_MATMUL_DESC_TRANSA, trans_a)) &&
         ok("cublasLtMatmulDescSetAttribute(TRANSB)",
            Set(CUBLASLT_MATMUL_DESC_TRANSB, trans_b)) &&
         ok("cublasLtMatmulDescSetAttribute(POINTER_MODE)",
            Set(CUBLASLT_MATMUL_DESC_POINTER_MODE, pointer_mode));
}

bool MatmulDescriptors::CreateLayout(cublasLtMatrixLayout_t* layout,
                                     const char* name, cudaDataType_t type,
                                     int64_t rows, int64_t cols, int64_t ld,
                                     int64_t batch, int64_t stride,
                                     CublasFailure& ok) {
  if (!ok(name, lt->MatrixLayoutCreate(layout, type, rows, cols, ld))) {
    return false;
  }
  if (batch <= 1) return true;
  const int32_t count = static_cast<int32_t>(batch);  // checked by the plan
  return ok("cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)",
            lt->MatrixLayoutSetAttribute(*layout,
                                         CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                         &count, sizeof(count))) &&
         ok("cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)",
            lt->MatrixLayoutSetAttribute(
                *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                sizeof(stride)));
}

bool AlgoKey::operator<(const AlgoKey& o) const {
  return std::tie(device, ab_type, d_type, m, n, k, batch, workspace, align_a,
                  align_b, align_d, ld) <
         std::tie(o.device, o.ab_type, o.d_type, o.m, o.n, o.k, o.batch,
                  o.workspace, o.align_a, o.align_b, o.align_d, o.ld);
}

void ForgetGemmSetup() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  Handles().clear();
  Algos().clear();
}

bool HandleAndAlgo(const MatmulDescriptors& desc, const AlgoKey& key,
                   cublasLtHandle_t* handle, cublasLtMatmulAlgo_t* algo,
                   bool* found, CublasFailure& ok, bool* did_setup) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  *found = false;
  *did_setup = false;
  auto& algos = Algos();
  const auto cached = algos.find(key);
  const auto known = Handles().find(key.device);
  if (known != Handles().end() && cached != algos.end()) {
    *handle = known->second;
    *algo = cached->second;
    *found = true;
    return true;
  }
  *did_setup = true;
  const CaptureSafeSetup relaxed;
  if (!DeviceHandle(*desc.lt, key.device, handle, ok)) return false;
  if (cached != algos.end()) {
    *algo = cached->second;
    *found = true;
    return true;
  }
  if (!Heuristic(*handle, desc, key, algo, found, ok)) return false;
  if (*found) algos.emplace(key, *algo);
  return true;
}

cudaError_t LaunchGemmAlphas(cudaStream_t stream, const float* a_amax,
                             int64_t a_stride, const float* b_amax,
                             int64_t b_stride, int64_t count, float* head) {
  constexpr int kThreads = 256;
  const int64_t blocks = count > 0 ? (count + kThreads - 1) / kThreads : 1;
  AlphaKernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      a_amax, a_stride, b_amax, b_stride, count, head);
  return cudaGetLastError();
}

CublasWorkspace AlignedCublasWorkspace(void* head_end,
                                       int64_t bytes_after_head) {
  constexpr uint64_t kAlign = 256, kPage = 4096;
  CublasWorkspace w;
  if (bytes_after_head <= static_cast<int64_t>(kAlign)) return w;
  const uint64_t start = (Address(head_end) + kAlign - 1) / kAlign * kAlign;
  w.data = reinterpret_cast<void*>(static_cast<uintptr_t>(start));
  w.bytes = static_cast<size_t>(
      (static_cast<uint64_t>(bytes_after_head) - kAlign) / kPage * kPage);
  if (w.bytes == 0) w.data = nullptr;
  return w;
}

}  // namespace jax_nvfp4

// For tests: jax_nvfp4._ffi_testing.forget_gemm_setup and gemm_capture_counts
// (testing_module.cc) find these in the extension jax_nvfp4._ffi, whose
// handlers hold the caches and counts, by name: exported, unlike the rest.
extern "C" __attribute__((visibility("default"))) void
JaxNvfp4ForgetGemmSetup() {
  jax_nvfp4::ForgetGemmSetup();
}

extern "C" __attribute__((visibility("default"))) void
JaxNvfp4GemmCaptureCounts(int64_t* calls, int64_t* setups) {
  const jax_nvfp4::CaptureCounts counts = jax_nvfp4::GemmCaptureCounts();
  *calls = counts.captured_calls;
  *setups = counts.captured_setups;
}
