// NF4 with double quantization against references computed another way: the code book against
// QLoRA's normal-float construction (Phi^-1 through torch::special::ndtri), codes of exact
// code-times-absmax weights, the nibble order, the rounding-error bound derived from both maps'
// gaps, the paper's bits per parameter, and Nf4Linear against a dense linear over the
// dequantized weight, with a LoRA adapter trained on top of a frozen NF4 base; and against
// bitsandbytes' quantize_4bit and dequantize_4bit themselves through a fixture that
// nf4_bitsandbytes_golden.py wrote where bitsandbytes runs (it is not installed on the build
// machines).
#include "trainer/model/nf4.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/optim.h>
#include <torch/special.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "trainer/model/nf4_bitsandbytes_golden.h"

namespace tessera::trainer {
namespace {

// The published NF4 values (QLoRA's appendix; bitsandbytes' get_4bit_type("nf4")), as doubles.
constexpr double kPublishedNf4[16] = {-1.0,
                                      -0.6961928009986877,
                                      -0.5250730514526367,
                                      -0.39491748809814453,
                                      -0.28444138169288635,
                                      -0.18477343022823334,
                                      -0.09105003625154495,
                                      0.0,
                                      0.07958029955625534,
                                      0.16093020141124725,
                                      0.24611230194568634,
                                      0.33791524171829224,
                                      0.44070982933044434,
                                      0.5626170039176941,
                                      0.7229568362236023,
                                      1.0};

torch::Tensor CodeBookTensor() {
  const std::array<float, 16>& book = Nf4CodeBook();
  return torch::tensor(std::vector<float>(book.begin(), book.end()));
}

// A weight whose blocks of 64 are code values times the block's absmax, each block's first value
// at +-1 so that the absmax is attained: returns the weight and its expected 4-bit indices.
std::pair<torch::Tensor, torch::Tensor> CodeTimesAbsmax(const torch::Tensor& absmax, int64_t numel,
                                                        torch::Generator& gen) {
  torch::Tensor indices = torch::randint(0, 16, {numel}, gen, torch::kLong);
  for (int64_t start = 0, block = 0; start < numel; start += kNf4BlockSize, ++block) {
    indices[start] = block % 2 == 0 ? 15 : 0;
  }
  const torch::Tensor per_element = absmax.repeat_interleave(kNf4BlockSize).slice(0, 0, numel);
  return {CodeBookTensor().index({indices}) * per_element, indices.to(torch::kUInt8)};
}

TEST(Nf4Test, CodeBookIsThePublishedNormalFloat) {
  const std::array<float, 16>& book = Nf4CodeBook();
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(book[i], static_cast<float>(kPublishedNf4[i])) << "code " << i;
  }
  // The construction (QLoRA section 3; bitsandbytes' create_normal_map(offset=0.9677083)):
  // Phi^-1 at float32-spaced probabilities from 1 - delta towards 0.5, 8 positive and 7 negative
  // quantiles and an exact zero, divided by the largest.
  const double offset = 0.9677083;
  EXPECT_NEAR(offset, 1 - (1.0 / 32 + 1.0 / 30) / 2, 1e-7);
  const auto quantiles = [&](int64_t points) {
    const torch::Tensor p = torch::linspace(offset, 0.5, points, torch::kFloat32)
                                .slice(0, 0, points - 1)
                                .to(torch::kFloat64);
    return torch::special::ndtri(p);
  };
  torch::Tensor values =
      torch::cat({quantiles(9), torch::zeros({1}, torch::kFloat64), -quantiles(8)});
  values = std::get<0>((values / values.max()).sort());
  for (int i = 0; i < 16; ++i) {
    EXPECT_NEAR(values[i].item<double>(), kPublishedNf4[i], 1e-6) << "code " << i;
  }
}

// bitsandbytes' dQuantizeNF4 thresholds, the float literals of its decision tree
// (csrc/kernels.cu): x > threshold goes to the upper code.
constexpr float kBitsandbytesThresholds[15] = {
    -0.8480964004993439f,  -0.6106329262256622f,  -0.4599952697753906f,   -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,   0.2035212516784668f,   0.2920137718319893f,    0.3893125355243683f,
    0.5016634166240692f,   0.6427869200706482f,   0.8614784181118011f};

TEST(Nf4Test, IndicesAreNearestAsBitsandbytesDecides) {
  const std::array<float, 16>& book = Nf4CodeBook();
  const torch::Tensor exact = Nf4Indices(CodeBookTensor());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(exact[i].item<int>(), i);
  int off_midpoint = 0;
  for (int i = 0; i < 15; ++i) {
    const float threshold = kBitsandbytesThresholds[i];
    // Each threshold is the midpoint of its neighbours, up to one float32 step: the decimal
    // midpoint of the double code values rounds, at a few of them, to the other float.
    const float midpoint = static_cast<float>((double{book[i]} + double{book[i + 1]}) / 2);
    EXPECT_LE(std::abs(threshold - midpoint),
              std::nextafter(std::abs(midpoint), 2.0f) - std::abs(midpoint))
        << "threshold " << i;
    off_midpoint += threshold != midpoint;
    const float above = std::nextafter(threshold, 2.0f);
    const torch::Tensor got = Nf4Indices(torch::tensor({threshold, above}));
    EXPECT_EQ(got[0].item<int>(), i) << "at threshold " << threshold;
    EXPECT_EQ(got[1].item<int>(), i + 1) << "just above " << threshold;
  }
  EXPECT_EQ(off_midpoint, 4);
  // Out of range values clamp to the ends.
  const torch::Tensor ends = Nf4Indices(torch::tensor({-1.5f, 1.5f}));
  EXPECT_EQ(ends[0].item<int>(), 0);
  EXPECT_EQ(ends[1].item<int>(), 15);
}

TEST(Nf4Test, PacksTheFirstElementInTheHighNibble) {
  const torch::Tensor indices = torch::tensor({15, 0, 7, 8, 1}, torch::kUInt8);
  const torch::Tensor packed = PackNibbles(indices);
  EXPECT_TRUE(torch::equal(packed, torch::tensor({0xF0, 0x78, 0x10}, torch::kUInt8)));
  EXPECT_TRUE(torch::equal(UnpackNibbles(packed, 5), indices));

  // Through the quantizer: the codes of +1, -1, 0 (times any absmax) are 15, 0, 7.
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(torch::tensor({{2.5f, -2.5f, 0.0f}}));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(torch::equal(q->codes, torch::tensor({0xF0, 0x70}, torch::kUInt8)));
}

TEST(Nf4Test, CodeTimesAbsmaxRoundTripsItsCodes) {
  torch::Generator gen = at::detail::createCPUGenerator(7);
  // 240 values: three whole blocks and one of 48; absmaxes over two orders of magnitude.
  const int64_t numel = 240;
  const torch::Tensor absmax = torch::tensor({0.02f, 1.0f, 3.5f, 0.25f});
  auto [weight, expected] = CodeTimesAbsmax(absmax, numel, gen);
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    absl::StatusOr<Nf4Tensor> q = QuantizeNf4(weight.to(dtype).view({6, 40}));
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->shape, (std::vector<int64_t>{6, 40}));
    EXPECT_EQ(q->num_blocks(), 4);
    EXPECT_TRUE(torch::equal(UnpackNibbles(q->codes, numel), expected)) << c10::toString(dtype);
  }
}

