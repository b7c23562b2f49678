// The W4A16 kernel alone (ffi/gemm/mma/w4a16_kernel.cuh), in the
// configuration the handler's plan picks, against cuBLAS's bf16 GEMM of the
// same shape: no JAX, no XLA, so the kernel's own time.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -I ffi -o /tmp/w4a16_kernel_bench \
//       benchmarks/w4a16_kernel_bench.cu -lcublas
//   /tmp/w4a16_kernel_bench            # 4096x14336, 8192x28672, 14336x4096
//   /tmp/w4a16_kernel_bench 4096 14336 # one K N
//
// Each timing is cudaEvent time over 120 launches that cycle through copies
// of the weight (over 400 MB together, so that none is read from the 50 MB
// L2), bf16 out. A W4A16 launch is the handler's: the arrival counts zeroed,
// then the kernel. Before timing, its float32 result is checked against a
// double-precision reference within the float32 summation bound (K * 2^-24
// * sum |x * w|). Prints microseconds, the ratio to cuBLAS and the FP4
// weight's bytes per second.
#include <cublas_v2.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "gemm/mma/w4a16_gemm_plan.h"
#include "gemm/mma/w4a16_kernel.cuh"

using namespace jax_nvfp4;

#define CHECK_CUDA(x)                                            \
  do {                                                           \
    const cudaError_t e = (x);                                   \
    if (e != cudaSuccess) {                                      \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                              \
    }                                                            \
  } while (0)

namespace {

constexpr int kIters = 120;

__global__ void Reference(const __nv_bfloat16* x, const uint8_t* codes,
                          const uint8_t* scales, float amax, double* out,
                          double* magnitude, int64_t m, int64_t n, int64_t k) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= m * n) return;
  const int64_t r = i / n, c = i % n;
  const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  double sum = 0, abs_sum = 0;
  for (int64_t j = 0; j < k; ++j) {
    const uint8_t byte = codes[c * (k / 2) + j / 2];
    const uint8_t code = j % 2 ? byte >> 4 : byte & 15;
    const float w = (code & 8 ? -1.0f : 1.0f) * e2m1[code & 7] *
                    E4M3Decode(scales[c * (k / 16) + j / 16]);
    const double t = static_cast<double>(__bfloat162float(x[r * k + j])) * w;
    sum += t;
    abs_sum += std::fabs(t);
  }
  const double alpha = amax / kScaleRange;
  out[i] = sum * alpha;
  magnitude[i] = abs_sum * alpha;
}

template <typename Out>
cudaError_t Launch(cudaStream_t stream, const w4a16::Args& a,
                   const W4A16Plan& p) {
  const cudaError_t e =
      cudaMemsetAsync(a.arrivals, 0, p.arrivals_bytes, stream);
  return e != cudaSuccess ? e : w4a16::LaunchPlanned<Out>(stream, a, p);
}

template <typename F>
double MicrosecondsPerLaunch(cudaStream_t stream, F launch) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 10; ++i) launch(i);
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < kIters; ++i) launch(i);
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return 1000.0 * ms / kIters;
}

