// The body of the cuBLASLt GEMM handlers (gemm_call.h).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "gemm/cublaslt/cublaslt.h"
#include "gemm/cublaslt/gemm_call.h"
#include "gemm/cublaslt/gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
namespace {

// VEC16_UE4M3 block scales appeared in cuBLASLt 12.8.
constexpr size_t kMinFp4CublasLtVersion = 120800;

bool Aligned(const void* p, uint32_t bytes) {
  return p != nullptr && CommonAlignment({Address(p)}) >= bytes;
}

const uint8_t* At(const void* base, int64_t bytes) {
  return static_cast<const uint8_t*>(base) + bytes;
}

std::string DeviceName(const StreamDevice& d) {
  return "device " + std::to_string(d.ordinal) + " is " +
         std::to_string(d.major) + "." + std::to_string(d.minor);
}

// One call's state through the steps of RunGemmCall.
class GemmCall {
 public:
  GemmCall(const GemmHandler& handler, cudaStream_t stream,
           const GemmCallPlan& plan, const GemmOperands& operands,
           ffi::AnyBuffer out, ffi::Buffer<ffi::U8> workspace)
      : errors_(handler.errors),
        ab_type_(handler.ab_type),
        fp4_(handler.ab_type != CUDA_R_16BF),
        stream_(stream),
        plan_(plan),
        operands_(operands),
        out_type_(out.element_type()),
        out_data_(static_cast<uint8_t*>(out.untyped_data())),
        workspace_data_(static_cast<uint8_t*>(workspace.untyped_data())) {}

  ffi::Error CheckOut();
  ffi::Error Zero(const ElementRange& range) const;
  ffi::Error Start();
  ffi::Error WriteAlphas() const;
  ffi::Error Run(const GemmLaunch& launch);

 private:
  std::string Problem(const GemmLaunch& launch) const;
  bool Describe(const GemmLaunch& launch, CublasFailure& ok);
  void* OutAt(int64_t element) const {
    return out_data_ + element * out_bytes_;
  }

