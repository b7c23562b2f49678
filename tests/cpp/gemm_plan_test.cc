// The plans of the cuBLASLt GEMM handlers (ffi/gemm/cublaslt/*_plan.h):
// their launches and zeroed ranges against hand-computed ones, and their
// refusals.
#include "gemm/cublaslt/gemm_plan.h"

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "check.h"
#include "gemm/cublaslt/bf16_gemm_plan.h"
#include "gemm/cublaslt/fp4_gemm_plan.h"
#include "gemm/cublaslt/fp4_grouped_gemm_plan.h"

namespace jax_nvfp4 {

bool operator==(const GemmLaunch& x, const GemmLaunch& y) {
  return x.m == y.m && x.n == y.n && x.k == y.k && x.ld == y.ld &&
         x.batch == y.batch && x.a_stride == y.a_stride &&
         x.b_stride == y.b_stride && x.out_stride == y.out_stride &&
         x.a == y.a && x.b == y.b && x.a_scales == y.a_scales &&
         x.b_scales == y.b_scales && x.out == y.out && x.alpha == y.alpha &&
         x.group == y.group;
}

std::ostream& operator<<(std::ostream& o, const GemmLaunch& l) {
  return o << "{m=" << l.m << " n=" << l.n << " k=" << l.k << " ld=" << l.ld
           << " batch=" << l.batch << " strides=" << l.a_stride << "/"
           << l.b_stride << "/" << l.out_stride << " a=" << l.a << " b=" << l.b
           << " scales=" << l.a_scales << "/" << l.b_scales << " out=" << l.out
           << " alpha=" << l.alpha << " group=" << l.group << "}";
}

}  // namespace jax_nvfp4

