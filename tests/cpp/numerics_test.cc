// The NVFP4 numerics (ffi/numerics/nvfp4.h) against references written here
// from the formats' definitions: exhaustive tables of E4M3, E2M1, float16 and
// bfloat16, nearest rounding by brute force over each grid (ties to even,
// saturation, NaN), stochastic rounding's round-up counts over all 256
// random bytes, the global and block scales' edge cases, the RHT and the
// Philox known answers.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.h"
#include "numerics/nvfp4.h"

namespace {

using jax_nvfp4::BitsToFloat;
using jax_nvfp4::FloatBits;

// float8_e4m3fn by definition: bias 7, no infinities, S.1111.111 is NaN.
double E4M3Reference(int byte) {
  const int exponent = (byte >> 3) & 0xF, mantissa = byte & 7;
  double magnitude;
  if (exponent == 15 && mantissa == 7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -9);
  } else {
    magnitude = std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  }
  return (byte & 0x80) ? -magnitude : magnitude;
}

// E2M1 magnitudes by index.
const double kE2M1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

// The index of the grid value nearest to a >= 0 (ties to the even index),
// the last index for values past the grid.
int NearestIndex(const double* grid, int size, double a) {
  if (a >= grid[size - 1]) return size - 1;
  int best = 0;
  for (int i = 1; i < size; ++i) {
    const double d = std::fabs(grid[i] - a), e = std::fabs(grid[best] - a);
    if (d < e || (d == e && i % 2 == 0)) best = i;
  }
  return best;
}

bool SameFloat(float x, double expected) {
  if (std::isnan(expected)) return std::isnan(x);
  return x == static_cast<float>(expected) &&
         std::signbit(x) == std::signbit(expected);
}

// Floats of [0, limit]: every grid value, the midpoints between neighbours
// and the floats next to them, and a sweep over the bit patterns.
std::vector<float> Samples(const std::vector<double>& grid, float limit) {
  std::vector<float> v;
  for (size_t i = 0; i < grid.size(); ++i) {
    v.push_back(static_cast<float>(grid[i]));
    if (i + 1 < grid.size()) {
      const float mid = static_cast<float>((grid[i] + grid[i + 1]) / 2);
      v.push_back(mid);
      v.push_back(std::nextafter(mid, 0.0f));
      v.push_back(std::nextafter(mid, INFINITY));
    }
  }
  for (uint32_t bits = 0; bits <= FloatBits(limit); bits += 4099) {
    v.push_back(BitsToFloat(bits));
  }
  return v;
}

TEST(E4M3DecodeIsTheFormatForEveryByte) {
  for (int byte = 0; byte < 256; ++byte) {
    const float got = jax_nvfp4::E4M3Decode(static_cast<uint8_t>(byte));
    if (!SameFloat(got, E4M3Reference(byte))) {
      CHECK_EQ_FOR(got, E4M3Reference(byte), byte);
    }
  }
  CHECK_EQ(jax_nvfp4::E4M3Decode(0x7E), 448.0f);
  CHECK_EQ(jax_nvfp4::E4M3Decode(0x01), 1.0f / 512);
}

TEST(E4M3EncodeInvertsDecodeOnEveryFiniteNonNegativeByte) {
  for (int byte = 0; byte < 0x7F; ++byte) {
    CHECK_EQ(int{jax_nvfp4::E4M3Encode(jax_nvfp4::E4M3Decode(byte))}, byte);
  }
}

TEST(E4M3RoundingIsNearestTiesToEvenSaturatingAt448) {
  std::vector<double> grid;
  for (int byte = 0; byte < 0x7F; ++byte) grid.push_back(E4M3Reference(byte));
  for (float v : Samples(grid, 500.0f)) {
    const int want = NearestIndex(grid.data(), grid.size(), v);
    const float got = jax_nvfp4::E4M3RoundSatfinite(v);
    CHECK_EQ_FOR(got, static_cast<float>(grid[want]), v);
    CHECK_EQ_FOR(int{jax_nvfp4::E4M3Encode(got)}, want, v);
  }
  // Ties by hand: between 1.0 (0x38) and 1.125 (0x39) to the even byte;
  // between 1.125 and 1.25 up; a carry into the exponent; the subnormals.
  CHECK_EQ(jax_nvfp4::E4M3RoundSatfinite(1.0625f), 1.0f);
  CHECK_EQ(jax_nvfp4::E4M3RoundSatfinite(1.1875f), 1.25f);
  CHECK_EQ(jax_nvfp4::E4M3RoundSatfinite(1.9375f), 2.0f);
  CHECK_EQ(jax_nvfp4::E4M3RoundSatfinite(1.0f / 1024), 0.0f);
  CHECK_EQ(jax_nvfp4::E4M3RoundSatfinite(3.0f / 1024), 4.0f / 1024);
  for (float big : {449.0f, 464.0f, 480.0f, 1e30f, FLT_MAX, INFINITY}) {
    CHECK_EQ(jax_nvfp4::E4M3RoundSatfinite(big), 448.0f);
  }
}