TEST(Nf4Test, CodeTimesOneAbsmaxRoundTripsExactly) {
  // With every block's absmax equal, the centred absmaxes are all zero and the double
  // quantization rebuilds the absmax exactly as their mean: the weight comes back bit for bit.
  torch::Generator gen = at::detail::createCPUGenerator(11);
  auto [weight, expected] = CodeTimesAbsmax(torch::full({4}, 1.5f), 256, gen);
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(weight.view({8, 32}));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(torch::equal(DequantizeNf4(*q), weight.view({8, 32})));
  EXPECT_TRUE(
      torch::equal(DequantizeNf4(*q, torch::kBFloat16), weight.view({8, 32}).to(torch::kBFloat16)));
}

TEST(Nf4Test, DynamicMapIsBitsandbytesSignedMap) {
  const std::array<float, 256>& map = DynamicMap8Bit();
  for (int i = 0; i + 1 < 256; ++i) ASSERT_LT(map[i], map[i + 1]) << i;
  EXPECT_EQ(map[255], 1.0f);
  EXPECT_EQ(map[127], 0.0f);  // 127 negative values below zero
  // The top decade: 64 midpoints of linspace(0.1, 1, 65), the largest 0.1 + 0.9 * 63.5 / 64.
  EXPECT_NEAR(map[254], 0.99296875, 1e-7);
  EXPECT_NEAR(map[0], -0.99296875, 1e-7);
  EXPECT_NEAR(map[191], 0.1 + 0.9 * 0.5 / 64, 1e-7);
  // The smallest magnitude: 1e-6 times the midpoint of linspace(0.1, 1, 2).
  EXPECT_NEAR(map[128], 0.55e-6, 1e-12);
  // Every value against the construction in double: decade 10^(i-6) holds the 2^i midpoints
  // 0.1 + 0.9 (k + 1/2) / 2^i of linspace(0.1, 1, 2^i + 1), with both signs.
  std::vector<double> reference = {0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    for (int k = 0; k < (1 << i); ++k) {
      const double value = std::pow(10.0, i - 6) * (0.1 + 0.9 * (k + 0.5) / (1 << i));
      reference.push_back(value);
      reference.push_back(-value);
    }
  }
  std::sort(reference.begin(), reference.end());
  ASSERT_EQ(reference.size(), 256);
  for (int i = 0; i < 256; ++i) {
    EXPECT_NEAR(map[i], reference[i], 2.4e-7 * std::abs(reference[i])) << "code " << i;
  }
  // The worst rounding: the top decade's half-gap 0.9 / 128 (also the distance from -1 to the
  // smallest value); NF4's: half its widest gap, between -1 and the next code (the negative half
  // has one code fewer).
  EXPECT_NEAR(DynamicMap8BitMaxRoundingError(), 0.9 / 128, 1e-6);
  EXPECT_FLOAT_EQ(Nf4MaxRoundingError(), (Nf4CodeBook()[1] - Nf4CodeBook()[0]) / 2);
}