namespace {

using jax_nvfp4::ElementRange;
using jax_nvfp4::Fp4GroupedPlan;
using jax_nvfp4::GemmCallPlan;
using jax_nvfp4::GemmLaunch;
using Shape = std::vector<int64_t>;

GemmLaunch Launch(int64_t m, int64_t n, int64_t k, int64_t ld) {
  GemmLaunch l;
  l.m = m;
  l.n = n;
  l.k = k;
  l.ld = ld;
  return l;
}

void CheckLaunches(const GemmCallPlan& plan,
                   const std::vector<GemmLaunch>& want) {
  CHECK_EQ(plan.launches.size(), want.size());
  for (size_t i = 0; i < want.size() && i < plan.launches.size(); ++i) {
    CHECK_EQ(plan.launches[i], want[i]);
  }
}

void CheckZeros(const GemmCallPlan& plan,
                const std::vector<ElementRange>& want) {
  CHECK_EQ(plan.zeros.size(), want.size());
  for (size_t i = 0; i < want.size() && i < plan.zeros.size(); ++i) {
    CHECK_EQ(plan.zeros[i].begin, want[i].begin);
    CHECK_EQ(plan.zeros[i].end, want[i].end);
  }
}

TEST(WorkspaceHeadHoldsBetaAndTheAlphasIn256ByteUnits) {
  CHECK_EQ(jax_nvfp4::GemmWorkspaceHeadBytes(0), 256);
  CHECK_EQ(jax_nvfp4::GemmWorkspaceHeadBytes(63), 256);  // 64 floats
  CHECK_EQ(jax_nvfp4::GemmWorkspaceHeadBytes(64), 512);
  CHECK_EQ(jax_nvfp4::GemmWorkspaceHeadBytes(1000), 4096);  // 4004 bytes
}

// --- bf16 GEMM ---------------------------------------------------------------

// batch 3 of 29 x 71 x 80: every way the amaxes and b's batch combine.
constexpr int64_t kBatch = 3, kM = 29, kN = 71, kK = 80;
constexpr int64_t kWorkspace = 256 + 8192;

GemmCallPlan PlanBf16(int64_t b_batch, int64_t a_amax, int64_t b_amax) {
  GemmCallPlan p;
  const std::string error =
      jax_nvfp4::PlanBf16Gemm({kBatch, kM, kK}, {b_batch, kN, kK}, {a_amax},
                              {b_amax}, {kBatch, kM, kN}, {kWorkspace}, &p);
  CHECK_EQ(error, "");
  CHECK_EQ(p.batch, kBatch);
  CHECK_EQ((Shape{p.m, p.n, p.k}), (Shape{kM, kN, kK}));
  CHECK(!p.grouped);
  CHECK_EQ(p.workspace_head_bytes, 256);
  CHECK_EQ(p.workspace_bytes, 8192);
  CHECK(p.zeros.empty());
  return p;
}

TEST(Bf16OneAlphaAndSharedBStackItemsAlongM) {
  const GemmCallPlan p = PlanBf16(1, 1, 1);
  CHECK_EQ(p.alphas, 1);
  CHECK_EQ(p.a_amax_stride, 0);
  CHECK_EQ(p.b_amax_stride, 0);
  GemmLaunch l = Launch(kBatch * kM, kN, kK, kK);
  l.a_stride = kM * kK;
  l.out_stride = kM * kN;
  CheckLaunches(p, {l});
}

TEST(Bf16OneAlphaAndBPerItemIsOneStridedBatch) {
  const GemmCallPlan p = PlanBf16(kBatch, 1, 1);
  CHECK_EQ(p.alphas, 1);
  GemmLaunch l = Launch(kM, kN, kK, kK);
  l.batch = kBatch;
  l.a_stride = 2320;  // 29 * 80
  l.b_stride = 5680;  // 71 * 80
  l.out_stride = 2059;
  CheckLaunches(p, {l});
}

TEST(Bf16OneAlphaPerItemIsOneLaunchPerItem) {
  struct Case {
    int64_t b_batch, a_amax, b_amax;
  };
  for (const Case c : {Case{1, kBatch, 1}, Case{kBatch, 1, kBatch},
                       Case{kBatch, kBatch, kBatch}}) {
    const GemmCallPlan p = PlanBf16(c.b_batch, c.a_amax, c.b_amax);
    CHECK_EQ(p.alphas, kBatch);
    CHECK_EQ(p.a_amax_stride, c.a_amax == 1 ? 0 : 1);
    CHECK_EQ(p.b_amax_stride, c.b_amax == 1 ? 0 : 1);
    std::vector<GemmLaunch> want;
    for (int64_t i = 0; i < kBatch; ++i) {
      GemmLaunch l = Launch(kM, kN, kK, kK);
      l.a_stride = 2320;
      l.b_stride = c.b_batch == 1 ? 0 : 5680;
      l.out_stride = 2059;
      l.a = i * 2320 * 2;  // bytes of bfloat16
      l.b = c.b_batch == 1 ? 0 : i * 5680 * 2;
      l.out = i * 2059;
      l.alpha = i;
      want.push_back(l);
    }
    CheckLaunches(p, want);
  }
}

TEST(Bf16EmptySumZeroesOutAndEmptyOutDoesNothing) {
  GemmCallPlan p;
  CHECK_EQ(jax_nvfp4::PlanBf16Gemm({2, 16, 0}, {1, 48, 0}, {2}, {1},
                                   {2, 16, 48}, {4096}, &p),
           "");
  CHECK(p.launches.empty());
  CheckZeros(p, {{0, 2 * 16 * 48}});
  for (const Shape& a : {Shape{0, 16, 32}, Shape{2, 0, 32}}) {
    CHECK_EQ(jax_nvfp4::PlanBf16Gemm(a, {1, 48, 32}, {1}, {1}, {a[0], a[1], 48},
                                     {4096}, &p),
             "");
    CHECK(p.launches.empty());
    CHECK(p.zeros.empty());
  }
}

TEST(Bf16StacksItemsOnlyWithinInt32) {
  // 4 items of 2^30 rows with one alpha each: 4 launches, not 2^32 rows.
  GemmCallPlan p;
  const int64_t rows = int64_t{1} << 30;
  CHECK_EQ(jax_nvfp4::PlanBf16Gemm({4, rows, 32}, {1, 48, 32}, {4}, {1},
                                   {4, rows, 48}, {4096}, &p),
           "");
  CHECK_EQ(p.launches.size(), 4u);
  if (p.launches.size() == 4) {
    CHECK_EQ(p.launches[3].m, rows);
    CHECK_EQ(p.launches[3].a, 3 * rows * 32 * 2);
  }
}

TEST(Bf16RefusalsSayWhatIsWrong) {
  struct Case {
    Shape a, b, a_amax, b_amax, out, workspace;
    const char* message;
  };
  const int64_t big = int64_t{1} << 31, half = int64_t{1} << 30;
  const Case good = {{2, 16, 32}, {1, 48, 32}, {2}, {1},
                     {2, 16, 48}, {4096},      ""};
  std::vector<Case> cases(10, good);
  cases[0].a = {2, 16};
  cases[0].message = "a, b and out must be rank 3";
  cases[1].a_amax = {1, 2};
  cases[1].message = "the amaxes and the workspace must be rank 1";
  cases[2].b = {1, 48, 48};
  cases[2].message = "a and b must have the same K (got 32 and 48)";
  cases[3].b = {3, 48, 32};
  cases[3].message = "b's batch must be 1 or a's (2), got 3";
  cases[4].a_amax = {3};
  cases[4].message = "each amax must have 1 value or one per item";
  cases[5].b_amax = {2};
  cases[5].message = "(a: 2, b: 1), got 2 and 2";
  cases[6].out = {2, 16, 47};
  cases[6].message = "out must be [batch, M, N] = [2, 16, 48]";
  cases[7].workspace = {8};
  cases[7].message = "at least 256 bytes";
  cases[8] = {{1, big, 32},
              {1, 48, 32},
              {1},
              {1},
              {1, big, 48},
              {4096},
              "below 2^31 (got M=2147483648"};
  // Stacking 4 items of 2^30 rows along M would pass 2^31.
  cases[9] = {{4, half, 32},
              {1, 48, 32},
              {1},
              {1},
              {4, half, 48},
              {4096},
              "below 2^31 (got M=4294967296"};
  GemmCallPlan p;
  CHECK_EQ(jax_nvfp4::PlanBf16Gemm(good.a, good.b, good.a_amax, good.b_amax,
                                   good.out, good.workspace, &p),
           "");
  for (const Case& c : cases) {
    CHECK_CONTAINS(jax_nvfp4::PlanBf16Gemm(c.a, c.b, c.a_amax, c.b_amax, c.out,
                                           c.workspace, &p),
                   c.message);
  }
  // Refusals of malformed operands name the function that prepares them.
  CHECK_CONTAINS(
      jax_nvfp4::PlanBf16Gemm(cases[0].a, good.b, good.a_amax, good.b_amax,
                              good.out, good.workspace, &p),
      "jax_nvfp4.backends.bf16_gemm.matmul_bf16");
}

// --- FP4 GEMM ----------------------------------------------------------------

// a [2, 128, 128 elements], b [b_batch, 256, 128 elements].
std::string PlanFp4(int64_t b_batch, int64_t a_amax, int64_t b_amax,
                    GemmCallPlan* p) {
  return jax_nvfp4::PlanFp4Gemm({2, 128, 64}, {2, 128 * 8}, {a_amax},
                                {b_batch, 256, 64}, {b_batch, 256 * 8},
                                {b_amax}, {2, 128, 256}, {4096}, p);
}

TEST(Fp4OneLaunchPerItemAtItsCodesAndScales) {
  GemmCallPlan p;
  CHECK_EQ(PlanFp4(1, 2, 1, &p), "");
  CHECK_EQ(p.batch, 2);
  CHECK_EQ((Shape{p.m, p.n, p.k}), (Shape{128, 256, 128}));
  CHECK_EQ(p.alphas, 2);
  CHECK_EQ(p.a_amax_stride, 1);
  CHECK_EQ(p.b_amax_stride, 0);
  CHECK_EQ(p.workspace_head_bytes, 256);
  CHECK_EQ(p.workspace_bytes, 4096 - 256);
  CHECK(p.zeros.empty());
  std::vector<GemmLaunch> want;
  for (int64_t i = 0; i < 2; ++i) {
    GemmLaunch l = Launch(128, 256, 128, 128);
    l.a = i * 128 * 64;        // bytes of codes
    l.a_scales = i * 128 * 8;  // a scale byte per 16 elements
    l.out = i * 128 * 256;
    l.alpha = i;
    want.push_back(l);  // b shared: offsets 0
  }
  CheckLaunches(p, want);

  CHECK_EQ(PlanFp4(2, 1, 1, &p), "");  // one alpha, b per item
  CHECK_EQ(p.alphas, 1);
  for (int64_t i = 0; i < 2; ++i) {
    want[i].b = i * 256 * 64;
    want[i].b_scales = i * 256 * 8;
    want[i].alpha = 0;
  }
  CheckLaunches(p, want);
}

TEST(Fp4HeadGrowsWithTheBatch) {
  GemmCallPlan p;
  const int64_t batch = 70;  // 71 floats: 284 bytes, 512 with padding
  CHECK_CONTAINS(jax_nvfp4::PlanFp4Gemm({batch, 128, 32}, {batch, 512}, {batch},
                                        {1, 128, 32}, {1, 512}, {1},
                                        {batch, 128, 128}, {300}, &p),
                 "at least 512 bytes");
  CHECK_EQ(jax_nvfp4::PlanFp4Gemm({batch, 128, 32}, {batch, 512}, {batch},
                                  {1, 128, 32}, {1, 512}, {1},
                                  {batch, 128, 128}, {4096}, &p),
           "");
  CHECK_EQ(p.workspace_head_bytes, 512);
  CHECK_EQ(p.launches.size(), static_cast<size_t>(batch));
}

TEST(Fp4EmptySumZeroesOut) {
  GemmCallPlan p;
  CHECK_EQ(jax_nvfp4::PlanFp4Gemm({2, 128, 0}, {2, 0}, {2}, {1, 128, 0}, {1, 0},
                                  {1}, {2, 128, 128}, {4096}, &p),
           "");
  CHECK(p.launches.empty());
  CheckZeros(p, {{0, 2 * 128 * 128}});
}

TEST(Fp4RefusalsSayWhatIsWrong) {
  struct Case {
    Shape a_codes, a_scales, a_amax, b_codes, b_scales, b_amax, out, workspace;
    const char* message;
  };
  const Case good = {{2, 128, 32},  {2, 512}, {2}, {1, 128, 32}, {1, 512}, {1},
                     {2, 128, 128}, {4096},   ""};
  std::vector<Case> cases(10, good);
  cases[0].a_codes = {2, 100, 32};
  cases[0].message = "M and N must be multiples of 128 (got M=100, N=128)";
  cases[9].b_codes = {1, 100, 32};
  cases[9].b_scales = {1, 400};
  cases[9].message = "M and N must be multiples of 128 (got M=128, N=100)";
  cases[1].b_codes = {1, 128, 48};
  cases[1].message = "a and b must have the same K, a multiple of 64";
  cases[2].b_codes = {3, 128, 32};
  cases[2].b_scales = {3, 512};
  cases[2].message = "b's batch must be 1 or a's (2), got 3";
  cases[3].a_scales = {2, 511};
  cases[3].message = "the swizzled block scales of the padded operands";
  cases[4].a_amax = {3};
  cases[4].message = "each amax must have 1 value or one per item";
  cases[5].b_amax = {2};
  cases[5].message = "each amax";
  cases[6].out = {2, 128, 256};
  cases[6].message = "out must be [batch, M, N] = [2, 128, 128]";
  cases[7].workspace = {4};
  cases[7].message = "at least 256 bytes";
  cases[8].a_amax = {1, 2};
  cases[8].message = "the amaxes and the workspace rank 1";
  GemmCallPlan p;
  CHECK_EQ(jax_nvfp4::PlanFp4Gemm(good.a_codes, good.a_scales, good.a_amax,
                                  good.b_codes, good.b_scales, good.b_amax,
                                  good.out, good.workspace, &p),
           "");
  for (const Case& c : cases) {
    CHECK_CONTAINS(
        jax_nvfp4::PlanFp4Gemm(c.a_codes, c.a_scales, c.a_amax, c.b_codes,
                               c.b_scales, c.b_amax, c.out, c.workspace, &p),
        c.message);
  }
  CHECK_CONTAINS(jax_nvfp4::PlanFp4Gemm(
                     cases[0].a_codes, good.a_scales, good.a_amax, good.b_codes,
                     good.b_scales, good.b_amax, good.out, good.workspace, &p),
                 "prepare the operands with "
                 "jax_nvfp4.backends.fp4_gemm.native_operands");
}

// --- grouped FP4 GEMM --------------------------------------------------------

std::string PlanGrouped(bool tokens, Shape a_codes, Shape a_scales,
                        Shape b_codes, Shape b_scales, Shape a_amax,
                        Shape b_amax, Shape out, Shape workspace, Shape sizes,
                        Fp4GroupedPlan* p) {
  std::string error = jax_nvfp4::PlanGroupedFp4Shapes(
      tokens, a_codes, a_scales, b_codes, b_scales,
      {static_cast<int64_t>(sizes.size())}, a_amax, b_amax, out, workspace, p);
  if (error.empty()) error = jax_nvfp4::PlanGroupedFp4Launches(sizes, p);
  return error;
}

TEST(GroupedRowsFormLaunchesEachGroupOnItsRows) {
  // R = 512 token rows, K = 64, N = 128; groups of 128, 0 and 256 rows.
  Fp4GroupedPlan p;
  CHECK_EQ(PlanGrouped(false, {512, 32}, {512 * 4}, {3, 128, 32}, {3 * 128 * 4},
                       {3}, {3}, {512, 128}, {4096}, {128, 0, 256}, &p),
           "");
  CHECK(p.grouped);
  CHECK(!p.tokens);
  CHECK_EQ((Shape{p.batch, p.m, p.n, p.k}), (Shape{3, 512, 128, 64}));
  CHECK_EQ(p.alphas, 3);
  CHECK_EQ(p.a_amax_stride, 1);
  CHECK_EQ(p.b_amax_stride, 1);
  CHECK_EQ(p.workspace_head_bytes, 256);
  GemmLaunch g0 = Launch(128, 128, 64, 64);
  g0.group = 0;
  GemmLaunch g2 = Launch(256, 128, 64, 64);
  g2.a = 128 * 32;              // row 128 of [R, K/2] codes
  g2.b = 2 * 128 * 32;          // b[2]
  g2.a_scales = 128 * 64 / 16;  // row 128's scales
  g2.b_scales = 2 * 128 * 64 / 16;
  g2.out = 128 * 128;
  g2.alpha = 2;
  g2.group = 2;
  CheckLaunches(p, {g0, g2});
  CheckZeros(p, {{384 * 128, 512 * 128}});  // the rows past the groups
}

TEST(GroupedTokensFormLaunchesEachGroupOnItsTokens) {
  // M = 128, N = 256, R = 512 tokens; groups of 128, 0 and 384 tokens.
  Fp4GroupedPlan p;
  CHECK_EQ(PlanGrouped(true, {128, 256}, {128 * 32}, {256, 256}, {256 * 32},
                       {3}, {3}, {3, 128, 256}, {4096}, {128, 0, 384}, &p),
           "");
  CHECK(p.tokens);
  CHECK_EQ((Shape{p.batch, p.m, p.n, p.k}), (Shape{3, 128, 256, 512}));
  GemmLaunch g0 = Launch(128, 256, 128, 512);
  g0.group = 0;
  GemmLaunch g2 = Launch(128, 256, 384, 512);
  g2.a = 64;  // token 128 of rows of R/2 bytes
  g2.b = 64;
  g2.a_scales = 128 * 128 / 16;  // group-major: after group 0's block
  g2.b_scales = 128 * 256 / 16;
  g2.out = 2 * 128 * 256;
  g2.alpha = 2;
  g2.group = 2;
  CheckLaunches(p, {g0, g2});
  CheckZeros(p, {{128 * 256, 2 * 128 * 256}});  // the empty group's out[1]
}

TEST(GroupedRefusalsSayWhatIsWrong) {
  struct Case {
    Shape a_codes, a_scales, b_codes, b_scales, a_amax, b_amax, out, workspace,
        sizes;
    const char* message;
  };
  const Case good = {{256, 32}, {256 * 4},  {2, 128, 32}, {2 * 128 * 4}, {2},
                     {2},       {256, 128}, {4096},       {128, 0},      ""};
  std::vector<Case> cases(8, good);
  cases[0].sizes = {100, 28};
  cases[0].message =
      "group 0 has 100 rows at row 0: the padded group sizes "
      "must be non-negative multiples of 128";
  cases[1].sizes = {256, 128};
  cases[1].message = "within the buffer's 256 rows";
  cases[2].sizes = {-128, 128};
  cases[2].message = "non-negative";
  cases[3].a_amax = {3};
  cases[3].message = "one value per group (2)";
  cases[4].out = {256, 64};
  cases[4].message = "out must be [R, N] = [256, 128]";
  cases[5].a_codes = {200, 32};
  cases[5].a_scales = {200 * 4};
  cases[5].out = {200, 128};
  cases[5].message = "must be multiples of 128 (got R=200, N=128)";
  cases[6].workspace = {8};
  cases[6].message = "at least 256 bytes (beta and one alpha per group)";
  cases[7].b_codes = {2, 128, 16};
  cases[7].message = "b_codes must be [G, N, K/2] with a's K=64 and G=2";
  Fp4GroupedPlan p;
  CHECK_EQ(PlanGrouped(false, good.a_codes, good.a_scales, good.b_codes,
                       good.b_scales, good.a_amax, good.b_amax, good.out,
                       good.workspace, good.sizes, &p),
           "");
  for (const Case& c : cases) {
    CHECK_CONTAINS(
        PlanGrouped(false, c.a_codes, c.a_scales, c.b_codes, c.b_scales,
                    c.a_amax, c.b_amax, c.out, c.workspace, c.sizes, &p),
        c.message);
  }
  // The tokens form's own shapes.
  CHECK_CONTAINS(
      PlanGrouped(true, {128, 256}, {128 * 32}, {256, 128}, {256 * 32}, {1},
                  {1}, {1, 128, 256}, {4096}, {128}, &p),
      "a and b must hold the same tokens (R=512 and 256)");
  CHECK_CONTAINS(
      PlanGrouped(true, {100, 256}, {100 * 32}, {256, 256}, {256 * 32}, {1},
                  {1}, {1, 100, 256}, {4096}, {128}, &p),
      "(got R=512, M=100, N=256)");
  // The handler reads as many sizes as the shapes said.
  CHECK_EQ(jax_nvfp4::PlanGroupedFp4Shapes(
               false, good.a_codes, good.a_scales, good.b_codes, good.b_scales,
               {2}, good.a_amax, good.b_amax, good.out, good.workspace, &p),
           "");
  CHECK_EQ(jax_nvfp4::PlanGroupedFp4Launches({128}, &p),
           "expected 2 group sizes, got 1");
}

}  // namespace
