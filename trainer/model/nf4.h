// 4-bit NormalFloat (NF4) weights with double quantization, the storage format of QLoRA's frozen
// base (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", section 3), laid
// out as bitsandbytes lays it out (`quantize_4bit(quant_type="nf4", compress_statistics=True)`):
//   * the weight, flattened in row-major order, is cut into blocks of 64 values; each block keeps
//     its absolute maximum (absmax) and each value the index of the nearest NF4 code of
//     value / absmax; two 4-bit indices share a byte, the even (first) element in the high nibble;
//   * double quantization: the float32 absmaxes, minus their mean, are cut into blocks of 256 and
//     quantized to 8 bits against bitsandbytes' signed dynamic map (Dettmers 2016's dynamic tree
//     quantization, the "8-bit float" of the paper) with one float32 scale per block; the mean is
//     kept as a float32 offset;
//   * a value is rebuilt as nf4[code] * (map8[absmax_code] * scale + offset), in float32.
// NF4Linear is a frozen linear layer over such a weight, dequantized on the fly in forward and
// again in backward (nothing but the 4-bit state is held between them), with the gradient
// flowing to the input only, so LoRA adapters above it train. The functions run on any device
// with composite ATen ops (a fused dequant-matmul kernel is separate work). Thread-compatible:
// Nf4Tensor is a value; concurrent reads are safe.
#pragma once