// Random weights with heavy-tailed outliers, 300 blocks of 64 (two second-level blocks, the
// second partial).
torch::Tensor RandomWeight(int64_t rows, int64_t cols, uint64_t seed) {
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  torch::Tensor w = torch::randn({rows, cols}, gen) * 0.02;
  const torch::Tensor outliers = torch::rand({rows, cols}, gen) < 0.002;
  return torch::where(outliers, w * 30, w);
}

TEST(Nf4Test, DoubleQuantizationRebuildsEachAbsmaxWithinItsStep) {
  const torch::Tensor w = RandomWeight(96, 200, 3);
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(w);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->num_blocks(), 300);
  ASSERT_EQ(q->absmax_scales.numel(), 2);

  // The reference: absmax per block of 64 of the flattened weight, centred on its mean, the
  // scale of each block of 256 the largest centred magnitude.
  const torch::Tensor absmax = w.flatten().view({300, 64}).abs().amax(1);
  const float mean = absmax.mean().item<float>();
  EXPECT_FLOAT_EQ(q->absmax_offset.item<float>(), mean);
  const torch::Tensor centred = (absmax - mean).abs();
  const float scale0 = centred.slice(0, 0, 256).max().item<float>();
  const float scale1 = centred.slice(0, 256).max().item<float>();
  EXPECT_FLOAT_EQ(q->absmax_scales[0].item<float>(), scale0);
  EXPECT_FLOAT_EQ(q->absmax_scales[1].item<float>(), scale1);

  // |a - a_hat| <= scale * (the 8-bit map's worst rounding), plus float32 rounding of the
  // normalisation and the rebuild.
  const torch::Tensor scale = torch::cat({torch::full({256}, scale0), torch::full({44}, scale1)});
  const torch::Tensor bound =
      scale * DynamicMap8BitMaxRoundingError() + 4 * 1.2e-7 * (absmax + scale);
  const torch::Tensor error = (DequantizeAbsmax(*q) - absmax).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>())
      << "worst excess " << (error - bound).max().item<float>();
  // The bound is not vacuous: some absmax lands a good part of a step away.
  EXPECT_GT((error / (scale * DynamicMap8BitMaxRoundingError())).max().item<float>(), 0.3f);
}

