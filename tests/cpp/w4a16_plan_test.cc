// The launch plan of the W4A16 GEMM (ffi/gemm/mma/w4a16_gemm_plan.h), which
// Python sizes the handler's workspace with, and the rule of the fused
// quantize kernel (ffi/cuda/fused_quantize_rule.h): the two host-side rules
// the product extension exports.
#include <cstdint>
#include <string>

#include "check.h"
#include "cuda/fused_quantize_rule.h"
#include "gemm/mma/w4a16_gemm_plan.h"

namespace {

using jax_nvfp4::W4A16Plan;

W4A16Plan Plan(int64_t m, int64_t n, int64_t k) {
  W4A16Plan p;
  CHECK_EQ(jax_nvfp4::PlanW4A16(m, n, k, &p), "");
  return p;
}

TEST(W4A16OneRowTileWithLongSlices) {
  // 16 rows: one 16-row tile, 2 column tiles of 8 per warp (128 columns),
  // slices of 16 chunks of 128 (2048 of K).
  const W4A16Plan p = Plan(16, 14336, 4096);
  CHECK_EQ(p.config.m_tiles, 1);
  CHECK_EQ(p.config.tiles, 2);
  CHECK_EQ(p.config.depth, 3);
  CHECK_EQ(p.config.chunks, 16);
  CHECK_EQ(p.row_tiles, 1);
  CHECK_EQ(p.column_tiles, 112);    // 14336 / 128
  CHECK_EQ(p.slices, 2);            // 4096 / 2048
  CHECK_EQ(p.arrivals_bytes, 448);  // a uint32 per tile
  CHECK_EQ(p.partial_offset, 512);
  // float32 partial sums [slices, M, N] where K is split.
  CHECK_EQ(p.workspace_bytes, 512 + 4 * 2 * 16 * 14336);
}

TEST(W4A16TallerTilesAsRowsGrow) {
  CHECK_EQ(Plan(17, 64, 256).config.m_tiles, 2);
  CHECK_EQ(Plan(32, 64, 256).config.m_tiles, 2);
  const W4A16Plan tall = Plan(64, 64, 4096);
  CHECK_EQ(tall.config.m_tiles, 4);
  CHECK_EQ(tall.config.chunks, 4);
  CHECK_EQ(tall.slices, 8);                   // 4096 / 512
  CHECK_EQ(Plan(300, 64, 256).row_tiles, 5);  // ceil(300 / 64)
  // Every configuration's x slice is 64 KB of shared memory.
  for (int64_t m : {1, 16, 17, 32, 33, 64, 1000}) {
    const W4A16Plan p = Plan(m, 64, 256);
    CHECK_EQ(16 * p.config.m_tiles * 128 * p.config.chunks * 2, 64 * 1024);
  }
}

TEST(W4A16PartialSumsOnlyWhereKIsSplit) {
  const W4A16Plan one = Plan(8, 130, 2048);  // one slice of 2048
  CHECK_EQ(one.slices, 1);
  CHECK_EQ(one.column_tiles, 2);
  CHECK_EQ(one.arrivals_bytes, 8);
  CHECK_EQ(one.workspace_bytes, one.partial_offset);
  CHECK_EQ(one.partial_offset, 256);
  const W4A16Plan two = Plan(8, 64, 2176);  // 17 chunks: 2 slices
  CHECK_EQ(two.slices, 2);
  CHECK_EQ(two.workspace_bytes, 256 + 4 * 2 * 8 * 64);
  CHECK_EQ(Plan(8, 64, 0).slices, 1);
  CHECK_EQ(Plan(0, 64, 256).row_tiles, 0);
}

TEST(W4A16RefusalsSayWhatToChange) {
  W4A16Plan p;
  CHECK_CONTAINS(jax_nvfp4::PlanW4A16(8, 64, 200, &p),
                 "K a multiple of 128 and N even, got K = 200, N = 64");
  CHECK_CONTAINS(jax_nvfp4::PlanW4A16(8, 63, 256, &p), "N even");
  CHECK_CONTAINS(jax_nvfp4::PlanW4A16(8, 63, 256, &p),
                 "jax_nvfp4 runs the decoding GEMM otherwise");
  CHECK_EQ(jax_nvfp4::PlanW4A16(-1, 64, 256, &p), "negative dimensions");
  // 65535 row tiles of 64 rows at most (grid.z), K in 65535 slices.
  CHECK_EQ(jax_nvfp4::PlanW4A16(65535 * 64, 64, 256, &p), "");
  CHECK_CONTAINS(jax_nvfp4::PlanW4A16(65535 * 64 + 1, 64, 256, &p),
                 "at most 4194240 rows of x");
}

TEST(FusedQuantizeWritesValuesForTheKernelsOptionsOnly) {
  using jax_nvfp4::FusedQuantizeWritesValues;
  // bf16 x, the same block shape both ways, RHT on the columns of 1x16
  // blocks only.
  CHECK(FusedQuantizeWritesValues(true, 1, false, 1, false));
  CHECK(FusedQuantizeWritesValues(true, 1, false, 1, true));
  CHECK(FusedQuantizeWritesValues(true, 16, false, 16, false));
  CHECK(!FusedQuantizeWritesValues(false, 1, false, 1, false));  // f32 x
  CHECK(!FusedQuantizeWritesValues(true, 1, true, 1, false));    // row RHT
  CHECK(!FusedQuantizeWritesValues(true, 1, false, 16, false));  // shapes
  CHECK(!FusedQuantizeWritesValues(true, 16, false, 16, true));  // 16x16 RHT
}

}  // namespace
