// A standalone check of the Hopper GEMM engine's kernels on an sm_90a GPU,
// apart from their FFI handlers: the grouped forms
// (ffi/gemm/engine/grouped_rows.cuh, grouped_tokens.cuh) and the W4A16 GEMM
// (w4a16.cuh), dense and grouped. Bit-for-bit equality with plain reference
// kernels on integer-valued operands and power-of-two scales and alphas (exact
// sums): empty and unaligned groups, ragged M, N and K, every W4A16
// configuration and split, float32 and bfloat16 outputs; the speed of
// moe_bench's projections and of serving_bench's W4A16 shapes, dense and
// grouped (weights cycled past L2). Exits 1 if any case differs.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -o /tmp/engine_check tools/engine_check.cu && /tmp/engine_check
//   /tmp/engine_check small   # the small cases only (compute-sanitizer)
//   /tmp/engine_check w4a16 M N K   # one W4A16 GEMM, timed (for ncu)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemm/engine/grouped_rows.cuh"
#include "gemm/engine/grouped_tokens.cuh"
#include "gemm/engine/tensor_map.h"
#include "gemm/engine/w4a16.cuh"

#define CK(x)                                                             \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

namespace engine = jax_nvfp4::engine;
using RowsShape = engine::GroupedRowsShape;
using TokensShape = engine::GroupedTokensShape;

static int failures = 0;  // cases with a differing element

// A contiguous bf16 tensor map of dims (innermost first) read in boxes.
static CUtensorMap Map(void* base, std::vector<uint64_t> dims,
                       std::vector<uint32_t> box, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  if (!engine::Bf16TensorMap(base, int(dims.size()), dims.data(), box.data(),
                             swizzle, &map)) {
    printf("cuTensorMapEncodeTiled failed\n");
    exit(1);
  }
  return map;
}