// The round-trip bound, per value w of a block with absmax a and rebuilt absmax a_hat, code value
// c (|c| <= 1) picked for w / a:
//   |w - c a_hat| <= |w - c a| + |c| |a - a_hat| <= a h4 + s h8,
// h4 = Nf4MaxRoundingError(), s the second-level scale of the block's absmax and h8 =
// DynamicMap8BitMaxRoundingError() (the previous test's bound on |a - a_hat|).
TEST(Nf4Test, RoundTripErrorWithinTheDerivedBound) {
  const torch::Tensor w = RandomWeight(96, 200, 5);
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(w);
  ASSERT_TRUE(q.ok()) << q.status();
  const torch::Tensor absmax = w.flatten().view({300, 64}).abs().amax(1);
  const torch::Tensor scale =
      q->absmax_scales.repeat_interleave(kNf4AbsmaxBlockSize).slice(0, 0, 300);
  const torch::Tensor block_bound = absmax * Nf4MaxRoundingError() +
                                    scale * DynamicMap8BitMaxRoundingError() +
                                    8 * 1.2e-7 * (absmax + scale);
  const torch::Tensor bound = block_bound.repeat_interleave(64).view({96, 200});
  const torch::Tensor error = (DequantizeNf4(*q) - w).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>())
      << "worst excess " << (error - bound).max().item<float>();
  EXPECT_GT((error / bound).max().item<float>(), 0.5f);

  // Without the double quantization's error (absmax exact) the NF4 part alone holds its bound.
  const torch::Tensor values =
      CodeBookTensor().index({UnpackNibbles(q->codes, w.numel()).to(torch::kLong)});
  const torch::Tensor exact = (values.view({300, 64}) * absmax.unsqueeze(1)).view({96, 200});
  const torch::Tensor nf4_bound =
      (absmax * (Nf4MaxRoundingError() + 2.4e-7f)).repeat_interleave(64).view({96, 200});
  EXPECT_TRUE(((exact - w).abs() <= nf4_bound).all().item<bool>());

  // Another dtype is the float32 result cast.
  EXPECT_TRUE(
      torch::equal(DequantizeNf4(*q, torch::kBFloat16), DequantizeNf4(*q).to(torch::kBFloat16)));
}

// nf4_bitsandbytes_golden.py's weight, from the same integer arithmetic.
torch::Tensor GoldenWeight() {
  uint64_t state = 42;
  std::vector<float> values;
  for (int64_t i = 0; i < nf4_golden::kRows * nf4_golden::kCols; ++i) {
    int64_t k = 0;
    for (int draw = 0; draw < 4; ++draw) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      k += static_cast<int64_t>((state >> 33) % 501) - 250;
    }
    if (i % 487 == 0) k *= 8;
    values.push_back(std::ldexp(static_cast<float>(k), -12));
  }
  return torch::tensor(values).view({nf4_golden::kRows, nf4_golden::kCols});
}

uint64_t Fnv1a(const torch::Tensor& t) {
  const torch::Tensor bytes = t.contiguous().view(torch::kUInt8).flatten();
  uint64_t hash = 0xCBF29CE484222325ULL;
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    hash = (hash ^ bytes.data_ptr<uint8_t>()[i]) * 0x100000001B3ULL;
  }
  return hash;
}

TEST(Nf4Test, MatchesBitsandbytesQuantize4bit) {
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(GoldenWeight());
  ASSERT_TRUE(q.ok()) << q.status();
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(q->codes[i].item<int>(), nf4_golden::kCodesHead[i]) << "byte " << i;
  }
  EXPECT_EQ(Fnv1a(q->codes), nf4_golden::kCodesFnv1a);
  absl::StatusOr<Nf4Tensor> bf16 = QuantizeNf4(GoldenWeight().to(torch::kBFloat16));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(Fnv1a(bf16->codes), nf4_golden::kCodesBf16Fnv1a);
  // The 8-bit absmax codes: bitsandbytes' CPU quantize_blockwise (0.50.2) takes the nearest
  // value only up to ~1.3e-5 (normalised) around each midpoint (188 of 200001 points of a grid
  // over [-1, 1] go to the farther neighbour); this weight has one absmax there, block 29, where
  // the nearest (ours, and its CUDA kernel's rule) is the other neighbour.
  const std::array<float, 256>& map = DynamicMap8Bit();
  const int64_t blocks = std::size(nf4_golden::kAbsmaxCodes);
  ASSERT_EQ(q->absmax_codes.numel(), blocks);
  const torch::Tensor absmax = GoldenWeight().flatten().view({blocks, 64}).abs().amax(1);
  const torch::Tensor normalized =
      (absmax - q->absmax_offset) *
      q->absmax_scales.reciprocal().repeat_interleave(kNf4AbsmaxBlockSize).slice(0, 0, blocks);
  int disagreements = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int ours = q->absmax_codes[i].item<int>(), theirs = nf4_golden::kAbsmaxCodes[i];
    if (ours == theirs) continue;
    ++disagreements;
    const float x = normalized[i].item<float>();
    EXPECT_EQ(std::abs(ours - theirs), 1) << "block " << i;
    EXPECT_LT(std::abs(x - map[ours]), std::abs(x - map[theirs])) << "block " << i;
    EXPECT_LT(std::abs(x - (map[ours] + map[theirs]) / 2), 2e-5) << "block " << i;
  }
  EXPECT_EQ(disagreements, 1);
  ASSERT_EQ(q->absmax_scales.numel(), std::size(nf4_golden::kAbsmaxScales));
  for (int64_t i = 0; i < q->absmax_scales.numel(); ++i) {
    EXPECT_EQ(q->absmax_scales[i].item<float>(), nf4_golden::kAbsmaxScales[i]) << "scale " << i;
  }
  EXPECT_EQ(q->absmax_offset.item<float>(), nf4_golden::kAbsmaxOffset);
  // Dequantization from bitsandbytes' state gives its dequantize_4bit's bytes.
  Nf4Tensor theirs = *q;
  theirs.absmax_codes = torch::tensor(std::vector<uint8_t>(std::begin(nf4_golden::kAbsmaxCodes),
                                                           std::end(nf4_golden::kAbsmaxCodes)),
                                      torch::kUInt8);
  EXPECT_EQ(Fnv1a(DequantizeNf4(theirs)), nf4_golden::kDequantizedFnv1a);
}