void Shape(int64_t k, int64_t n, cublasHandle_t blas, cudaStream_t stream,
           std::mt19937& rng) {
  const size_t code_bytes = n * k / 2, scale_bytes = n * k / 16;
  const int copies = static_cast<int>(400e6 / (code_bytes + scale_bytes)) + 1;
  const int bf16_copies = static_cast<int>(400e6 / (n * k * 2.0)) + 1;
  constexpr int64_t kMaxM = 256;
  uint8_t *codes, *scales, *workspace;
  __nv_bfloat16 *w_bf16, *x, *out_bf16;
  float *amax, *out_f32;
  double *ref, *magnitude;
  CHECK_CUDA(cudaMalloc(&codes, code_bytes * copies));
  CHECK_CUDA(cudaMalloc(&scales, scale_bytes * copies));
  CHECK_CUDA(cudaMalloc(&w_bf16, n * k * 2 * bf16_copies));
  CHECK_CUDA(cudaMalloc(&x, kMaxM * k * 2));
  CHECK_CUDA(cudaMalloc(&out_bf16, kMaxM * n * 2));
  CHECK_CUDA(cudaMalloc(&out_f32, kMaxM * n * 4));
  CHECK_CUDA(cudaMalloc(&amax, 4));
  CHECK_CUDA(cudaMalloc(&ref, kMaxM * n * 8));
  CHECK_CUDA(cudaMalloc(&magnitude, kMaxM * n * 8));
  {
    std::vector<uint8_t> c(code_bytes), s(scale_bytes);
    for (auto& b : c) b = static_cast<uint8_t>(rng());
    for (auto& b : s) b = static_cast<uint8_t>(1 + rng() % 0x7E);  // no NaN
    for (int i = 0; i < copies; ++i) {
      CHECK_CUDA(cudaMemcpy(codes + i * code_bytes, c.data(), code_bytes,
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(scales + i * scale_bytes, s.data(), scale_bytes,
                            cudaMemcpyHostToDevice));
    }
    std::vector<__nv_bfloat16> xs(kMaxM * k);
    std::normal_distribution<float> normal;
    for (auto& v : xs) v = __float2bfloat16(normal(rng));
    CHECK_CUDA(cudaMemcpy(x, xs.data(), xs.size() * 2, cudaMemcpyHostToDevice));
    const float a = 3.5f;
    CHECK_CUDA(cudaMemcpy(amax, &a, 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(w_bf16, 0x3c, n * k * 2 * bf16_copies));
  }
  for (int64_t m : {1, 16, 32, 64, 256}) {
    const float one = 1, zero = 0;
    const double blas_us = MicrosecondsPerLaunch(stream, [&](int i) {
      cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one,
                   w_bf16 + (i % bf16_copies) * n * k, CUDA_R_16BF, k, x,
                   CUDA_R_16BF, k, &zero, out_bf16, CUDA_R_16BF, n,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    std::printf("%6lld -> %-6lld M %4lld  cuBLAS bf16 %7.1f us", (long long)k,
                (long long)n, (long long)m, blas_us);
    if (m > 64) {  // the handler serves up to 64 rows
      std::printf("\n");
      continue;
    }
    W4A16Plan plan;
    if (!PlanW4A16(m, n, k, &plan).empty()) std::exit(1);
    CHECK_CUDA(cudaMalloc(&workspace, plan.workspace_bytes));
    w4a16::Args a{};
    a.x = x;
    a.codes = codes;
    a.scales = scales;
    a.amax = amax;
    a.arrivals = reinterpret_cast<unsigned int*>(workspace);
    a.partial = reinterpret_cast<float*>(workspace + plan.partial_offset);
    a.m = m;
    a.n = n;
    a.k = k;
    a.out = out_f32;
    CHECK_CUDA(Launch<float>(stream, a, plan));
    Reference<<<(m * n + 255) / 256, 256, 0, stream>>>(x, codes, scales, 3.5f,
                                                       ref, magnitude, m, n, k);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<float> got(m * n);
    std::vector<double> want(m * n), mag(m * n);
    CHECK_CUDA(
        cudaMemcpy(got.data(), out_f32, m * n * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(want.data(), ref, m * n * 8, cudaMemcpyDeviceToHost));
    CHECK_CUDA(
        cudaMemcpy(mag.data(), magnitude, m * n * 8, cudaMemcpyDeviceToHost));
    int64_t wrong = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      const double bound =
          k * std::ldexp(mag[i], -24) + std::ldexp(std::fabs(want[i]), -23);
      if (!(std::fabs(got[i] - want[i]) <= bound)) ++wrong;
    }
    a.out = out_bf16;
    const double us = MicrosecondsPerLaunch(stream, [&](int i) {
      w4a16::Args b = a;
      b.codes = codes + (i % copies) * code_bytes;
      b.scales = scales + (i % copies) * scale_bytes;
      CHECK_CUDA(Launch<__nv_bfloat16>(stream, b, plan));
    });
    std::printf("  W4A16 %7.1f us  %.2fx  %5.0f GB/s  check %s\n", us,
                blas_us / us, (code_bytes + scale_bytes) / us / 1e3,
                wrong ? "FAILED" : "ok");
    CHECK_CUDA(cudaFree(workspace));
  }
  for (void* p :
       {(void*)codes, (void*)scales, (void*)w_bf16, (void*)x, (void*)out_bf16,
        (void*)out_f32, (void*)amax, (void*)ref, (void*)magnitude})
    CHECK_CUDA(cudaFree(p));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int64_t, int64_t>> shapes = {
      {4096, 14336}, {8192, 28672}, {14336, 4096}};
  if (argc == 3) shapes = {{std::atoll(argv[1]), std::atoll(argv[2])}};
  cublasHandle_t blas;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cublasCreate(&blas);
  cublasSetStream(blas, stream);
  std::mt19937 rng(0);
  for (auto [k, n] : shapes) Shape(k, n, blas, stream, rng);
  return 0;
}