static __nv_bfloat16* Upload(const std::vector<__nv_bfloat16>& host) {
  __nv_bfloat16* d;
  CK(cudaMalloc(&d, host.size() * 2 + 16));
  CK(cudaMemcpy(d, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
static T* UploadOf(const std::vector<T>& host) {
  T* d;
  CK(cudaMalloc(&d, host.size() * sizeof(T) + 16));
  CK(cudaMemcpy(d, host.data(), host.size() * sizeof(T),
                cudaMemcpyHostToDevice));
  return d;
}
static std::vector<__nv_bfloat16> SmallIntegers(size_t count, int seed) {
  srand(seed);
  std::vector<__nv_bfloat16> v(count);
  for (auto& x : v) x = __float2bfloat16(float(rand() % 9 - 4));
  return v;
}
static std::vector<float> Alphas(int groups) {  // powers of two: exact
  std::vector<float> a(groups);
  for (int g = 0; g < groups; ++g) a[g] = 1.0f / float(1 << (g % 4));
  return a;
}

static float AsFloat(float x) { return x; }
static float AsFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
static float Rounded(float x, float) { return x; }
static float Rounded(float x, __nv_bfloat16) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// Compares out (Out) with the float32 reference rounded once to Out.
template <typename Out>
static size_t Differences(const Out* out, const float* reference, size_t count,
                          size_t* first) {
  std::vector<Out> got(count);
  std::vector<float> want(count);
  CK(cudaMemcpy(got.data(), out, count * sizeof(Out), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(want.data(), reference, count * 4, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    if (AsFloat(got[i]) != Rounded(want[i], Out{})) {
      if (!bad) *first = i;
      ++bad;
    }
  }
  return bad;
}

template <typename Launch>
static float Milliseconds(Launch launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int reps = 10;
  cudaEventRecord(e0);
  for (int r = 0; r < reps; ++r) launch();
  cudaEventRecord(e1);
  CK(cudaEventSynchronize(e1));
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms / reps;
}

static void Report(const char* form, size_t bad, size_t first, int width,
                   bool check, float ms, double flops) {
  printf("%s:", form);
  if (check) {
    printf(" %zu differ", bad);
    if (bad) printf(" (first row %zu col %zu)", first / width, first % width);
  }
  printf("; %.3f ms, %.0f TFLOP/s (useful)\n", ms, flops / ms / 1e9);
  failures += bad > 0;
}

// --- rows form -------------------------------------------------------------

__global__ void RowsReference(const __nv_bfloat16* a, const __nv_bfloat16* b,
                              const int* row_group, const float* alpha,
                              float* c, int rows, int n, int k) {
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows || col >= n) return;
  const int g = row_group[row];
  float s = 0.f;
  if (g >= 0) {
    for (int i = 0; i < k; ++i) {
      s += __bfloat162float(a[size_t(row) * k + i]) *
           __bfloat162float(b[(size_t(g) * n + col) * k + i]);
    }
    s *= alpha[g];
  }
  c[size_t(row) * n + col] = s;
}

template <typename Out>
static void Rows(const std::vector<int>& sizes, int n, int k, bool check,
                 int sms) {
  const int groups = int(sizes.size());
  long rows = 0, tokens = 0;
  std::vector<int> row_group;
  // Groups are plain runs of rows, then 16 rows past them.
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < sizes[g]; ++i) row_group.push_back(g);
    rows += sizes[g];
    tokens += sizes[g];
  }
  row_group.insert(row_group.end(), 16, -1);
  rows += 16;
  __nv_bfloat16* a = Upload(SmallIntegers(size_t(rows) * k, int(rows + k)));
  __nv_bfloat16* b = Upload(SmallIntegers(size_t(groups) * n * k, n + k));
  float* alpha = UploadOf(Alphas(groups));
  int* dsizes = UploadOf(sizes);
  int* drow_group = UploadOf(row_group);
  Out* out;
  float* reference;
  CK(cudaMalloc(&out, size_t(rows) * n * sizeof(Out)));
  CK(cudaMalloc(&reference, size_t(rows) * n * 4));
  CK(cudaMemset(out, 0, size_t(rows) * n * sizeof(Out)));
  const CUtensorMap ma = Map(a, {cuuint64_t(k), cuuint64_t(rows)},
                             {RowsShape::kBlockK, RowsShape::kBlockRows},
                             CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap mb = Map(b, {cuuint64_t(k), cuuint64_t(groups) * n},
                             {RowsShape::kBlockK, RowsShape::kBlockCols},
                             CU_TENSOR_MAP_SWIZZLE_128B);
  const auto kernel = engine::GroupedRowsKernel<Out>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          RowsShape::Ring::kSharedBytes));
  const auto launch = [&] {
    kernel<<<sms, RowsShape::kThreads, RowsShape::Ring::kSharedBytes>>>(
        ma, mb, dsizes, alpha, out, groups, int(rows), n, k);
  };
  launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  size_t bad = 0, first = 0;
  if (check) {
    RowsReference<<<dim3((n + 15) / 16, unsigned(rows + 15) / 16),
                    dim3(16, 16)>>>(a, b, drow_group, alpha, reference,
                                    int(rows), n, k);
    CK(cudaDeviceSynchronize());
    bad = Differences(out, reference, size_t(rows) * n, &first);
  }
  char form[160];
  snprintf(form, sizeof(form), "rows   %s groups=%d tokens=%ld N=%d K=%d",
           sizeof(Out) == 4 ? "f32 " : "bf16", groups, tokens, n, k);
  Report(form, bad, first, n, check, Milliseconds(launch),
         2.0 * tokens * n * k);
  cudaFree(a), cudaFree(b), cudaFree(alpha), cudaFree(dsizes);
  cudaFree(drow_group), cudaFree(out), cudaFree(reference);
}

// --- tokens form -----------------------------------------------------------

// Group g's tokens are lines [line_begin[g], line_end[g]) of a [lines, m,
// 64] and b [lines, n, 64], 64 tokens a line, zeros past its tokens.
__global__ void TokensReference(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                const int* line_begin, const int* line_end,
                                const float* alpha, float* c, int m, int n) {
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  const int g = blockIdx.z;
  if (row >= m || col >= n) return;
  float s = 0.f;
  for (int line = line_begin[g]; line < line_end[g]; ++line) {
    for (int t = 0; t < 64; ++t) {
      s += __bfloat162float(a[(size_t(line) * m + row) * 64 + t]) *
           __bfloat162float(b[(size_t(line) * n + col) * 64 + t]);
    }
  }
  const bool empty = line_end[g] == line_begin[g];
  c[(size_t(g) * m + row) * n + col] = empty ? 0.f : alpha[g] * s;
}

template <typename Out>
static void Tokens(const std::vector<int>& sizes, int m, int n, bool check,
                   int sms) {
  const int groups = int(sizes.size());
  std::vector<int> begin(groups), end(groups);
  long lines = 0, tokens = 0;
  for (int g = 0; g < groups; ++g) {
    begin[g] = int(lines);
    lines += engine::CeilDiv(sizes[g], TokensShape::kLineTokens);
    end[g] = int(lines);
    tokens += sizes[g];
  }
  const long stored = lines > 0 ? lines : 1;
  auto ha = SmallIntegers(size_t(stored) * m * 64, int(lines + m));
  auto hb = SmallIntegers(size_t(stored) * n * 64, int(lines + n));
  // Each group's last line holds zeros past its tokens.
  for (int g = 0; g < groups; ++g) {
    for (long t = sizes[g]; t < long(end[g] - begin[g]) * 64; ++t) {
      const long line = begin[g] + t / 64;
      for (int r = 0; r < m; ++r) ha[(line * m + r) * 64 + t % 64] = 0.f;
      for (int r = 0; r < n; ++r) hb[(line * n + r) * 64 + t % 64] = 0.f;
    }
  }
  __nv_bfloat16* a = Upload(ha);
  __nv_bfloat16* b = Upload(hb);
  float* alpha = UploadOf(Alphas(groups));
  int* dsizes = UploadOf(sizes);
  int* dbegin = UploadOf(begin);
  int* dend = UploadOf(end);
  Out* out;
  float* reference;
  const size_t count = size_t(groups) * m * n;
  CK(cudaMalloc(&out, count * sizeof(Out)));
  CK(cudaMalloc(&reference, count * 4));
  CK(cudaMemset(out, 0xFF, count * sizeof(Out)));  // every element written
  const CUtensorMap ma =
      Map(a, {64, cuuint64_t(m), cuuint64_t(stored)},
          {64, TokensShape::kBlockM, 1}, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap mb =
      Map(b, {64, cuuint64_t(n), cuuint64_t(stored)},
          {64, TokensShape::kBlockN, 1}, CU_TENSOR_MAP_SWIZZLE_128B);
  const auto kernel = engine::GroupedTokensKernel<Out>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          TokensShape::Ring::kSharedBytes));
  const auto launch = [&] {
    kernel<<<sms, TokensShape::kThreads, TokensShape::Ring::kSharedBytes>>>(
        ma, mb, dsizes, alpha, out, groups, int(stored), m, n);
  };
  launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  size_t bad = 0, first = 0;
  if (check) {
    TokensReference<<<dim3((n + 15) / 16, (m + 15) / 16, groups),
                      dim3(16, 16)>>>(a, b, dbegin, dend, alpha, reference, m,
                                      n);
    CK(cudaDeviceSynchronize());
    bad = Differences(out, reference, count, &first);
  }
  char form[160];
  snprintf(form, sizeof(form), "tokens %s groups=%d tokens=%ld M=%d N=%d",
           sizeof(Out) == 4 ? "f32 " : "bf16", groups, tokens, m, n);
  Report(form, bad, first, n, check, Milliseconds(launch),
         2.0 * tokens * m * n);
  cudaFree(a), cudaFree(b), cudaFree(alpha), cudaFree(dsizes);
  cudaFree(dbegin), cudaFree(dend), cudaFree(out), cudaFree(reference);
}