TEST(Nf4Test, ZeroBlockDequantizesToZeros) {
  torch::Tensor w = RandomWeight(4, 64, 9);
  w[1].zero_();
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(w);
  ASSERT_TRUE(q.ok()) << q.status();
  const torch::Tensor back = DequantizeNf4(*q);
  EXPECT_TRUE(torch::equal(back[1], torch::zeros({64})));
  EXPECT_TRUE(torch::isfinite(back).all().item<bool>());
}

TEST(Nf4Test, MemoryIsFourBitsPlusAQuarterBitOfOverheadPerParameter) {
  const int64_t n = 4096;
  absl::StatusOr<Nf4Tensor> q = QuantizeNf4(RandomWeight(n, n, 1));
  ASSERT_TRUE(q.ok()) << q.status();
  const int64_t params = n * n;
  // Codes n^2 / 2, 8-bit absmaxes n^2 / 64, float32 scales n^2 / (64 * 256) * 4, the offset 4.
  EXPECT_EQ(q->MemoryBytes(), params / 2 + params / 64 + params / (64 * 256) * 4 + 4);
  const double overhead_bits = (q->MemoryBytes() - params / 2) * 8.0 / params;
  // QLoRA: 8/64 + 32/(64 * 256) = 0.127 bits per parameter (from 0.5 without double quant),
  // and here the 32-bit offset once per tensor.
  EXPECT_DOUBLE_EQ(overhead_bits, 8.0 / 64 + 32.0 / (64 * 256) + 32.0 / params);
  EXPECT_NEAR(overhead_bits, 0.127, 0.0005);
}