  const GemmErrors& errors_;
  const cudaDataType_t ab_type_;
  const bool fp4_;
  const cudaStream_t stream_;
  const GemmCallPlan& plan_;
  const GemmOperands& operands_;
  const ffi::DataType out_type_;
  uint8_t* const out_data_;
  uint8_t* const workspace_data_;
  int64_t out_bytes_ = 0;
  cudaDataType_t d_type_ = CUDA_R_32F;
  StreamDevice device_;
  const CublasLt* lt_ = nullptr;
  CublasWorkspace cublas_workspace_;
  std::unique_ptr<MatmulDescriptors> desc_;
  GemmLaunch described_;  // the shape of desc_
};

ffi::Error GemmCall::CheckOut() {
  if (out_type_ != ffi::DataType::BF16 && out_type_ != ffi::DataType::F32) {
    return errors_.Fail(ffi::ErrorCode::kInvalidArgument,
                        "out must be bfloat16 or float32");
  }
  const bool bf16 = out_type_ == ffi::DataType::BF16;
  out_bytes_ = bf16 ? 2 : 4;
  d_type_ = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  return ffi::Error::Success();
}

ffi::Error GemmCall::Zero(const ElementRange& range) const {
  if (range.end <= range.begin) return ffi::Error::Success();
  if (out_data_ == nullptr) {
    return errors_.Fail(ffi::ErrorCode::kInvalidArgument, "out is null");
  }
  if (cudaError_t err =
          cudaMemsetAsync(OutAt(range.begin), 0,
                          (range.end - range.begin) * out_bytes_, stream_);
      err != cudaSuccess) {
    return errors_.Cuda("cudaMemsetAsync", err);
  }
  return ffi::Error::Success();
}

ffi::Error GemmCall::Start() {
  if (ffi::Error e = GetStreamDevice(stream_, errors_, &device_); e.failure()) {
    return e;
  }
  if (!fp4_ && device_.major < 8) {
    return errors_.FailAtRunTime(
        ffi::ErrorCode::kFailedPrecondition,
        "bfloat16 tensor-core GEMMs need compute capability 8.0 or newer; " +
            DeviceName(device_) + ".");
  }
  if (fp4_ && device_.major < 10) {
    return errors_.Fail(
        ffi::ErrorCode::kFailedPrecondition,
        "native FP4 GEMMs need compute capability 10.0 or newer (Blackwell); " +
            DeviceName(device_) +
            ". Use jax_nvfp4.matmul / jax_nvfp4.ragged_dot, which lower to "
            "this target only where "
            "jax_nvfp4.backends.fp4_gemm.native_fp4_supported() holds.");
  }
  if (ffi::Error e = LoadCublasLt(errors_, &lt_); e.failure()) return e;
  if (fp4_ && lt_->version < kMinFp4CublasLtVersion) {
    return errors_.FailAtRunTime(
        ffi::ErrorCode::kFailedPrecondition,
        "cuBLASLt " + std::to_string(lt_->version) + " (" + lt_->path +
            ") predates block-scaled FP4 (needs 12.8 or newer, e.g. pip "
            "install nvidia-cublas).");
  }
  // Block scales and the FP4 tensor-core kernels' A and B need 16 bytes;
  // the alpha kernel reads the amaxes and writes the head as floats.
  const uint32_t operand_bytes = fp4_ ? 16 : 2;
  const bool aligned =
      Aligned(operands_.a, operand_bytes) &&
      Aligned(operands_.b, operand_bytes) &&
      (!fp4_ || (Aligned(operands_.a_scales, operand_bytes) &&
                 Aligned(operands_.b_scales, operand_bytes))) &&
      Aligned(operands_.a_amax, 4) && Aligned(operands_.b_amax, 4) &&
      Aligned(out_data_,
              std::max(operand_bytes, static_cast<uint32_t>(out_bytes_))) &&
      Aligned(workspace_data_, std::max<uint32_t>(operand_bytes, 4));
  if (!aligned) {
    return errors_.Fail(
        ffi::ErrorCode::kInvalidArgument,
        std::string("every operand and result must be non-null and aligned "
                    "to ") +
            (fp4_ ? "16 bytes (the amaxes to 4)" : "its element size"));
  }
  if (device_.capturing) CountCapturedCall();
  cublas_workspace_ = AlignedCublasWorkspace(
      workspace_data_ + plan_.workspace_head_bytes, plan_.workspace_bytes);
  return ffi::Error::Success();
}

ffi::Error GemmCall::WriteAlphas() const {
  if (cudaError_t err =
          LaunchGemmAlphas(stream_, operands_.a_amax, plan_.a_amax_stride,
                           operands_.b_amax, plan_.b_amax_stride, plan_.alphas,
                           reinterpret_cast<float*>(workspace_data_));
      err != cudaSuccess) {
    return errors_.Cuda("the alpha kernel's launch", err);
  }
  return ffi::Error::Success();
}

std::string GemmCall::Problem(const GemmLaunch& l) const {
  return (plan_.grouped ? "groups=" : "batch=") + std::to_string(plan_.batch) +
         " M=" + std::to_string(plan_.m) + " N=" + std::to_string(plan_.n) +
         " K=" + std::to_string(plan_.k) +
         " out=" + (out_bytes_ == 2 ? "bf16" : "f32") + ", launch " +
         (l.group >= 0 ? "of group " + std::to_string(l.group) + " " : "") +
         std::to_string(l.batch) + " x " + std::to_string(l.m) + "x" +
         std::to_string(l.n) + "x" + std::to_string(l.k) +
         " ld=" + std::to_string(l.ld);
}

bool GemmCall::Describe(const GemmLaunch& l, CublasFailure& ok) {
  desc_ = std::make_unique<MatmulDescriptors>(lt_);
  MatmulDescriptors& d = *desc_;
  bool described = d.CreateTnOperation(ok);
#ifdef JAX_NVFP4_WITH_BLACKWELL_GEMM
  if (fp4_) {
    const cublasLtMatmulMatrixScale_t mode =
        CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    described = described &&
                ok("cublasLtMatmulDescSetAttribute(A_SCALE_MODE)",
                   d.Set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode)) &&
                ok("cublasLtMatmulDescSetAttribute(B_SCALE_MODE)",
                   d.Set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode));
  }
#endif
  described = described &&
              d.CreateLayout(&d.a, "cublasLtMatrixLayoutCreate(A)", ab_type_,
                             l.k, l.n, l.ld, l.batch, l.b_stride, ok) &&
              d.CreateLayout(&d.b, "cublasLtMatrixLayoutCreate(B)", ab_type_,
                             l.k, l.m, l.ld, l.batch, l.a_stride, ok) &&
              d.CreateLayout(&d.d, "cublasLtMatrixLayoutCreate(D)", d_type_,
                             l.n, l.m, l.n, l.batch, l.out_stride, ok);
  if (described) {
    described_ = l;
  } else {
    desc_.reset();
  }
  return described;
}

