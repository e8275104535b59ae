#include "trainer/model/nf4.h"

#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::trainer {
namespace {

// NF4 (QLoRA, section 3, "4-bit NormalFloat Quantization"): the quantiles of N(0, 1) chosen so
// that each of the 16 codes is equally likely for normally distributed weights, with an exact
// zero and the ends normalised to [-1, 1]. Asymmetric by construction (bitsandbytes'
// create_normal_map(offset=0.9677083)): Phi^-1 at 8 evenly spaced probabilities from
// 1 - delta down to (not including) 0.5 for the positive half and at 7 for the negative half,
// delta = (1/32 + 1/30) / 2, then 0, all divided by the largest. These are the float32 values
// bitsandbytes hard-codes (`get_4bit_type("nf4")` in bitsandbytes/functional.py, dQuantizeNF4 /
// dDequantizeNF4 in csrc/kernels.cu) and the paper lists in its appendix on the NF4 data type.
constexpr std::array<float, 16> kNf4CodeBook = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// The decision thresholds of bitsandbytes' dQuantizeNF4 (csrc/kernels.cu), the midpoints of
// neighbouring codes as the same float literals: a normalised value x gets code i when
// threshold[i - 1] < x <= threshold[i]. A literal rounds from decimal straight to float32, so
// four of them sit one float32 step from the midpoint of the float32 codes; keeping the literals
// keeps bitsandbytes' codes for values in that step.
constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f,  -0.6106329262256622f,  -0.4599952697753906f,   -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,   0.2035212516784668f,   0.2920137718319893f,    0.3893125355243683f,
    0.5016634166240692f,   0.6427869200706482f,   0.8614784181118011f,
};

// bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), step for
// step in float32 torch ops so the values are bitsandbytes' own: for each decade
// 10^-6 .. 10^0, 2^i midpoints of a float32 linspace(0.1, 1, 2^i + 1) scaled by the decade, with
// both signs, then 0 and 1; 256 values sorted.
std::array<float, 256> BuildDynamicMap() {
  constexpr int kMaxExponentBits = 7;
  std::vector<torch::Tensor> parts;
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const torch::Tensor boundaries =
        torch::linspace(0.1, 1, (int64_t{1} << i) + 1, torch::kFloat32);
    const torch::Tensor means = (boundaries.slice(0, 0, -1) + boundaries.slice(0, 1)) / 2.0;
    const double decade = std::pow(10.0, -(kMaxExponentBits - 1) + i);
    parts.push_back(means * decade);
    parts.push_back(means * -decade);
  }
  parts.push_back(torch::tensor({0.0f, 1.0f}));
  const torch::Tensor map = std::get<0>(torch::cat(parts).sort());
  TORCH_CHECK(map.numel() == 256, "dynamic map has ", map.numel(), " values");
  std::array<float, 256> values;
  std::copy_n(map.data_ptr<float>(), 256, values.begin());
  return values;
}

float MaxRoundingError(const float* values, int64_t count) {
  float worst = std::max(values[0] + 1.0f, 1.0f - values[count - 1]);
  for (int64_t i = 0; i + 1 < count; ++i) {
    worst = std::max(worst, (values[i + 1] - values[i]) / 2);
  }
  return worst;
}

