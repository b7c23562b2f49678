// The launch plans of the Hopper engine's grouped GEMM forms
// (ffi/gemm/engine/grouped_plan.h): the shapes they serve, what they refuse
// and why, and the persistent grid.
#include "gemm/engine/grouped_plan.h"

#include <string>

#include "check.h"

namespace {

namespace engine = jax_nvfp4::engine;

TEST(RowsPlanAtMoeBenchsShape) {
  engine::GroupedPlan p;
  // 65536 rows + 15 per group, K 2048, 8 experts of N 8192, 132 SMs.
  CHECK_EQ(engine::PlanGroupedRows(65536 + 120, 2048, 8, 8192, 132, &p),
           std::string());
  CHECK_EQ(p.tiles_bound, (513 + 8) * 32);
  CHECK_EQ(p.grid, 132);
  CHECK_EQ(p.shared_bytes, 4 * (128 + 256) * 64 * 2 + 64 + 1024);
  CHECK(p.shared_bytes <= 227 * 1024);  // what an H100 / H200 CTA may have
}

TEST(RowsPlanOfFewTilesHasFewCtas) {
  engine::GroupedPlan p;
  CHECK_EQ(engine::PlanGroupedRows(16, 64, 1, 256, 132, &p), std::string());
  CHECK_EQ(p.tiles_bound, 2);  // one row block, plus one per group
  CHECK_EQ(p.grid, 2);
  CHECK_EQ(engine::PlanGroupedRows(0, 64, 3, 256, 132, &p), std::string());
  CHECK_EQ(p.grid, 3);
}

TEST(RowsPlanRefusals) {
  engine::GroupedPlan p;
  CHECK_CONTAINS(engine::PlanGroupedRows(64, 20, 2, 256, 132, &p),
                 "K a multiple of 8");
  CHECK_CONTAINS(engine::PlanGroupedRows(64, 64, 2, 255, 132, &p), "N even");
  CHECK_CONTAINS(engine::PlanGroupedRows(64, 64, 65, 256, 132, &p),
                 "1 to 64 groups, got 65");
  CHECK_CONTAINS(engine::PlanGroupedRows(64, 64, 0, 256, 132, &p),
                 "groups, got 0");
  CHECK_CONTAINS(engine::PlanGroupedRows(64, 0, 2, 256, 132, &p), "empty");
  CHECK_CONTAINS(engine::PlanGroupedRows(int64_t{1} << 31, 64, 2, 256, 132, &p),
                 "2^31 rows");
  CHECK_CONTAINS(engine::PlanGroupedRows(64, 64, 64, 1 << 26, 132, &p),
                 "G * N");
}

TEST(TokensPlan) {
  engine::GroupedPlan p;
  // WGRAD of moe_bench's gate: dW [8, 2048, 8192] over 1026 lines.
  CHECK_EQ(engine::PlanGroupedTokens(1026, 2048, 8192, 8, 132, &p),
           std::string());
  CHECK_EQ(p.tiles_bound, 8 * 16 * 32);
  CHECK_EQ(p.grid, 132);
  CHECK_EQ(engine::PlanGroupedTokens(0, 200, 264, 1, 132, &p), std::string());
  CHECK_EQ(p.tiles_bound, 2 * 2);  // an empty group's tiles write zeros
  CHECK_EQ(p.grid, 4);
  CHECK_CONTAINS(engine::PlanGroupedTokens(10, 64, 7, 2, 132, &p), "N even");
  CHECK_CONTAINS(engine::PlanGroupedTokens(10, 64, 64, 100, 132, &p),
                 "1 to 64 groups");
  CHECK_CONTAINS(engine::PlanGroupedTokens(1 << 25, 64, 64, 2, 132, &p),
                 "2^31 tokens");
}

}  // namespace
