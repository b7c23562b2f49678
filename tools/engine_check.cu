// A standalone check of the Hopper GEMM engine's grouped rows form
// (ffi/gemm/engine/grouped_rows.cuh) on an sm_90a GPU: bit-for-bit equality
// with a plain reference kernel on integer-valued operands (exact sums),
// empty and unaligned groups, and the TFLOP/s of moe_bench's projections.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -o /tmp/engine_check tools/engine_check.cu && /tmp/engine_check
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemm/engine/grouped_rows.cuh"

#define CK(x)                                                             \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

using jax_nvfp4::engine::GroupedRowsKernel;

static int failures = 0;  // cases with a differing element
using Shape = jax_nvfp4::engine::GroupedRowsShape;

__global__ void Reference(const __nv_bfloat16* a, const __nv_bfloat16* b,
                          const int* row_group, const float* alpha, float* c,
                          int rows, int n, int k) {
  int row = blockIdx.y * blockDim.y + threadIdx.y,
      col = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows || col >= n) return;
  const int g = row_group[row];
  if (g < 0) {
    c[size_t(row) * n + col] = 0.f;
    return;
  }
  float s = 0.f;
  for (int i = 0; i < k; ++i)
    s += __bfloat162float(a[size_t(row) * k + i]) *
         __bfloat162float(b[(size_t(g) * n + col) * k + i]);
  c[size_t(row) * n + col] = alpha[g] * s;
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t,
                              void*, const cuuint64_t*, const cuuint64_t*,
                              const cuuint32_t*, const cuuint32_t*,
                              CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static CUtensorMap MakeMap(EncodeFn encode, void* base, long rows, long cols,
                           int box_rows) {
  CUtensorMap map;
  cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  cuuint32_t box[2] = {Shape::kBlockK, cuuint32_t(box_rows)};
  cuuint32_t elem[2] = {1, 1};
  CUresult r = encode(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    printf("encode failed %d\n", int(r));
    exit(1);
  }
  return map;
}

static void Run(EncodeFn encode, std::vector<int> sizes, int n, int k,
                bool check, int sms) {
  const int groups = int(sizes.size());
  long rows = 0, tokens = 0;
  for (int s : sizes) {
    rows += (s + 15) / 16 * 16;
    tokens += s;
  }
  rows = rows > 0 ? rows : 16;
  std::vector<__nv_bfloat16> ha(size_t(rows) * k), hb(size_t(groups) * n * k);
  std::vector<int> row_group(rows, -1);
  {
    long r = 0;
    for (int g = 0; g < groups; ++g) {
      for (int i = 0; i < sizes[g]; ++i) row_group[r + i] = g;
      r += (sizes[g] + 15) / 16 * 16;
    }
  }
  srand(int(rows) + n + k);
  for (auto& v : ha) v = __float2bfloat16(float(rand() % 9 - 4));
  for (auto& v : hb) v = __float2bfloat16(float(rand() % 9 - 4));
  std::vector<float> halpha(groups);
  for (int g = 0; g < groups; ++g)
    halpha[g] = 1.0f / float(1 << (g % 4));  // powers of two: exact
  __nv_bfloat16 *da, *db;
  float *dc, *dr, *dalpha;
  int *dsizes, *drg;
  CK(cudaMalloc(&da, ha.size() * 2));
  CK(cudaMalloc(&db, hb.size() * 2));
  CK(cudaMalloc(&dc, size_t(rows) * n * 4));
  CK(cudaMalloc(&dr, size_t(rows) * n * 4));
  CK(cudaMalloc(&dalpha, groups * 4));
  CK(cudaMalloc(&dsizes, groups * 4));
  CK(cudaMalloc(&drg, rows * 4));
  CK(cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dalpha, halpha.data(), groups * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dsizes, sizes.data(), groups * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(drg, row_group.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dc, 0, size_t(rows) * n * 4));
  CUtensorMap ma = MakeMap(encode, da, rows, k, Shape::kBlockRows);
  CUtensorMap mb = MakeMap(encode, db, long(groups) * n, k, Shape::kBlockCols);
  const int smem = Shape::kSharedBytes;
  CK(cudaFuncSetAttribute(GroupedRowsKernel,
                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GroupedRowsKernel<<<sms, Shape::kThreads, smem>>>(ma, mb, dsizes, dalpha, dc,
                                                    groups, n, k);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  size_t bad = 0, first = 0;
  if (check) {
    Reference<<<dim3((n + 15) / 16, (unsigned(rows) + 15) / 16),
                dim3(16, 16)>>>(da, db, drg, dalpha, dr, int(rows), n, k);
    CK(cudaDeviceSynchronize());
    std::vector<float> hc(size_t(rows) * n), hr(size_t(rows) * n);
    CK(cudaMemcpy(hc.data(), dc, hc.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr.data(), dr, hr.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < hc.size(); ++i)
      if (hc[i] != hr[i]) {
        if (!bad) first = i;
        ++bad;
      }
    failures += bad > 0;
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int reps = 10;
  cudaEventRecord(e0);
  for (int r = 0; r < reps; ++r)
    GroupedRowsKernel<<<sms, Shape::kThreads, smem>>>(ma, mb, dsizes, dalpha,
                                                      dc, groups, n, k);
  cudaEventRecord(e1);
  CK(cudaEventSynchronize(e1));
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  ms /= reps;
  printf("groups=%d tokens=%ld rows=%ld N=%d K=%d:", groups, tokens, rows, n,
         k);
  if (check) {
    printf(" %zu differ", bad);
    if (bad) printf(" (first row %zu col %zu)", first / n, first % n);
  }
  printf("; %.3f ms, %.0f TFLOP/s (useful)\n", ms,
         2.0 * tokens * n * k / ms / 1e9);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  cudaFree(dr);
  cudaFree(dalpha);
  cudaFree(dsizes);
  cudaFree(drg);
}

int main(int argc, char** argv) {
  // "small": the small cases only (for compute-sanitizer).
  const bool small = argc > 1 && std::string(argv[1]) == "small";
  EncodeFn encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled",
                                      reinterpret_cast<void**>(&encode), 12000,
                                      cudaEnableDefault, &q));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Run(encode, {40, 24, 0, 32, 50, 30, 48, 32}, 256, 128, true, sms);
  Run(encode, {1, 2, 3, 4, 5, 6, 7, 300}, 512, 256, true, sms);
  Run(encode, {0, 0, 0}, 256, 64, true, sms);
  Run(encode, {1000, 0, 2000, 513}, 768, 512, true, sms);
  if (small) return failures > 0;
  Run(encode, {10922, 5461, 10922, 5461, 10922, 5461, 10922, 5465}, 8192, 2048,
      true, sms);  // moe_bench gate/up FPROP
  Run(encode, {10922, 5461, 10922, 5461, 10922, 5461, 10922, 5465}, 2048, 8192,
      false, sms);  // down FPROP
  return failures > 0;
}