// Float32 tensor of an array's values on `device`.
template <size_t N>
torch::Tensor ToTensor(const std::array<float, N>& values, const torch::Device& device) {
  return torch::from_blob(const_cast<float*>(values.data()), {static_cast<int64_t>(N)},
                          torch::kFloat32)
      .to(device);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// `flat` (1-D float32) zero-padded to whole blocks: [blocks, block_size].
torch::Tensor ToBlocks(const torch::Tensor& flat, int64_t block_size) {
  const int64_t blocks = CeilDiv(flat.numel(), block_size);
  const int64_t pad = blocks * block_size - flat.numel();
  const torch::Tensor padded = pad == 0 ? flat : torch::cat({flat, flat.new_zeros({pad})});
  return padded.view({blocks, block_size});
}

// Each row's absolute maximum, and the rows multiplied by its reciprocal as bitsandbytes does
// (x * (1 / absmax), not x / absmax); an all-zero row stays zero.
std::pair<torch::Tensor, torch::Tensor> NormalizeRows(const torch::Tensor& blocks) {
  const torch::Tensor absmax = blocks.abs().amax(1);
  const torch::Tensor inverse =
      torch::where(absmax > 0, absmax.reciprocal(), torch::zeros_like(absmax));
  return {absmax, blocks * inverse.unsqueeze(1)};
}

// Indices into DynamicMap8Bit() of normalised values: the nearest value, an exact float32
// midpoint going to the lower one. bitsandbytes' CUDA kernel (dQuantize, a binary search then a
// float32 midpoint test) picks the same value except at exact midpoints, which it breaks by its
// search path. Its CPU backend (0.50.2) is nearest only to ~1.3e-5 around each midpoint, so
// about one absmax in a few hundred may get the other neighbour there (nf4_test's fixture has
// one); both are within the 8-bit step.
torch::Tensor DynamicMapIndices(const torch::Tensor& normalized) {
  static const std::array<float, 255> midpoints = [] {
    const std::array<float, 256>& map = DynamicMap8Bit();
    std::array<float, 255> result;
    for (int i = 0; i < 255; ++i) result[i] = (map[i] + map[i + 1]) * 0.5f;
    return result;
  }();
  return torch::bucketize(normalized, ToTensor(midpoints, normalized.device())).to(torch::kUInt8);
}

// The dequantized weight as a function of the NF4 state: the input's gradient dequantizes W
// again in backward instead of keeping the forward's copy alive until then, as bitsandbytes'
// MatMul4Bit does. Inputs: x, then the Nf4Tensor's four tensors (no gradients).
class Nf4Matmul : public torch::autograd::Function<Nf4Matmul> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& codes, const torch::Tensor& absmax_codes,
                               const torch::Tensor& absmax_scales,
                               const torch::Tensor& absmax_offset, std::vector<int64_t> shape,
                               int64_t block_size, int64_t absmax_block_size) {
    ctx->save_for_backward({codes, absmax_codes, absmax_scales, absmax_offset});
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["block_size"] = block_size;
    ctx->saved_data["absmax_block_size"] = absmax_block_size;
    Nf4Tensor w{codes,      absmax_codes,     absmax_scales, absmax_offset, std::move(shape),
                block_size, absmax_block_size};
    return at::linear(x, DequantizeNf4(w, x.scalar_type()));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    Nf4Tensor w{saved[0],
                saved[1],
                saved[2],
                saved[3],
                ctx->saved_data["shape"].toIntVector(),
                ctx->saved_data["block_size"].toInt(),
                ctx->saved_data["absmax_block_size"].toInt()};
    const torch::Tensor& grad = grads[0];
    // dL/dx = dL/dy W: [..., out] x [out, in].
    torch::Tensor grad_x = at::matmul(grad, DequantizeNf4(w, grad.scalar_type()));
    return {grad_x,          torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

absl::Status CheckWeight(const torch::Tensor& weight, const char* what) {
  if (!weight.defined() || weight.numel() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is undefined or empty"));
  }
  if (!weight.is_floating_point()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has dtype ", c10::toString(weight.scalar_type()), ", not a floating-point dtype"));
  }
  if (!torch::isfinite(weight).all().item<bool>()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has non-finite values"));
  }
  return absl::OkStatus();
}

}  // namespace

const std::array<float, 16>& Nf4CodeBook() { return kNf4CodeBook; }

const std::array<float, 256>& DynamicMap8Bit() {
  static const std::array<float, 256> map = BuildDynamicMap();
  return map;
}

float Nf4MaxRoundingError() { return MaxRoundingError(kNf4CodeBook.data(), 16); }

float DynamicMap8BitMaxRoundingError() {
  static const float error = MaxRoundingError(DynamicMap8Bit().data(), 256);
  return error;
}

int64_t Nf4Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t Nf4Tensor::num_blocks() const { return CeilDiv(numel(), block_size); }

int64_t Nf4Tensor::MemoryBytes() const {
  int64_t bytes = 0;
  for (const torch::Tensor* t : {&codes, &absmax_codes, &absmax_scales, &absmax_offset}) {
    bytes += t->numel() * static_cast<int64_t>(t->element_size());
  }
  return bytes;
}

torch::Tensor Nf4Indices(const torch::Tensor& normalized) {
  return torch::bucketize(normalized.to(torch::kFloat32),
                          ToTensor(kNf4Thresholds, normalized.device()))
      .to(torch::kUInt8);
}

torch::Tensor PackNibbles(const torch::Tensor& indices) {
  torch::Tensor flat = indices.to(torch::kUInt8).flatten();
  if (flat.numel() % 2 != 0) flat = torch::cat({flat, flat.new_zeros({1})});
  const torch::Tensor pairs = flat.view({-1, 2});
  return torch::bitwise_or(torch::bitwise_left_shift(pairs.select(1, 0), 4), pairs.select(1, 1));
}

torch::Tensor UnpackNibbles(const torch::Tensor& packed, int64_t numel) {
  const torch::Tensor high = torch::bitwise_right_shift(packed, 4);
  const torch::Tensor low = torch::bitwise_and(packed, 0x0F);
  return torch::stack({high, low}, 1).flatten().slice(0, 0, numel);
}

absl::StatusOr<Nf4Tensor> QuantizeNf4(const torch::Tensor& weight, const Nf4Options& options) {
  if (absl::Status status = CheckWeight(weight, "NF4 weight"); !status.ok()) return status;
  if (options.block_size < 1 || options.absmax_block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("NF4 block sizes must be positive, got block_size ", options.block_size,
                     " and absmax_block_size ", options.absmax_block_size));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = weight.detach().to(torch::kFloat32).contiguous().flatten();
  const auto [absmax, normalized] = NormalizeRows(ToBlocks(flat, options.block_size));

  Nf4Tensor result;
  result.shape = weight.sizes().vec();
  result.block_size = options.block_size;
  result.absmax_block_size = options.absmax_block_size;
  result.codes = PackNibbles(Nf4Indices(normalized).flatten().slice(0, 0, flat.numel()));

  // Double quantization (QLoRA section 3): the absmaxes are all positive, so centring them on
  // their mean lets the symmetric signed map use both halves.
  result.absmax_offset = absmax.mean().reshape({1});
  const auto [scales, centered] =
      NormalizeRows(ToBlocks(absmax - result.absmax_offset, options.absmax_block_size));
  result.absmax_scales = scales;
  result.absmax_codes = DynamicMapIndices(centered).flatten().slice(0, 0, absmax.numel());
  return result;
}

torch::Tensor DequantizeAbsmax(const Nf4Tensor& tensor) {
  const torch::Tensor map = ToTensor(DynamicMap8Bit(), tensor.absmax_codes.device());
  const torch::Tensor scales = tensor.absmax_scales.repeat_interleave(tensor.absmax_block_size)
                                   .slice(0, 0, tensor.absmax_codes.numel());
  return map.index({tensor.absmax_codes.to(torch::kLong)}) * scales + tensor.absmax_offset;
}

torch::Tensor DequantizeNf4(const Nf4Tensor& tensor, torch::ScalarType dtype) {
  const int64_t numel = tensor.numel();
  const torch::Tensor code_book = ToTensor(kNf4CodeBook, tensor.codes.device());
  const torch::Tensor values =
      code_book.index({UnpackNibbles(tensor.codes, numel).to(torch::kLong)});
  const torch::Tensor absmax =
      DequantizeAbsmax(tensor).repeat_interleave(tensor.block_size).slice(0, 0, numel);
  return (values * absmax).to(dtype).view(tensor.shape);
}

Nf4LinearImpl::Nf4LinearImpl(Nf4Tensor weight, const torch::Tensor& bias,
                             torch::ScalarType compute_dtype)
    : shape_(std::move(weight.shape)),
      block_size_(weight.block_size),
      absmax_block_size_(weight.absmax_block_size),
      compute_dtype_(compute_dtype) {
  TORCH_CHECK(shape_.size() == 2, "Nf4Linear needs a 2-D weight, got ", shape_.size(), " dims");
  codes_ = register_buffer("weight_codes", std::move(weight.codes));
  absmax_codes_ = register_buffer("weight_absmax_codes", std::move(weight.absmax_codes));
  absmax_scales_ = register_buffer("weight_absmax_scales", std::move(weight.absmax_scales));
  absmax_offset_ = register_buffer("weight_absmax_offset", std::move(weight.absmax_offset));
  if (bias.defined()) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == shape_[0], "Nf4Linear bias must be [", shape_[0],
                "], got ", bias.sizes());
    bias_ = register_buffer("bias", bias.detach().to(torch::kFloat32).clone());
  }
}

