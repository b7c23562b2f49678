// The Blackwell block-scale layout (ffi/numerics/scale_layout.h) against its
// definition: byte j * 16 + i * 4 + c % 4 of 128x4 tile (r / 128, c / 4),
// tiles row-major, for row r = 128 t + 32 i + j; every scale at its own
// byte inside the padded matrix.
#include "numerics/scale_layout.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "check.h"

namespace {

TEST(RoundUpToMultiples) {
  CHECK_EQ(jax_nvfp4::RoundUp(0, 128), 0);
  CHECK_EQ(jax_nvfp4::RoundUp(1, 128), 128);
  CHECK_EQ(jax_nvfp4::RoundUp(128, 128), 128);
  CHECK_EQ(jax_nvfp4::RoundUp(129, 4), 132);
}

TEST(SwizzledOffsetsFollowTheDefinition) {
  const std::pair<int64_t, int64_t> shapes[] = {{128, 4}, {256, 8},  {130, 5},
                                                {1, 1},   {300, 13}, {512, 64}};
  for (const auto& [rows, cols] : shapes) {
    const int64_t col_tiles = (cols + 3) / 4;
    const int64_t bytes = jax_nvfp4::SwizzledScaleBytes(rows, cols);
    CHECK_EQ(bytes, ((rows + 127) / 128 * 128) * (col_tiles * 4));
    std::vector<int> seen(bytes, 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t tile = (r / 128) * col_tiles + c / 4;
        const int64_t want =
            tile * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
        const int64_t got = jax_nvfp4::SwizzledScaleOffset(r, c, cols);
        CHECK_EQ_FOR(got, want, r * 1000 + c);
        if (got >= 0 && got < bytes) ++seen[got];
      }
    }
    int64_t used = 0;
    for (int count : seen) {
      CHECK(count <= 1);  // no two scales share a byte
      used += count;
    }
    CHECK_EQ(used, rows * cols);
  }
}

TEST(SwizzledOffsetsOfOneTileByHand) {
  // Rows 0, 32, 64, 96 of a tile are adjacent 4-byte groups; row 1 follows
  // 16 bytes later; the next column tile starts at 512.
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(0, 0, 8), 0);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(0, 3, 8), 3);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(32, 0, 8), 4);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(96, 1, 8), 13);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(1, 0, 8), 16);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(0, 4, 8), 512);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(128, 0, 8), 1024);
  CHECK_EQ(jax_nvfp4::SwizzledScaleOffset(127, 7, 8), 512 + 31 * 16 + 12 + 3);
}

}  // namespace
