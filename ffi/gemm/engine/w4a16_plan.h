// The launch plan of the engine's W4A16 GEMM (w4a16.cuh, handler
// w4a16_gemm.cu), free of CUDA so that CPU tests check it.
//
// The weight is wgmma's M side: a CTA owns 128 weight rows (two consumer
// warpgroups of 64) and `tokens` rows of x (wgmma's N: 16, 32, 64 or 128,
// the smallest that holds M, so that one token fills an n16 tile), over
// a range of K in stages of 64 or 256 elements. The grid is (token tiles,
// weight tiles, splits): token tiles vary fastest, so the CTAs that share a
// weight tile run together and read it from HBM once. When the tiles alone
// leave multiprocessors idle (few tokens, few weight rows), K is split into up
// to 8 slices of whole 256-element blocks; the slices of a tile form one
// thread-block cluster and add their partial sums through distributed
// shared memory in slice order, so the result is deterministic and no
// workspace exists.
#ifndef JAX_NVFP4_FFI_GEMM_ENGINE_W4A16_PLAN_H_
#define JAX_NVFP4_FFI_GEMM_ENGINE_W4A16_PLAN_H_

#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define W4A16_PLAN_HD __host__ __device__ __forceinline__
#else
#define W4A16_PLAN_HD inline
#endif

