// The launch plan of the Hopper engine's W4A16 GEMM
// (ffi/gemm/engine/w4a16_plan.h): the configuration by rows of x, the
// split of K over a cluster, the slices' blocks, what it refuses and why;
// the permuted contraction's columns.
#include <string>

#include "check.h"
#include "gemm/engine/w4a16_plan.h"

namespace {

namespace engine = jax_nvfp4::engine;

engine::W4A16Plan Plan(int64_t m, int64_t n, int64_t k, int sms = 132) {
  engine::W4A16Plan p;
  CHECK_EQ(engine::PlanW4A16(m, n, k, sms, &p), std::string());
  return p;
}

TEST(W4A16EngineTokensPerTileFollowRows) {
  CHECK_EQ(Plan(1, 256, 256).config.tokens, 16);
  CHECK_EQ(Plan(16, 256, 256).config.tokens, 16);
  CHECK_EQ(Plan(17, 256, 256).config.tokens, 32);
  CHECK_EQ(Plan(64, 256, 256).config.tokens, 64);
  CHECK_EQ(Plan(65, 256, 256).config.tokens, 128);
  // Weight-bound tiles stream 256 elements of K a stage, two CTAs an SM;
  // the compute-bound one shorter stages, one CTA.
  CHECK_EQ(Plan(64, 256, 256).config.block_k, 256);
  CHECK_EQ(Plan(64, 256, 256).config.blocks_per_sm, 2);
  CHECK_EQ(Plan(2048, 256, 256).config.block_k, 64);
  CHECK_EQ(Plan(2048, 256, 256).config.blocks_per_sm, 1);
  CHECK_EQ(Plan(2048, 256, 256).token_tiles, 16);
}

TEST(W4A16EngineSharedMemoryFitsTheSm) {
  // What an H100 / H200 multiprocessor has: 228 KB, 1 KB reserved a CTA.
  for (int64_t m : {1, 17, 33, 100}) {
    const engine::W4A16Plan p = Plan(m, 4096, 4096);
    CHECK_EQ_FOR(p.shared_bytes,
                 engine::W4A16SharedBytes(p.config.tokens, p.config.block_k,
                                          p.config.stages),
                 m);
    CHECK(p.config.blocks_per_sm * (p.shared_bytes + 1024) <= 228 * 1024);
    // The epilogue's float32 tile (128 + 4 floats a token) fits the ring.
    CHECK(p.config.tokens * 132 * 4 <= p.shared_bytes - 1024);
  }
}

TEST(W4A16EngineSplitsKWhileSmsIdle) {
  // 112 weight tiles, 264 CTA slots: two slices fill them.
  CHECK_EQ(Plan(1, 14336, 4096).weight_tiles, 112);
  CHECK_EQ(Plan(1, 14336, 4096).splits, 2);
  CHECK_EQ(Plan(1, 28672, 8192).splits, 1);  // 224 tiles already
  CHECK_EQ(Plan(1, 4096, 14336).splits, 8);  // 32 tiles; at most 8
  CHECK_EQ(Plan(2048, 14336, 4096).splits, 1);
  // A slice keeps two 256-element blocks at least.
  CHECK_EQ(Plan(1, 128, 512).splits, 1);
  CHECK_EQ(Plan(1, 128, 1024).splits, 2);
}

TEST(W4A16EngineSlicesCoverKOnce) {
  for (int splits : {1, 2, 3, 8}) {
    int previous_end = 0;
    for (int z = 0; z < splits; ++z) {
      int begin = -1, end = -1;
      engine::W4A16SliceBlocks(56 * 256, z, splits, &begin, &end);
      CHECK_EQ_FOR(begin, previous_end, splits);
      CHECK(end - begin >= 56 / splits);
      previous_end = end;
    }
    CHECK_EQ_FOR(previous_end, 56, splits);
  }
}

TEST(W4A16EngineRefusesWhatItCannotRead) {
  engine::W4A16Plan p;
  CHECK_CONTAINS(engine::PlanW4A16(1, 256, 384, 132, &p),
                 "K a multiple of 256");
  CHECK_CONTAINS(engine::PlanW4A16(0, 256, 256, 132, &p), "at least 1");
  CHECK_CONTAINS(engine::PlanW4A16(1, 256, 0, 132, &p), "at least 1");
  CHECK_CONTAINS(engine::PlanW4A16(1, int64_t{65536} * 128, 256, 132, &p),
                 "N at most");
}

TEST(W4A16EngineGroupedPlanCoversEveryGroupsTiles) {
  engine::W4A16Plan p;
  // 8 experts x 16 rows: 16-token tiles, one spare tile per group.
  CHECK_EQ(engine::PlanW4A16Grouped(128, 8, 14336, 4096, 132, &p),
           std::string());
  CHECK_EQ(p.config.tokens, 16);
  CHECK_EQ(p.token_tiles, 8 + 8);
  CHECK_EQ(p.weight_tiles, 112);
  CHECK_EQ(p.splits, 1);
  // Prefill-sized groups take the compute-bound tile.
  CHECK_EQ(engine::PlanW4A16Grouped(8 * 2048, 8, 4096, 4096, 132, &p),
           std::string());
  CHECK_EQ(p.config.tokens, 128);
  CHECK_EQ(p.token_tiles, 128 + 8);
  CHECK_CONTAINS(engine::PlanW4A16Grouped(16, 0, 256, 256, 132, &p),
                 "at least one group");
  CHECK_CONTAINS(engine::PlanW4A16Grouped(16, 2, 256, 384, 132, &p),
                 "ragged_w4a16_sm90 needs K a multiple of 256");
  CHECK_CONTAINS(engine::PlanW4A16Grouped(16, 1 << 20, 4096, 256, 132, &p),
                 "G * N below 2^31");
}

TEST(W4A16EngineGroupTilesPartitionTheRows) {
  // Empty groups, a group off a multiple of 16, rows past the sizes' sum.
  const int32_t sizes[] = {0, 37, 16, 0, 5};
  const int64_t rows = 70;  // 58 in groups, 12 of padding
  int64_t covered[70] = {};
  int tiles = 0;
  for (int64_t tile = 0; tile < (rows + 15) / 16 + 5; ++tile) {
    int group = -1;
    int64_t token0 = -1, end = -1;
    if (!engine::W4A16GroupTile(sizes, 5, rows, tile, 16, &group, &token0,
                                &end)) {
      continue;
    }
    ++tiles;
    CHECK(sizes[group] > 0);
    CHECK(token0 < end && end <= rows);
    for (int64_t r = token0; r < end && r < token0 + 16; ++r) ++covered[r];
  }
  CHECK_EQ(tiles, 3 + 1 + 1);
  for (int64_t r = 0; r < rows; ++r) CHECK_EQ_FOR(covered[r], r < 58, r);
  // Group 1's rows 0..36 are tiles 0-2, ending at its end.
  int group = -1;
  int64_t token0 = -1, end = -1;
  CHECK(engine::W4A16GroupTile(sizes, 5, rows, 2, 16, &group, &token0, &end));
  CHECK_EQ(group, 1);
  CHECK_EQ(token0, 32);
  CHECK_EQ(end, 37);
  CHECK(engine::W4A16GroupTile(sizes, 5, rows, 4, 16, &group, &token0, &end));
  CHECK_EQ(group, 4);
  CHECK_EQ(token0, 53);
  CHECK_EQ(end, 58);
  // Sizes past the rows (or negative) are clamped: nothing outside x.
  const int32_t bad[] = {-3, 50, 50};
  int64_t last_end = 0;
  for (int64_t tile = 0; tile < 8; ++tile) {
    if (engine::W4A16GroupTile(bad, 3, 60, tile, 16, &group, &token0, &end)) {
      CHECK(end <= 60);
      last_end = end;
    }
  }
  CHECK_EQ(last_end, 60);
}

TEST(W4A16EnginePermutedTileMatchesTheDecodedRegisters) {
  // The producer's pieces land on distinct columns of the 128-byte row...
  bool taken[32] = {};
  for (int piece = 0; piece < 32; ++piece) {
    const int column = engine::W4A16PermutedColumn(piece);
    CHECK(column >= 0 && column < 32);
    CHECK(!taken[column]);
    taken[column] = true;
  }
  // ...and wgmma's column of each decoded register pair holds that pair's
  // elements: step j's columns 2t + 8h, +1 are 4-byte column 8j + 4h + t.
  for (int t = 0; t < 4; ++t) {
    for (int step = 0; step < 4; ++step) {
      for (int half = 0; half < 2; ++half) {
        const int element = engine::W4A16PermutedElement(t, step, half);
        CHECK_EQ(engine::W4A16PermutedColumn(element / 2),
                 (16 * step + 2 * t + 8 * half) / 2);
        // Thread t's elements are its 16 of the group, in its 8 bytes.
        CHECK(element >= 16 * t && element < 16 * t + 16);
        CHECK_EQ(element % 16 / 2, 2 * step + half);
      }
    }
  }
}

}  // namespace