TEST(E2M1DecodeIsTheGridWithSign) {
  for (uint32_t code = 0; code < 16; ++code) {
    const double want = (code & 8) ? -kE2M1[code & 7] : kE2M1[code & 7];
    CHECK(SameFloat(jax_nvfp4::E2M1Decode(code), want));
  }
}

TEST(E2M1NearestRoundTripsEveryCode) {
  for (uint32_t code = 0; code < 16; ++code) {
    CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(jax_nvfp4::E2M1Decode(code))},
             static_cast<int>(code));
  }
}

TEST(E2M1NearestIsTiesToEvenSaturatingWithSign) {
  const std::vector<double> grid(kE2M1, kE2M1 + 8);
  for (float v : Samples(grid, 8.0f)) {
    for (float x : {v, -v}) {
      const int want =
          NearestIndex(kE2M1, 8, std::fabs(x)) | (std::signbit(x) ? 8 : 0);
      CHECK_EQ_FOR(int{jax_nvfp4::E2M1RoundNearest(x)}, want, x);
    }
  }
  // The ties of the spec's comment: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
  // 2.5->2, 3.5->4, 5->4 (as codes: 0, 2, 2, 4, 4, 6, 6).
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const int codes[] = {0, 2, 2, 4, 4, 6, 6};
  for (int i = 0; i < 7; ++i) {
    CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(ties[i])}, codes[i]);
    CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(-ties[i])}, codes[i] | 8);
  }
  CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(-0.0f)}, 0x8);
  CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(-0.1f)}, 0x8);
  CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(INFINITY)}, 0x7);
  CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(-INFINITY)}, 0xF);
  CHECK_EQ(int{jax_nvfp4::E2M1RoundNearest(NAN)}, int{jax_nvfp4::kNanCode});
}

TEST(E2M1StochasticRoundsUpWithProbabilityFrac) {
  // v = lo + (j / 256) * step rounds up for exactly j of the 256 bytes.
  for (int i = 0; i < 7; ++i) {
    const double lo = kE2M1[i], hi = kE2M1[i + 1];
    for (int j = 0; j < 256; ++j) {
      const float v = static_cast<float>(lo + (hi - lo) * j / 256.0);
      int up = 0, down = 0;
      for (uint32_t r = 0; r < 256; ++r) {
        const int code = jax_nvfp4::E2M1RoundStochastic(v, r);
        up += code == i + 1;
        down += code == i;
        CHECK_EQ_FOR(int{jax_nvfp4::E2M1RoundStochastic(-v, r)}, code | 8, v);
      }
      CHECK_EQ(up, j);
      CHECK_EQ(down, 256 - j);
    }
  }
  for (uint32_t r = 0; r < 256; ++r) {
    CHECK_EQ(int{jax_nvfp4::E2M1RoundStochastic(7.0f, r)}, 7);
    CHECK_EQ(int{jax_nvfp4::E2M1RoundStochastic(6.0f, r)}, 7);
    CHECK_EQ(int{jax_nvfp4::E2M1RoundStochastic(NAN, r)},
             int{jax_nvfp4::kNanCode});
  }
}

TEST(GlobalScaleEdgeCases) {
  const jax_nvfp4::GlobalScale unit = jax_nvfp4::GlobalScaleFromAmax(2688.0f);
  CHECK_EQ(unit.encode, 1.0f);
  CHECK_EQ(unit.decode, 1.0f);
  const jax_nvfp4::GlobalScale half = jax_nvfp4::GlobalScaleFromAmax(5376.0f);
  CHECK_EQ(half.encode, 0.5f);
  CHECK_EQ(half.decode, 2.0f);
  CHECK_EQ(jax_nvfp4::GlobalScaleFromAmax(0.0f).encode, 1.0f);
  CHECK_EQ(jax_nvfp4::GlobalScaleFromAmax(INFINITY).encode, 1.0f);
  CHECK_EQ(jax_nvfp4::GlobalScaleFromAmax(1e-38f).encode, FLT_MAX);
}