ffi::Error GemmCall::Run(const GemmLaunch& l) {
  CublasFailure ok;
  const GemmLaunch& s = described_;
  const bool same_shape =
      desc_ != nullptr && s.m == l.m && s.n == l.n && s.k == l.k &&
      s.ld == l.ld && s.batch == l.batch && s.a_stride == l.a_stride &&
      s.b_stride == l.b_stride && s.out_stride == l.out_stride;
  if (!same_shape && !Describe(l, ok)) {
    return ok.Error(*lt_, errors_, Problem(l));
  }
  const void* a = At(operands_.a, l.a);
  const void* b = At(operands_.b, l.b);
  void* out = OutAt(l.out);
#ifdef JAX_NVFP4_WITH_BLACKWELL_GEMM
  // cuBLASLt's A is b, its B is a.
  if (fp4_ && !(ok("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)",
                   desc_->Set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                              At(operands_.b_scales, l.b_scales))) &&
                ok("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)",
                   desc_->Set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                              At(operands_.a_scales, l.a_scales))))) {
    return ok.Error(*lt_, errors_, Problem(l));
  }
#endif

  // The alignment cuBLASLt may assume for each matrix: of its pointer, its
  // leading dimension in bytes and, in a strided batch, its item stride.
  auto ab_bytes = [&](int64_t elements) {
    return static_cast<uint64_t>(fp4_ ? elements / 2 : elements * 2);
  };
  auto stride = [&](uint64_t bytes) { return l.batch > 1 ? bytes : 0; };
  const AlgoKey key{
      device_.ordinal,
      ab_type_,
      d_type_,
      l.m,
      l.n,
      l.k,
      l.batch,
      cublas_workspace_.bytes,
      CommonAlignment(
          {Address(b), ab_bytes(l.ld), stride(ab_bytes(l.b_stride))}),
      CommonAlignment(
          {Address(a), ab_bytes(l.ld), stride(ab_bytes(l.a_stride))}),
      CommonAlignment(
          {Address(out), static_cast<uint64_t>(l.n * out_bytes_),
           stride(static_cast<uint64_t>(l.out_stride * out_bytes_))}),
      l.ld};
  cublasLtHandle_t handle;
  cublasLtMatmulAlgo_t algo;
  bool found = false, did_setup = false;
  if (!HandleAndAlgo(*desc_, key, &handle, &algo, &found, ok, &did_setup)) {
    return ok.Error(*lt_, errors_, Problem(l));
  }
  if (did_setup && device_.capturing) CountCapturedSetup();
  if (!found) {
    return errors_.FailAtRunTime(
        ffi::ErrorCode::kUnimplemented,
        "cuBLASLt " + std::to_string(lt_->version) + " (" + lt_->path +
            ") has no algorithm for this " +
            (fp4_ ? "block-scaled FP4 GEMM" : "bf16 GEMM") + " (" + Problem(l) +
            ", alignments A=" + std::to_string(key.align_a) +
            " B=" + std::to_string(key.align_b) +
            " D=" + std::to_string(key.align_d) + " bytes)" +
            (fp4_ ? "; a newer cuBLAS (pip install -U nvidia-cublas) may have "
                    "one."
                  : "."));
  }
  // beta and the alphas at the head of the workspace; cuBLASLt's part follows.
  const float* head = reinterpret_cast<const float*>(workspace_data_);
  if (!ok("cublasLtMatmul",
          lt_->Matmul(handle, desc_->op, head + 1 + l.alpha, b, desc_->a, a,
                      desc_->b, head, out, desc_->d, out, desc_->d, &algo,
                      cublas_workspace_.data, cublas_workspace_.bytes,
                      stream_))) {
    return ok.Error(*lt_, errors_, Problem(l));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunGemmCall(const GemmHandler& handler, cudaStream_t stream,
                       const std::string& plan_error, const GemmCallPlan& plan,
                       const GemmOperands& operands, ffi::AnyBuffer out,
                       ffi::Buffer<ffi::U8> workspace) {
  if (!plan_error.empty()) {
    return handler.errors.Fail(ffi::ErrorCode::kInvalidArgument, plan_error);
  }
  GemmCall call(handler, stream, plan, operands, out, workspace);
  if (ffi::Error e = call.CheckOut(); e.failure()) return e;
  for (const ElementRange& range : plan.zeros) {
    if (ffi::Error e = call.Zero(range); e.failure()) return e;
  }
  if (plan.launches.empty()) return ffi::Error::Success();
  if (ffi::Error e = call.Start(); e.failure()) return e;
  if (ffi::Error e = call.WriteAlphas(); e.failure()) return e;
  for (const GemmLaunch& launch : plan.launches) {
    if (ffi::Error e = call.Run(launch); e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace jax_nvfp4