namespace jax_nvfp4 {
namespace engine {

inline constexpr int kW4A16WeightRows = 128;  // per CTA
// The scales of 256 elements of K: TMA's 16-byte minimum row of a box.
inline constexpr int kW4A16ScaleK = 256;
inline constexpr int kW4A16MaxSplits = 8;  // a portable cluster
inline constexpr int kW4A16Threads = 288;  // two consumer warpgroups, a warp
inline constexpr int64_t kW4A16MaxGridY = 65535;

struct W4A16Config {
  int tokens;         // rows of x per tile
  int block_k;        // elements of K per stage: 64 or 256
  int stages;         // depth of the shared-memory ring
  int blocks_per_sm;  // CTAs a multiprocessor holds at once
};

// Bytes of one ring stage: x's tile, the codes' tile and the scales' tile
// of 256 elements (loaded on such a block's first stage only).
constexpr int64_t W4A16StageBytes(int tokens, int block_k) {
  return int64_t{tokens} * block_k * 2 +
         int64_t{kW4A16WeightRows} * block_k / 2 +
         int64_t{kW4A16WeightRows} * kW4A16ScaleK / 16;
}

// Dynamic shared memory of a configuration: the ring, its barriers and the
// 1024-byte alignment of the swizzled tiles. The epilogue reuses the ring.
constexpr int64_t W4A16SharedBytes(int tokens, int block_k, int stages) {
  return stages * W4A16StageBytes(tokens, block_k) + 2 * 8 * stages + 1024;
}

// Up to 64 tokens the GEMM is bound by the weight's bytes: stages of 256
// elements of K, so that TMA reads 128 contiguous bytes of each weight row
// (shorter rows leave HBM and the copy engine at a fraction of their rate),
// and two CTAs per multiprocessor (at most 112 registers a thread), so that
// one CTA's ring fills while the other's drains. 128 tokens: compute-bound,
// one CTA with a deeper ring of shorter stages and room for 64 accumulators
// a thread.
inline W4A16Config ChooseW4A16Config(int64_t m) {
  if (m <= 16) return {16, 256, 4, 2};
  if (m <= 32) return {32, 256, 3, 2};
  if (m <= 64) return {64, 256, 2, 2};
  return {128, 64, 9, 1};
}

struct W4A16Plan {
  W4A16Config config{};
  int64_t token_tiles = 0;   // grid.x
  int64_t weight_tiles = 0;  // grid.y
  int64_t splits = 0;        // grid.z, the cluster's size
  int64_t shared_bytes = 0;
};

// Empty if the engine takes x [M, K] (all groups' rows) and weights [N, K];
// otherwise what the caller of handler `name` must change.
inline std::string CheckW4A16Shape(const std::string& name, int64_t m,
                                   int64_t n, int64_t k) {
  if (m < 1 || n < 1 || k < 1) {
    return name + " needs M, N and K of at least 1";
  }
  if (k % kW4A16ScaleK != 0) {
    return name +
           " needs K a multiple of 256 (its scales are read 16 bytes a row), "
           "got K = " +
           std::to_string(k);
  }
  if (m > (int64_t{1} << 31) - 1 || k > (int64_t{1} << 31) - 1 ||
      n > kW4A16MaxGridY * kW4A16WeightRows) {
    return name + " takes M and K below 2^31 and N at most " +
           std::to_string(kW4A16MaxGridY * kW4A16WeightRows);
  }
  return "";
}

// The rest of a plan once its configuration and token tiles are set: the
// weight tiles, the split of K and the shared memory. K is split while the
// tiles fill at most half the CTAs the GPU holds and every slice keeps at
// least two 256-element blocks.
inline void CompleteW4A16Plan(int64_t n, int64_t k, int sms, W4A16Plan* p) {
  const W4A16Config c = p->config;
  p->weight_tiles = (n + kW4A16WeightRows - 1) / kW4A16WeightRows;
  const int64_t tiles = p->token_tiles * p->weight_tiles;
  const int64_t slots = int64_t{sms} * c.blocks_per_sm;
  const int64_t blocks = k / kW4A16ScaleK;
  p->splits = 1;
  while (p->splits < kW4A16MaxSplits && tiles * p->splits * 2 <= slots &&
         blocks >= 4 * p->splits) {
    p->splits *= 2;
  }
  p->shared_bytes = W4A16SharedBytes(c.tokens, c.block_k, c.stages);
}

// Empty on success; otherwise what the caller must change. `sms`: the
// device's multiprocessors.
inline std::string PlanW4A16(int64_t m, int64_t n, int64_t k, int sms,
                             W4A16Plan* p) {
  std::string error = CheckW4A16Shape("matmul_w4a16_sm90", m, n, k);
  if (!error.empty()) return error;
  p->config = ChooseW4A16Config(m);
  p->token_tiles = (m + p->config.tokens - 1) / p->config.tokens;
  CompleteW4A16Plan(n, k, sms, p);
  return "";
}

// The grouped form (ragged_dot, mixture-of-experts serving): x [T, K]
// holds the rows of G groups one after another, group g's rows times weight
// g of G stored one after another ([G * N, K / 2] codes). Each group's rows
// are cut into token tiles of their own, so that a tile never mixes two
// weights; grid.x is an upper bound on the tiles (ceil(T / tokens) + G), and
// the CTAs past the last group's tiles have nothing to do. The token tile
// follows the groups' mean size (a decode step's few rows per expert: 16).
inline std::string PlanW4A16Grouped(int64_t rows, int64_t groups, int64_t n,
                                    int64_t k, int sms, W4A16Plan* p) {
  const std::string name = "ragged_w4a16_sm90";
  std::string error = CheckW4A16Shape(name, rows, n, k);
  if (!error.empty()) return error;
  if (groups < 1) return name + " needs at least one group";
  if (groups * n > (int64_t{1} << 31) - 1) {
    return name + " takes G * N below 2^31 weight rows, got " +
           std::to_string(groups * n);
  }
  p->config = ChooseW4A16Config((rows + groups - 1) / groups);
  p->token_tiles = (rows + p->config.tokens - 1) / p->config.tokens + groups;
  if (p->token_tiles > (int64_t{1} << 31) - 1) {
    return name + " takes fewer than 2^31 token tiles";
  }
  CompleteW4A16Plan(n, k, sms, p);
  return "";
}

// Token tile `tile` of the grouped form: its group, its first row and the
// end of its group's rows (x's rows token0 .. min(token0 + tokens, end) - 1).
// Sizes are clamped to the rows that are left, so that negative sizes or a
// sum past `rows` read and write inside x and out. False: no such tile.
W4A16_PLAN_HD bool W4A16GroupTile(const int32_t* sizes, int groups,
                                  int64_t rows, int64_t tile, int tokens,
                                  int* group, int64_t* token0, int64_t* end) {
  int64_t begin = 0;
  for (int g = 0; g < groups; ++g) {
    int64_t size = sizes[g] < 0 ? 0 : sizes[g];
    if (size > rows - begin) size = rows - begin;
    const int64_t tiles = (size + tokens - 1) / tokens;
    if (tile < tiles) {
      *group = g;
      *token0 = begin + tile * tokens;
      *end = begin + size;
      return true;
    }
    tile -= tiles;
    begin += size;
  }
  return false;
}

// The 256-element blocks of K that slice `split` of `splits` sums.
W4A16_PLAN_HD void W4A16SliceBlocks(int64_t k, int split, int splits,
                                    int* begin, int* end) {
  const int64_t blocks = k / kW4A16ScaleK;
  *begin = static_cast<int>(blocks * split / splits);
  *end = static_cast<int>(blocks * (split + 1) / splits);
}

// The permuted contraction of the 16-token tile (w4a16.cuh). Of each 64
// elements of K, thread t of a quad decodes the 8 bytes of elements 16t ..
// 16t + 15 of its rows; byte 2j + h, elements W4A16PermutedElement(t, j, h)
// and the next, fills its A registers for k16 step j, columns 2t + 8h and
// 2t + 8h + 1: 4-byte column 8j + 4h + t of the group's 128-byte row of x.
W4A16_PLAN_HD int W4A16PermutedElement(int t, int step, int half) {
  return 16 * t + 4 * step + 2 * half;
}

// Where x's 4-byte piece p of a 64-element group (elements 2p, 2p + 1) goes
// in the permuted tile's row: the column wgmma reads those elements from.
W4A16_PLAN_HD int W4A16PermutedColumn(int piece) {
  const int t = piece >> 3, step = (piece >> 1) & 3, half = piece & 1;
  return 8 * step + 4 * half + t;
}

}  // namespace engine
}  // namespace jax_nvfp4

#undef W4A16_PLAN_HD

#endif  // JAX_NVFP4_FFI_GEMM_ENGINE_W4A16_PLAN_H_