TEST(Nf4Test, RejectsBadInput) {
  EXPECT_EQ(QuantizeNf4(torch::Tensor()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeNf4(torch::zeros({0, 4})).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeNf4(torch::ones({2, 2}, torch::kInt32)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      QuantizeNf4(torch::tensor({1.0f, std::numeric_limits<float>::quiet_NaN()})).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeNf4(torch::ones({4}), {.block_size = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeNf4Linear(torch::ones({2, 3, 4}), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Nf4Linear> bad_bias = MakeNf4Linear(torch::ones({2, 3}), torch::ones({3}));
  EXPECT_EQ(bad_bias.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_bias.status().message().find("bias"), std::string::npos);
}

TEST(Nf4LinearTest, ForwardAndInputGradientEqualTheDenseReference) {
  torch::Generator gen = at::detail::createCPUGenerator(21);
  const torch::Tensor w = RandomWeight(48, 80, 13);
  const torch::Tensor bias = torch::randn({48}, gen);
  absl::StatusOr<Nf4Linear> linear = MakeNf4Linear(w, bias);
  ASSERT_TRUE(linear.ok()) << linear.status();
  EXPECT_TRUE((*linear)->parameters().empty());
  EXPECT_EQ((*linear)->named_buffers().size(), 5);

  const torch::Tensor x0 = torch::randn({3, 5, 80}, gen);
  const torch::Tensor upstream = torch::randn({3, 5, 48}, gen);
  torch::Tensor x = x0.clone().requires_grad_(true);
  const torch::Tensor y = (*linear)->forward(x);
  (y * upstream).sum().backward();

  const torch::Tensor dense = DequantizeNf4((*linear)->weight());
  torch::Tensor x_ref = x0.clone().requires_grad_(true);
  const torch::Tensor y_ref = torch::matmul(x_ref, dense.t()) + bias;
  (y_ref * upstream).sum().backward();
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-5));
  // The NF4 weight is far from the dense one only by its quantization error.
  EXPECT_LT((dense - w).abs().max().item<float>(), 0.2f * w.abs().max().item<float>());

  // bf16 compute: the product in bf16, the gradient back in x's float32.
  absl::StatusOr<Nf4Linear> bf16 = MakeNf4Linear(w, bias, torch::kBFloat16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  torch::Tensor xb = x0.clone().requires_grad_(true);
  const torch::Tensor yb = (*bf16)->forward(xb);
  EXPECT_EQ(yb.scalar_type(), torch::kBFloat16);
  (yb.to(torch::kFloat32) * upstream).sum().backward();
  EXPECT_EQ(xb.grad().scalar_type(), torch::kFloat32);
  const torch::Tensor yb_ref =
      at::linear(x0.to(torch::kBFloat16), dense.to(torch::kBFloat16), bias.to(torch::kBFloat16));
  EXPECT_TRUE(torch::allclose(yb.to(torch::kFloat32), yb_ref.to(torch::kFloat32), 2e-2, 2e-2));
  EXPECT_TRUE(torch::allclose(xb.grad(), x_ref.grad(), 2e-2, 2e-2));
}

TEST(Nf4LinearTest, LoraAdapterTrainsWhileTheBaseStaysBitIdentical) {
  torch::manual_seed(0);
  const int64_t in = 48, out = 32, rank = 4;
  absl::StatusOr<Nf4Linear> base = MakeNf4Linear(RandomWeight(out, in, 17), torch::randn({out}));
  ASSERT_TRUE(base.ok()) << base.status();
  std::vector<torch::Tensor> before;
  for (const auto& buffer : (*base)->named_buffers()) before.push_back(buffer.value().clone());

  // LoRA as model.cc adds it: y = base(x) + scale * B A x, B starting at zero.
  torch::Tensor a = (torch::randn({rank, in}) * 0.1).requires_grad_(true);
  torch::Tensor b = torch::zeros({out, rank}, torch::requires_grad());
  const double scale = 2.0;
  const torch::Tensor x = torch::randn({64, in});
  const torch::Tensor target =
      (*base)->forward(x).detach() +
      torch::matmul(
          x, (torch::matmul(torch::randn({out, rank}), torch::randn({rank, in})) * 0.05).t());
  torch::optim::Adam optimizer({a, b}, torch::optim::AdamOptions(1e-2));
  float first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    optimizer.zero_grad();
    const torch::Tensor y =
        (*base)->forward(x) + torch::matmul(torch::matmul(x, a.t()), b.t()) * scale;
    const torch::Tensor loss = torch::mse_loss(y, target);
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<float>();
  }
  EXPECT_LT(last, 0.1f * first) << "first " << first << " last " << last;
  int i = 0;
  for (const auto& buffer : (*base)->named_buffers()) {
    EXPECT_TRUE(torch::equal(buffer.value(), before[i++])) << buffer.key();
    EXPECT_FALSE(buffer.value().requires_grad()) << buffer.key();
    EXPECT_FALSE(buffer.value().grad().defined()) << buffer.key();
  }
}

TEST(Nf4Test, CudaMatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::Tensor w = RandomWeight(96, 200, 19);
  absl::StatusOr<Nf4Tensor> cpu = QuantizeNf4(w);
  absl::StatusOr<Nf4Tensor> cuda = QuantizeNf4(w.cuda());
  ASSERT_TRUE(cpu.ok() && cuda.ok());
  EXPECT_TRUE(torch::equal(cuda->codes.cpu(), cpu->codes));
  EXPECT_TRUE(torch::equal(cuda->absmax_codes.cpu(), cpu->absmax_codes));
  EXPECT_TRUE(torch::allclose(DequantizeNf4(*cuda).cpu(), DequantizeNf4(*cpu), 1e-6, 1e-7));
}

}  // namespace
}  // namespace tessera::trainer