#include <torch/nn.h>

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera::trainer {

// Values per first-level block (one absmax each); QLoRA's and bitsandbytes' default.
inline constexpr int64_t kNf4BlockSize = 64;
// Absmaxes per second-level block (one float32 scale each): QLoRA's and bitsandbytes' 256.
inline constexpr int64_t kNf4AbsmaxBlockSize = 256;

// The 16 NF4 values in ascending order; index i is the 4-bit code i.
const std::array<float, 16>& Nf4CodeBook();

// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`): 256 ascending
// values in [-0.99297, 1], index i is the 8-bit code i.
const std::array<float, 256>& DynamicMap8Bit();

// The largest distance from a point of [-1, 1] to the nearest value of each map: the worst
// rounding error, in units of the block scale. NF4: half its widest gap, -1..-0.6961928
// (0.1519036); the 8-bit map: half the top decade's gap, 0.9 / 128, which is also the distance
// from -1 to its smallest value.
float Nf4MaxRoundingError();
float DynamicMap8BitMaxRoundingError();

// A weight in NF4 with double quantization. Tensors live on one device.
struct Nf4Tensor {
  // uint8 [ceil(numel / 2)]: element 2i in the high nibble of byte i, element 2i+1 in its low
  // nibble (0 past the last element).
  torch::Tensor codes;
  // uint8 [num_blocks()]: each first-level block's absmax as an index into DynamicMap8Bit().
  torch::Tensor absmax_codes;
  // float32 [ceil(num_blocks() / absmax_block_size)]: each second-level block's scale, the
  // absolute maximum of its absmaxes minus `absmax_offset`.
  torch::Tensor absmax_scales;
  // float32 [1]: the mean of all the first-level absmaxes.
  torch::Tensor absmax_offset;
  std::vector<int64_t> shape;
  int64_t block_size = kNf4BlockSize;
  int64_t absmax_block_size = kNf4AbsmaxBlockSize;

  int64_t numel() const;
  int64_t num_blocks() const;
  // Bytes of the four tensors: 0.5 per value, 1/block_size per value for the 8-bit absmaxes,
  // 4 per second-level block and 4 for the offset (QLoRA's 4 + 8/64 + 32/(64*256) bits).
  int64_t MemoryBytes() const;
};

struct Nf4Options {
  int64_t block_size = kNf4BlockSize;
  int64_t absmax_block_size = kNf4AbsmaxBlockSize;
};

// The NF4 index of each element of `normalized` (float32, values in [-1, 1]): the nearest code,
// as bitsandbytes' decision tree (dQuantizeNF4) picks it, with its thresholds: above the
// threshold between two neighbouring codes goes up, at or below it goes down. Each threshold is
// the midpoint written as a float literal; at 4 of the 15 that literal is one float32 step off
// the midpoint of the float32 codes, and a value in that step goes where bitsandbytes sends it.
// uint8, same shape.
torch::Tensor Nf4Indices(const torch::Tensor& normalized);

// Two 4-bit indices per byte (uint8 in, values < 16, any shape, flattened): element 2i in the
// high nibble. Unpack returns the first `numel` indices.
torch::Tensor PackNibbles(const torch::Tensor& indices);
torch::Tensor UnpackNibbles(const torch::Tensor& packed, int64_t numel);

// Quantizes `weight` (floating point, any shape, finite) to NF4 with double quantization on
// weight's device. A block whose values are all zero keeps code 7 (0.0) for each, so it
// dequantizes to exact zeros whatever its rebuilt absmax. INVALID_ARGUMENT for an undefined,
// empty, non-floating or non-finite weight, or block sizes < 1.
absl::StatusOr<Nf4Tensor> QuantizeNf4(const torch::Tensor& weight, const Nf4Options& options = {});

// The first-level absmaxes rebuilt from their 8-bit codes: float32 [num_blocks].
torch::Tensor DequantizeAbsmax(const Nf4Tensor& tensor);

// The weight rebuilt in `dtype` (computed in float32, then cast), shaped like the original.
torch::Tensor DequantizeNf4(const Nf4Tensor& tensor, torch::ScalarType dtype = torch::kFloat32);

// y = x W^T + b for an NF4 weight W [out, in], computed in x's dtype (W dequantized to it, the
// bias, if defined, cast to it). The gradient flows to x only, through W dequantized again in
// backward: between forward and backward nothing but the 4-bit state is held.
torch::Tensor Nf4LinearForward(const torch::Tensor& x, const Nf4Tensor& weight,
                               const torch::Tensor& bias);

// A frozen linear layer y = x W^T + b whose W [out, in] is stored in NF4 and the optional bias
// [out] in float32. The state is registered as buffers ("weight_codes", "weight_absmax_codes",
// "weight_absmax_scales", "weight_absmax_offset", "bias"), so module state dicts and device moves
// carry it; the module has no parameters. forward casts x to the compute dtype, dequantizes W to
// it and multiplies; backward dequantizes W again for the input's gradient and computes none for
// W or the bias.
class Nf4LinearImpl : public torch::nn::Module {
 public:
  // `bias`: undefined for none, else [weight.shape[0]] (cast to float32).
  Nf4LinearImpl(Nf4Tensor weight, const torch::Tensor& bias,
                torch::ScalarType compute_dtype = torch::kFloat32);
  torch::Tensor forward(const torch::Tensor& x);

  // The NF4 weight over the module's current buffers (after a device move, the moved ones).
  Nf4Tensor weight() const;
  const torch::Tensor& bias() const { return bias_; }
  torch::ScalarType compute_dtype() const { return compute_dtype_; }
  int64_t in_features() const { return shape_[1]; }
  int64_t out_features() const { return shape_[0]; }

 private:
  torch::Tensor codes_, absmax_codes_, absmax_scales_, absmax_offset_, bias_;
  std::vector<int64_t> shape_;
  int64_t block_size_, absmax_block_size_;
  torch::ScalarType compute_dtype_;
};
TORCH_MODULE(Nf4Linear);

// Quantizes a dense linear layer's weight [out, in] (and keeps its bias) into an Nf4Linear.
// INVALID_ARGUMENT as QuantizeNf4, or for a weight that is not 2-D or a bias not [out].
absl::StatusOr<Nf4Linear> MakeNf4Linear(const torch::Tensor& weight, const torch::Tensor& bias,
                                        torch::ScalarType compute_dtype = torch::kFloat32,
                                        const Nf4Options& options = {});

}  // namespace tessera::trainer
