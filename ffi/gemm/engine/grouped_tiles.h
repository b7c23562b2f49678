// The tiles of the grouped GEMM engine's two forms, for a persistent grid:
// which group, rows, columns and token items tile t covers. Host and device
// code share it (the host unit tests enumerate every tile); a CTA builds the
// per-group tables once from the group sizes it reads on the device, so the
// launch needs no host sync.
//
// The token buffer holds group g's rows at [start_g, start_g + size_g), with
// start_g the sum of the sizes before g, each rounded up to a granule: 1 for
// the rows form (the primitive's groups are plain runs of rows; ragged_dot's
// sizes are multiples of 16 already), 16 tokens for the tokens form's items,
// 64 for the engine's lines.
//
// Rows form (FPROP, DGRAD): out[r, n] for the buffer rows r of each group.
// A tile is a block of `block_rows` rows of one group by `block_cols`
// columns; a group's last row block may hold fewer rows (`rows` < block):
// the epilogue stores only those, so rows of another group never reach
// this group's outputs. Tiles run group by group, a row block's column
// tiles together (the group's weight stays in L2 while its row blocks
// pass). Empty groups have no tiles.
//
// Tokens form (WGRAD): out[g] [M, N] summed over group g's tokens, in
// items of 16 tokens (or of another granule: the engine's 64-token lines).
// Every group has the same M x N tiles, each looping over the group's items
// [item_begin, item_end) (none for an empty group: the tile writes zeros).
// Groups run longest first (then by index), so the longest loops start first
// and the grid's tail is short.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TILES_H_
#define JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TILES_H_

#if defined(__CUDACC__)
#define GROUPED_TILES_HD __host__ __device__ __forceinline__
#else
#define GROUPED_TILES_HD inline
#endif

namespace jax_nvfp4 {
namespace engine {

constexpr int kItemRows = 16;  // tokens per item; groups start on items

GROUPED_TILES_HD int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// A group's rows (tokens) rounded up to whole items of `granule`.
GROUPED_TILES_HD int PaddedSize(int size, int granule = kItemRows) {
  return CeilDiv(size, granule) * granule;
}

// The group sizes as the tiles use them, from the ones read on the device:
// negative sizes count as 0, and the groups are cut off where their rows,
// padded to `granule`, would pass `capacity` (the buffer's rows or tokens),
// so that every tile stays inside the buffer and no sum overflows, whatever
// the sizes.
GROUPED_TILES_HD void ClampedSizes(const int* read, int groups, int capacity,
                                   int* sizes, int granule = kItemRows) {
  int left = capacity;
  for (int g = 0; g < groups; ++g) {
    int size = read[g] > 0 ? read[g] : 0;
    size = size < left ? size : left;
    sizes[g] = size;
    const int padded = PaddedSize(size, granule);
    left -= padded < left ? padded : left;
  }
}

struct RowsTile {
  int group;
  int row;   // the first buffer row
  int rows;  // rows of the group in this tile, 1 .. block_rows
  int col;   // the first output column
};

struct TokensTile {
  int group;
  int m;           // the first row of out[group]
  int n;           // the first column of out[group]
  int item_begin;  // the group's items [item_begin, item_end)
  int item_end;
};

// The rows form's tables from the group sizes (negative sizes count as 0):
// start[g] (the group's first buffer row, groups from whole `granule`s)
// and tile_end[g] (the tiles of groups 0..g); returns the number of tiles.
GROUPED_TILES_HD int RowsTiles(const int* sizes, int groups, int block_rows,
                               int col_tiles, int* start, int* tile_end,
                               int granule = kItemRows) {
  int row = 0, tiles = 0;
  for (int g = 0; g < groups; ++g) {
    const int size = sizes[g] > 0 ? sizes[g] : 0;
    start[g] = row;
    tiles += CeilDiv(size, block_rows) * col_tiles;
    tile_end[g] = tiles;
    row += PaddedSize(size, granule);
  }
  return tiles;
}

// The first g with t < tile_end[g] (binary search; t < tile_end[groups - 1]).
GROUPED_TILES_HD int GroupOfTile(int t, const int* tile_end, int groups) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (t < tile_end[mid]) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// Tile t (0 <= t < the count RowsTiles returned) of the rows form.
GROUPED_TILES_HD RowsTile RowsTileAt(int t, const int* sizes, const int* start,
                                     const int* tile_end, int groups,
                                     int block_rows, int block_cols,
                                     int col_tiles) {
  const int g = GroupOfTile(t, tile_end, groups);
  const int local = t - (g > 0 ? tile_end[g - 1] : 0);
  const int block = local / col_tiles;
  const int first = block * block_rows;
  const int left = sizes[g] - first;
  RowsTile tile;
  tile.group = g;
  tile.row = start[g] + first;
  tile.rows = left < block_rows ? left : block_rows;
  tile.col = (local % col_tiles) * block_cols;
  return tile;
}

// The tokens form's tables: item_begin[g] (the group's first item, each
// group starting on a whole item of `granule` tokens) and order[] (the
// groups longest first, ties by index: a stable insertion sort, as G is
// small).
GROUPED_TILES_HD void TokensTables(const int* sizes, int groups,
                                   int* item_begin, int* order,
                                   int granule = kItemRows) {
  int item = 0;
  for (int g = 0; g < groups; ++g) {
    const int size = sizes[g] > 0 ? sizes[g] : 0;
    item_begin[g] = item;
    item += PaddedSize(size, granule) / granule;
    int i = g;
    while (i > 0 &&
           (sizes[order[i - 1]] > 0 ? sizes[order[i - 1]] : 0) < size) {
      order[i] = order[i - 1];
      --i;
    }
    order[i] = g;
  }
}

// Tile t (0 <= t < groups * m_tiles * n_tiles) of the tokens form, items
// of `granule` tokens as in TokensTables.
GROUPED_TILES_HD TokensTile TokensTileAt(int t, const int* sizes,
                                         const int* item_begin,
                                         const int* order, int block_m,
                                         int block_n, int m_tiles, int n_tiles,
                                         int granule = kItemRows) {
  const int per_group = m_tiles * n_tiles;
  const int g = order[t / per_group];
  const int local = t % per_group;
  const int size = sizes[g] > 0 ? sizes[g] : 0;
  TokensTile tile;
  tile.group = g;
  tile.m = (local / n_tiles) * block_m;
  tile.n = (local % n_tiles) * block_n;
  tile.item_begin = item_begin[g];
  tile.item_end = item_begin[g] + PaddedSize(size, granule) / granule;
  return tile;
}

}  // namespace engine
}  // namespace jax_nvfp4

#undef GROUPED_TILES_HD

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_GROUPED_TILES_H_
