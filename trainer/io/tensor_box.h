// Boxes of a tensor and their runs: the geometry of checkpoint slices (trainer/io/shard_file.h).
// A box is a block of a tensor, offset[d] <= x[d] < offset[d] + shape[d] in every dimension d;
// a run is a block of a box's elements that is contiguous in the tensor's row-major flattening,
// hence in that of any box holding it (one row along the last dimension, or several rows, up to
// the whole box, when the box spans the tensor's trailing dimensions). Copying and checking run
// by run costs one step per run, never one per element. Plain C++, no state: thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"

namespace tessera::trainer {

// A box of a tensor, of the tensor's rank (both empty for a 0-dim tensor).
struct TensorBox {
  std::vector<int64_t> offset;
  std::vector<int64_t> shape;
};

// Elements of a tensor of `shape` (1 for a 0-dim tensor); nullopt when a dimension is negative
// or the count overflows int64.
std::optional<int64_t> ElementCount(const std::vector<int64_t>& shape);

// "[96, 32]".
std::string ShapeString(const std::vector<int64_t>& shape);

// Why (`box_offset`, `box_shape`) is not a box of a tensor of `global_shape` (a valid shape), or
// "" when it is. Both empty stands for the whole tensor and is valid.
std::string BoxProblem(const std::vector<int64_t>& global_shape,
                       const std::vector<int64_t>& box_offset,
                       const std::vector<int64_t>& box_shape);

// The box (`box_offset`, `box_shape`), or the whole tensor when both are empty. BoxProblem must
// have accepted them.
TensorBox MakeBox(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& box_offset,
                  const std::vector<int64_t>& box_shape);

// Index of the element at `coordinates` (inside `frame`) in the row-major flattening of `frame`.
int64_t FlatIndexIn(const TensorBox& frame, const std::vector<int64_t>& coordinates);

// Coordinates of the element at row-major flat index `index` of a tensor of `shape`.
std::vector<int64_t> CoordinatesOf(const std::vector<int64_t>& shape, int64_t index);

// `a` ∩ `b` (boxes of one tensor); nullopt when it holds no element.
std::optional<TensorBox> Intersect(const TensorBox& a, const TensorBox& b);

// The rows (first-dimension slabs) of `box` that hold elements [begin, end) of its row-major
// flattening, as a box; `box` itself for a 0-dim tensor. Needs begin < end <= elements of `box`.
TensorBox RowsHolding(const TensorBox& box, int64_t begin, int64_t end);

// Calls `visit(first, length)` for each run of `box` (a box of a tensor of `global_shape`), in
// row-major order: `first` holds the coordinates of the run's first element, the run is the
// `length` elements from there in the tensor's flattening. Stops early when `visit` returns
// false. Nothing for a box without elements.
void ForEachRun(const std::vector<int64_t>& global_shape, const TensorBox& box,
                absl::FunctionRef<bool(const std::vector<int64_t>& first, int64_t length)> visit);

// Calls `visit(global_index, box_index, length)` for each run of elements [begin, end) of the
// row-major flattening of `box`, in order: elements [box_index, box_index + length) of the box's
// flattening are elements [global_index, global_index + length) of the tensor's. Costs one step
// per row of `box` the range touches (one in all when the box spans the trailing dimensions).
void ForEachRangeRun(
    const std::vector<int64_t>& global_shape, const TensorBox& box, int64_t begin, int64_t end,
    absl::FunctionRef<void(int64_t global_index, int64_t box_index, int64_t length)> visit);

}  // namespace tessera::trainer