TEST(BlockAmaxCountsNonFiniteAsInfinity) {
  using jax_nvfp4::BlockAmaxStep;
  CHECK_EQ(BlockAmaxStep(1.0f, -3.0f), 3.0f);
  CHECK_EQ(BlockAmaxStep(3.0f, 1.0f), 3.0f);
  CHECK_EQ(BlockAmaxStep(1.0f, NAN), INFINITY);
  CHECK_EQ(BlockAmaxStep(1.0f, -INFINITY), INFINITY);
  CHECK(jax_nvfp4::BlockIsNonFinite(INFINITY));
  CHECK(jax_nvfp4::BlockIsNonFinite(NAN));
  CHECK(!jax_nvfp4::BlockIsNonFinite(FLT_MAX));
  CHECK_EQ(jax_nvfp4::MaxAbsFinite(1.0f, NAN), 1.0f);
  CHECK_EQ(jax_nvfp4::MaxAbsFinite(1.0f, -INFINITY), 1.0f);
  CHECK_EQ(jax_nvfp4::MaxAbsFinite(1.0f, -2.0f), 2.0f);
}

TEST(BlockScaleOfFiniteSaturatedZeroAndNonFiniteBlocks) {
  using jax_nvfp4::BlockScaleOf;
  const jax_nvfp4::GlobalScale unit = jax_nvfp4::GlobalScaleFromAmax(2688.0f);
  // bamax 6 at amax 2688: scale 1.0 (0x38), values map onto the grid as-is.
  const jax_nvfp4::BlockScaling six = BlockScaleOf(6.0f, unit);
  CHECK_EQ(six.scale, 1.0f);
  CHECK_EQ(int{six.scale_byte}, 0x38);
  CHECK_EQ(six.multiplier, 1.0f);
  CHECK(!six.non_finite);
  // The block holding the tensor's amax: 448 (0x7E); above it saturates.
  const jax_nvfp4::GlobalScale one = jax_nvfp4::GlobalScaleFromAmax(1.0f);
  CHECK_EQ(int{BlockScaleOf(1.0f, one).scale_byte}, 0x7E);
  CHECK_EQ(int{BlockScaleOf(1.5f, one).scale_byte}, 0x7E);
  // A scale that rounds to zero encodes with FLT_MAX.
  const jax_nvfp4::BlockScaling zero = BlockScaleOf(1e-6f, unit);
  CHECK_EQ(zero.scale, 0.0f);
  CHECK_EQ(int{zero.scale_byte}, 0);
  CHECK_EQ(zero.multiplier, FLT_MAX);
  const jax_nvfp4::BlockScaling nan = BlockScaleOf(INFINITY, unit);
  CHECK(nan.non_finite);
  CHECK_EQ(int{nan.scale_byte}, int{jax_nvfp4::kNonFiniteScaleByte});
  CHECK(std::isnan(nan.scale));
  CHECK_EQ(jax_nvfp4::BlockDecodeMultiplier(2.0f, 2688.0f), 2.0f);
}

TEST(EncodeBlock16PacksElementTwoKInTheLowNibble) {
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = jax_nvfp4::E2M1Decode(i);
  CHECK_EQ(jax_nvfp4::EncodeBlock16(v, 1.0f, false, 0, 0),
           uint64_t{0xFEDCBA9876543210});
  // Grid values round to themselves whatever the random bits.
  CHECK_EQ(jax_nvfp4::EncodeBlock16(v, 1.0f, true, ~uint64_t{0}, 0x1234),
           uint64_t{0xFEDCBA9876543210});
  // The multiplier scales first: 0.5 * 2 = 1 (code 2) in every element.
  float halves[16];
  for (float& h : halves) h = 0.5f;
  CHECK_EQ(jax_nvfp4::EncodeBlock16(halves, 2.0f, false, 0, 0),
           uint64_t{0x2222222222222222});
}

TEST(Float16WideningIsExactForEveryBitPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const int exponent = (h >> 10) & 31, mantissa = h & 1023;
    double want;
    if (exponent == 0) {
      want = std::ldexp(mantissa, -24);
    } else if (exponent == 31) {
      want = mantissa == 0 ? INFINITY : NAN;
    } else {
      want = std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
    }
    if (h & 0x8000) want = -want;
    const float got = jax_nvfp4::Float16BitsToFloat(static_cast<uint16_t>(h));
    if (!SameFloat(got, want)) CHECK_EQ_FOR(got, want, h);
  }
}