Nf4Tensor Nf4LinearImpl::weight() const {
  return {codes_, absmax_codes_, absmax_scales_,    absmax_offset_,
          shape_, block_size_,   absmax_block_size_};
}

torch::Tensor Nf4LinearForward(const torch::Tensor& x, const Nf4Tensor& weight,
                               const torch::Tensor& bias) {
  TORCH_CHECK(weight.shape.size() == 2, "an NF4 linear weight is 2-D, got ", weight.shape.size(),
              " dims");
  torch::Tensor y = Nf4Matmul::apply(x, weight.codes, weight.absmax_codes, weight.absmax_scales,
                                     weight.absmax_offset, weight.shape, weight.block_size,
                                     weight.absmax_block_size);
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

torch::Tensor Nf4LinearImpl::forward(const torch::Tensor& x) {
  return Nf4LinearForward(x.to(compute_dtype_), weight(), bias_);
}

absl::StatusOr<Nf4Linear> MakeNf4Linear(const torch::Tensor& weight, const torch::Tensor& bias,
                                        torch::ScalarType compute_dtype,
                                        const Nf4Options& options) {
  if (absl::Status status = CheckWeight(weight, "Nf4Linear weight"); !status.ok()) return status;
  if (weight.dim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("Nf4Linear weight must be 2-D [out, in], got ", weight.dim(), " dims"));
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return absl::InvalidArgumentError(absl::StrCat("Nf4Linear bias must be [", weight.size(0),
                                                   "], got ", c10::str(bias.sizes())));
  }
  absl::StatusOr<Nf4Tensor> quantized = QuantizeNf4(weight, options);
  if (!quantized.ok()) return quantized.status();
  return Nf4Linear(std::move(*quantized), bias, compute_dtype);
}

}  // namespace tessera::trainer