// --- W4A16 ------------------------------------------------------------------

__device__ float E2M1(int code) {
  const float magnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return code & 8 ? -magnitude[code & 7] : magnitude[code & 7];
}

// row_group: each row's weight (-1: no group, a zero row); nullptr: weight
// 0 for every row.
__global__ void W4A16Reference(const __nv_bfloat16* x, const uint8_t* codes,
                               const uint8_t* scales, const float* amax,
                               const int* row_group, float* c, int m, int n,
                               int k) {
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= m || col >= n) return;
  const int g = row_group ? row_group[row] : 0;
  if (g < 0) {
    c[size_t(row) * n + col] = 0.f;
    return;
  }
  codes += size_t(g) * n * k / 2, scales += size_t(g) * n * k / 16;
  float s = 0.f;
  for (int i = 0; i < k; ++i) {
    const int code = codes[(size_t(col) * k + i) / 2] >> (i % 2 * 4) & 15;
    const float w =
        E2M1(code) * jax_nvfp4::E4M3Decode(scales[(size_t(col) * k + i) / 16]);
    s += __bfloat162float(x[size_t(row) * k + i]) * w;
  }
  c[size_t(row) * n + col] = s * (amax[g] / 2688.0f);
}

// x [m, k] times `copies` weights [n, k] in turn (so that timing reads them
// from HBM, not L2); checks the first against the reference. `sizes`: the
// grouped form, x's rows in groups, group g's times weight g of G (each copy
// G weights), as handler jax_nvfp4_ragged_w4a16_sm90 runs it (the memset of
// the rows past the groups included).
template <typename Out>
static void W4A16(int m, int n, int k, bool check, int sms, int copies = 1,
                  const std::vector<int>& sizes = {}) {
  srand(m * 7 + n * 3 + k + int(sizes.size()));
  const int groups = sizes.empty() ? 1 : int(sizes.size());
  const size_t rows = size_t(groups) * n;  // weight rows of a copy
  const std::vector<__nv_bfloat16> hx = SmallIntegers(size_t(m) * k, m + k);
  std::vector<uint8_t> hcodes(rows * k / 2 * copies);
  for (auto& b : hcodes) b = uint8_t(rand());
  // E4M3 powers of two 2^-3 .. 2^3 (exponent field 4 .. 10): exact sums.
  std::vector<uint8_t> hscales(rows * k / 16 * copies);
  for (auto& b : hscales) b = uint8_t((4 + rand() % 7) << 3);
  std::vector<float> hamax(groups);
  for (int g = 0; g < groups; ++g) hamax[g] = 2688.0f * (4 >> g % 3);
  std::vector<int> hrow_group(m, sizes.empty() ? 0 : -1);
  for (int g = 0, row = 0; g < int(sizes.size()); ++g) {
    for (int i = 0; i < sizes[g]; ++i) hrow_group[row++] = g;
  }
  __nv_bfloat16* x = Upload(hx);
  uint8_t* codes = UploadOf(hcodes);
  uint8_t* scales = UploadOf(hscales);
  float* amax = UploadOf(hamax);
  int* row_group = UploadOf(hrow_group);
  int32_t* group_sizes =
      sizes.empty() ? nullptr : UploadOf(std::vector<int32_t>(sizes));
  Out* out;
  float* reference;
  const size_t count = size_t(m) * n;
  CK(cudaMalloc(&out, count * sizeof(Out)));
  CK(cudaMalloc(&reference, count * 4));
  CK(cudaMemset(out, 0xFF, count * sizeof(Out)));  // every element written
  engine::W4A16Plan plan;
  const std::string error =
      sizes.empty() ? engine::PlanW4A16(m, n, k, sms, &plan)
                    : engine::PlanW4A16Grouped(m, groups, n, k, sms, &plan);
  if (!error.empty()) {
    printf("plan: %s\n", error.c_str());
    exit(1);
  }
  std::vector<CUtensorMap> maps(3 * copies);
  for (int c = 0; c < copies; ++c) {
    if (!engine::W4A16Maps(x, codes + c * rows * k / 2,
                           scales + c * rows * k / 16, m, int64_t(rows), k,
                           plan.config, &maps[3 * c], &maps[3 * c + 1],
                           &maps[3 * c + 2])) {
      printf("cuTensorMapEncodeTiled failed\n");
      exit(1);
    }
  }
  int call = 0;
  const auto launch = [&] {
    const int c = call++ % copies;
    if (!sizes.empty()) CK(cudaMemsetAsync(out, 0, count * sizeof(Out)));
    CK(engine::LaunchW4A16<Out>(plan, maps[3 * c], maps[3 * c + 1],
                                maps[3 * c + 2], x, amax, out, m, n, k, nullptr,
                                group_sizes, int(sizes.size())));
  };
  launch();
  CK(cudaDeviceSynchronize());
  size_t bad = 0, first = 0;
  if (check) {
    W4A16Reference<<<dim3((n + 15) / 16, (m + 15) / 16), dim3(16, 16)>>>(
        x, codes, scales, amax, row_group, reference, m, n, k);
    CK(cudaDeviceSynchronize());
    bad = Differences(out, reference, count, &first);
  }
  const float ms = Milliseconds(launch);
  printf("w4a16 %s%s M=%d N=%d K=%d (tokens %d, splits %ld):",
         sizeof(Out) == 4 ? "f32 " : "bf16",
         sizes.empty() ? "" : (" G=" + std::to_string(groups)).c_str(), m, n, k,
         plan.config.tokens, long(plan.splits));
  if (check) {
    printf(" %zu differ", bad);
    if (bad) printf(" (first row %zu col %zu)", first / n, first % n);
  }
  const double weight_bytes = double(rows) * k * 9 / 16;
  printf("; %.1f us, weight %.2f TB/s, %.0f TFLOP/s\n", ms * 1e3,
         weight_bytes / ms / 1e9, 2.0 * m * n * k / ms / 1e9);
  failures += bad > 0;
  cudaFree(x), cudaFree(codes), cudaFree(scales), cudaFree(amax);
  cudaFree(row_group), cudaFree(group_sizes), cudaFree(out),
      cudaFree(reference);
}