TEST(Bfloat16RoundTripsAndRoundsTiesToEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = jax_nvfp4::Bfloat16BitsToFloat(static_cast<uint16_t>(h));
    CHECK_EQ(FloatBits(f), h << 16);
    if (!std::isnan(f)) {
      CHECK_EQ(uint32_t{jax_nvfp4::FloatToBfloat16Bits(f)}, h);
    }
  }
  // bfloat16 keeps 7 mantissa bits: 1 + 2^-8 is halfway to 1 + 2^-7.
  CHECK_EQ(jax_nvfp4::RoundToBfloat16(1.0f + 0x1p-8f), 1.0f);
  CHECK_EQ(jax_nvfp4::RoundToBfloat16(1.0f + 0x3p-8f), 1.0f + 0x1p-6f);
  CHECK_EQ(jax_nvfp4::RoundToBfloat16(1.0f + 0x1p-8f + 0x1p-20f),
           1.0f + 0x1p-7f);
  CHECK(std::isnan(jax_nvfp4::RoundToBfloat16(NAN)));
  CHECK_EQ(uint32_t{jax_nvfp4::FloatToBfloat16Bits(NAN)}, 0x7FC0u);
}

TEST(RhtIsOrthogonalWithTheSpecSigns) {
  const int signs[16] = {1,  1,  1,  -1, 1,  -1, -1, -1,
                         -1, -1, -1, 1,  -1, 1,  -1, -1};
  for (int j = 0; j < 16; ++j) {
    CHECK_EQ(jax_nvfp4::RhtEntry(j, 0), 0.25f * signs[j]);
    for (int k = 0; k < 16; ++k) {
      float dot = 0;
      for (int i = 0; i < 16; ++i) {
        dot += jax_nvfp4::RhtEntry(j, i) * jax_nvfp4::RhtEntry(k, i);
      }
      CHECK_EQ(dot, j == k ? 1.0f : 0.0f);
    }
  }
}

TEST(RhtButterflyIsTheMatrixProduct) {
  uint32_t state = 12345;  // a fixed LCG: small integers, exact sums
  for (int trial = 0; trial < 64; ++trial) {
    float x[16], z[16], y[16];
    for (float& xi : x) {
      state = state * 1664525u + 1013904223u;
      xi = static_cast<float>(static_cast<int>(state >> 24) - 128);
    }
    jax_nvfp4::HadamardButterfly16(x, z);
    jax_nvfp4::RandomHadamard16(x, y);
    for (int i = 0; i < 16; ++i) {
      double want = 0;
      for (int j = 0; j < 16; ++j) want += x[j] * jax_nvfp4::RhtEntry(j, i);
      CHECK_EQ(z[i], static_cast<float>(want));
      CHECK_EQ(y[i], jax_nvfp4::RoundToBfloat16(z[i]));
    }
  }
}

TEST(PhiloxMatchesTheKnownAnswers) {
  // Random123's known-answer vectors for Philox4x32-10 (counter, key).
  struct Case {
    uint32_t key[2], counter[4], out[4];
  };
  const Case cases[] = {
      {{0, 0}, {0, 0, 0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0xa4093822, 0x299f31d0},
       {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Case& c : cases) {
    const jax_nvfp4::Philox4x32Output out =
        jax_nvfp4::Philox4x32(c.key[0], c.key[1], c.counter[0], c.counter[1],
                              c.counter[2], c.counter[3]);
    for (int i = 0; i < 4; ++i) CHECK_EQ(out.word[i], c.out[i]);
  }
  // Block B of stream s is the counter (B mod 2^32, B / 2^32, s, 0), its
  // words low byte first.
  uint64_t lo = 0, hi = 0;
  jax_nvfp4::RandomBytes16(0, 0, 0, 0, &lo, &hi);
  CHECK_EQ(lo, uint64_t{0xe169c58d6627e8d5});
  CHECK_EQ(hi, uint64_t{0x9b00dbd8bc57ac4c});
  jax_nvfp4::RandomBytes16(0xa4093822, 0x299f31d0, 0x13198a2e,
                           uint64_t{0x85a308d3243f6a88}, &lo, &hi);
  const jax_nvfp4::Philox4x32Output out = jax_nvfp4::Philox4x32(
      0xa4093822, 0x299f31d0, 0x243f6a88, 0x85a308d3, 0x13198a2e, 0);
  CHECK_EQ(lo, uint64_t{out.word[0]} | uint64_t{out.word[1]} << 32);
  CHECK_EQ(hi, uint64_t{out.word[2]} | uint64_t{out.word[3]} << 32);
}

}  // namespace
