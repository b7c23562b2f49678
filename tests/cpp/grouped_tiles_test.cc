// The grouped GEMM engine's tiles (ffi/gemm/engine/grouped_tiles.h) against
// their definition, by enumerating every tile of a persistent grid: each
// group's rows (rows form) or its M x N outputs (tokens form) are covered
// exactly once, no tile holds another group's rows or items, empty groups
// have no rows-form tiles, and the tokens form runs the longest groups
// first.
#include "gemm/engine/grouped_tiles.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "check.h"

namespace {

namespace engine = jax_nvfp4::engine;

const std::vector<std::vector<int>> kSizes = {
    {10922, 5461, 10922, 5461},  // moe_bench's 2:1 split
    {0, 0, 100, 0, 3, 0, 0, 1},  // empty groups
    {1, 2, 3, 4, 5, 6, 7, 8},    // unaligned, smaller than a block
    {128, 256, 16, 17},          // exact blocks and one row past
    {0},                         // nothing at all
    {-5, 40},                    // a negative size counts as 0
};

TEST(RowsTilesCoverEachGroupsRowsOnce) {
  for (const auto& sizes : kSizes) {
    const int groups = static_cast<int>(sizes.size());
    for (const auto& [block_rows, block_cols, cols] :
         {std::tuple{128, 256, 1024}, std::tuple{64, 128, 200},
          std::tuple{16, 16, 16}}) {
      const int col_tiles = engine::CeilDiv(cols, block_cols);
      std::vector<int> start(groups), tile_end(groups);
      const int tiles =
          engine::RowsTiles(sizes.data(), groups, block_rows, col_tiles,
                            start.data(), tile_end.data());
      // Each (buffer row, column tile) once, and only the groups' rows.
      std::map<std::pair<int, int>, int> seen;
      int previous_group = 0;
      for (int t = 0; t < tiles; ++t) {
        const engine::RowsTile tile =
            engine::RowsTileAt(t, sizes.data(), start.data(), tile_end.data(),
                               groups, block_rows, block_cols, col_tiles);
        CHECK(tile.group >= previous_group);  // group by group
        previous_group = tile.group;
        CHECK(tile.rows >= 1 && tile.rows <= block_rows);
        CHECK_EQ(tile.col % block_cols, 0);
        CHECK(tile.col < cols);
        const int first = start[tile.group];
        CHECK(tile.row >= first);
        CHECK(tile.row + tile.rows <= first + sizes[tile.group]);
        CHECK_EQ(first % engine::kItemRows, 0);  // groups start on items
        for (int r = tile.row; r < tile.row + tile.rows; ++r) {
          ++seen[{r, tile.col}];
        }
      }
      int expected = 0;
      for (int g = 0; g < groups; ++g) {
        const int size = std::max(sizes[g], 0);
        for (int r = start[g]; r < start[g] + size; ++r) {
          for (int c = 0; c < col_tiles; ++c) {
            CHECK_EQ_FOR((seen[{r, c * block_cols}]), 1, r);
            ++expected;
          }
        }
      }
      CHECK_EQ(static_cast<int>(seen.size()), expected);
    }
  }
}

TEST(RowsTilesStartGroupsAtPaddedOffsets) {
  const std::vector<int> sizes = {5, 0, 16, 17};
  std::vector<int> start(4), tile_end(4);
  const int tiles =
      engine::RowsTiles(sizes.data(), 4, 128, 2, start.data(), tile_end.data());
  CHECK_EQ(start, (std::vector<int>{0, 16, 16, 32}));
  CHECK_EQ(tile_end, (std::vector<int>{2, 2, 4, 6}));
  CHECK_EQ(tiles, 6);
  CHECK_EQ(engine::GroupOfTile(1, tile_end.data(), 4), 0);
  CHECK_EQ(engine::GroupOfTile(2, tile_end.data(), 4), 2);  // 1 is empty
  CHECK_EQ(engine::GroupOfTile(5, tile_end.data(), 4), 3);
  // Granule 1 (the engine's rows form): groups are plain runs of rows.
  engine::RowsTiles(sizes.data(), 4, 128, 2, start.data(), tile_end.data(), 1);
  CHECK_EQ(start, (std::vector<int>{0, 5, 5, 21}));
  CHECK_EQ(tile_end, (std::vector<int>{2, 2, 4, 6}));
}

TEST(TokensTilesCoverEveryGroupsOutputsOnceLongestFirst) {
  for (const auto& sizes : kSizes) {
    const int groups = static_cast<int>(sizes.size());
    const int block_m = 128, block_n = 256, m = 300, n = 512;
    const int m_tiles = engine::CeilDiv(m, block_m);
    const int n_tiles = engine::CeilDiv(n, block_n);
    std::vector<int> item_begin(groups), order(groups);
    engine::TokensTables(sizes.data(), groups, item_begin.data(), order.data());
    std::map<std::tuple<int, int, int>, int> seen;
    int previous_size = 1 << 30;
    int previous_group = -1;
    for (int t = 0; t < groups * m_tiles * n_tiles; ++t) {
      const engine::TokensTile tile =
          engine::TokensTileAt(t, sizes.data(), item_begin.data(), order.data(),
                               block_m, block_n, m_tiles, n_tiles);
      ++seen[{tile.group, tile.m, tile.n}];
      const int size = std::max(sizes[tile.group], 0);
      CHECK(size <= previous_size);  // longest first
      if (size == previous_size && tile.group != previous_group) {
        CHECK(tile.group > previous_group);  // ties by index
      }
      previous_size = size;
      previous_group = tile.group;
      // The group's own items: its padded tokens, from its padded start.
      int padded_before = 0;
      for (int g = 0; g < tile.group; ++g) {
        padded_before += engine::PaddedSize(std::max(sizes[g], 0));
      }
      CHECK_EQ(tile.item_begin, padded_before / engine::kItemRows);
      CHECK_EQ(tile.item_end - tile.item_begin,
               engine::CeilDiv(size, engine::kItemRows));
    }
    CHECK_EQ(static_cast<int>(seen.size()), groups * m_tiles * n_tiles);
    for (const auto& [key, count] : seen) CHECK_EQ(count, 1);
  }
}

TEST(ClampedSizesKeepEveryGroupInsideTheBuffer) {
  const std::vector<std::pair<std::vector<int>, int>> cases = {
      {{40, 24, 0, 32}, 1 << 20},  // fits: unchanged
      {{40, 24, 0, 32}, 96},       // the last group cut to what is left
      {{-3, 2000000000, 2000000000, 7}, 4096},  // negative, overflowing
      {{17, 17}, 40},  // the second group's padding cut off
      {{5}, 0},        // no buffer at all
  };
  for (const auto& [read, capacity] : cases) {
    const int groups = static_cast<int>(read.size());
    std::vector<int> sizes(groups);
    engine::ClampedSizes(read.data(), groups, capacity, sizes.data());
    int64_t end = 0;  // the padded rows of the groups so far
    for (int g = 0; g < groups; ++g) {
      CHECK(sizes[g] >= 0);
      CHECK(sizes[g] <= std::max(read[g], 0));
      CHECK(end + sizes[g] <= capacity);  // the group's rows are inside
      if (end + engine::PaddedSize(std::max(read[g], 0)) <= capacity) {
        CHECK_EQ(sizes[g], std::max(read[g], 0));  // what fits is kept
      }
      end = std::min<int64_t>(end + engine::PaddedSize(sizes[g]), capacity);
    }
  }
}

}  // namespace