int main(int argc, char** argv) {
  const bool small = argc > 1 && std::string(argv[1]) == "small";
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (argc == 5 && std::string(argv[1]) == "w4a16") {
    W4A16<__nv_bfloat16>(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), false,
                         sms, 4);
    return 0;
  }
  const std::vector<int> moe = {10922, 5461, 10922, 5461,
                                10922, 5461, 10922, 5465};  // moe_bench's 2:1
  Rows<float>({40, 24, 0, 32, 50, 30, 48, 32}, 256, 128, true, sms);
  Rows<float>({1, 2, 3, 4, 5, 6, 7, 300}, 512, 256, true, sms);
  Rows<float>({0, 0, 0}, 256, 64, true, sms);
  Rows<__nv_bfloat16>({1000, 0, 2000, 513}, 768, 512, true, sms);
  Rows<float>({70, 0, 33}, 264, 72, true, sms);  // N and K past whole tiles
  Tokens<float>({40, 24, 0, 32, 50, 30, 48, 32}, 128, 256, true, sms);
  Tokens<float>({1, 2, 3, 4, 5, 6, 7, 300}, 200, 264, true, sms);
  Tokens<float>({64, 128, 16, 0, 80}, 128, 256, true, sms);
  Tokens<float>({0, 0, 0}, 128, 256, true, sms);
  Tokens<__nv_bfloat16>({1000, 0, 2000, 513}, 384, 512, true, sms);
  // Every configuration (M 1 .. 2048), ragged M and N, split K.
  for (int m : {1, 7, 16, 17, 64, 100, 256})
    W4A16<float>(m, 300, 1024, true, sms);
  W4A16<float>(5, 4096, 4096, true, sms);  // splits
  W4A16<__nv_bfloat16>(33, 256, 768, true, sms);
  W4A16<__nv_bfloat16>(130, 518, 512, true, sms);  // N past whole quads
  // The grouped form: empty groups, groups off 16, rows past the groups,
  // every token tile (16 to 128), split K.
  W4A16<float>(100, 130, 512, true, sms, 1, {1, 0, 7, 17, 33, 0, 2, 20});
  W4A16<float>(128, 256, 4096, true, sms, 1, std::vector<int>(8, 16));
  W4A16<__nv_bfloat16>(1100, 300, 1024, true, sms, 1,
                       {300, 0, 513, 40, 0, 0, 100, 71});
  W4A16<float>(16, 64, 256, true, sms, 1, {0, 0, 0});
  W4A16<float>(180, 130, 2048, true, sms, 1, {40, 0, 63, 17, 20, 30});
  W4A16<float>(400, 130, 2048, true, sms, 1, {90, 33, 0, 64, 150, 0, 40, 20});
  if (!small) {
    W4A16<float>(2048, 1024, 2048, true, sms);
    // serving_bench's shapes; four weights cycled past L2.
    for (int m : {1, 16, 64, 256, 2048}) {
      W4A16<__nv_bfloat16>(m, 14336, 4096, false, sms, 4);
      W4A16<__nv_bfloat16>(m, 28672, 8192, false, sms, 2);
      W4A16<__nv_bfloat16>(m, 4096, 14336, false, sms, 4);
    }
    // serving_bench's grouped form: 8 experts, 1, 16 and 64 rows each.
    for (int rows : {1, 16, 64}) {
      W4A16<__nv_bfloat16>(8 * rows, 14336, 4096, false, sms, 2,
                           std::vector<int>(8, rows));
      W4A16<__nv_bfloat16>(8 * rows, 4096, 14336, false, sms, 2,
                           std::vector<int>(8, rows));
    }
    // moe_bench's projections: gate/up FPROP, down FPROP, the WGRAD of gate.
    Rows<float>(moe, 8192, 2048, true, sms);
    Rows<__nv_bfloat16>(moe, 2048, 8192, false, sms);
    Tokens<float>(moe, 2048, 8192, true, sms);
    Tokens<float>(moe, 8192, 2048, false, sms);
  }
  return failures > 0;
}
