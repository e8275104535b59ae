#include "trainer/io/tensor_box.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera::trainer {

std::optional<int64_t> ElementCount(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && count > std::numeric_limits<int64_t>::max() / dim) return std::nullopt;
    count *= dim;
  }
  return count;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string BoxProblem(const std::vector<int64_t>& global_shape,
                       const std::vector<int64_t>& box_offset,
                       const std::vector<int64_t>& box_shape) {
  if (box_offset.empty() && box_shape.empty()) return "";
  const std::string box =
      absl::StrCat("box offset ", ShapeString(box_offset), " shape ", ShapeString(box_shape));
  if (box_offset.size() != global_shape.size() || box_shape.size() != global_shape.size()) {
    return absl::StrCat(box, " does not have the rank of its global shape ",
                        ShapeString(global_shape));
  }
  for (size_t d = 0; d < global_shape.size(); ++d) {
    if (box_offset[d] < 0 || box_shape[d] < 0 || box_offset[d] > global_shape[d] ||
        box_shape[d] > global_shape[d] - box_offset[d]) {
      return absl::StrCat(box, " is out of the bounds of its global shape ",
                          ShapeString(global_shape), " in dimension ", d);
    }
  }
  return "";
}

TensorBox MakeBox(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& box_offset,
                  const std::vector<int64_t>& box_shape) {
  if (box_offset.empty() && box_shape.empty()) {
    return {std::vector<int64_t>(global_shape.size(), 0), global_shape};
  }
  return {box_offset, box_shape};
}

int64_t FlatIndexIn(const TensorBox& frame, const std::vector<int64_t>& coordinates) {
  int64_t index = 0;
  for (size_t d = 0; d < frame.shape.size(); ++d) {
    index = index * frame.shape[d] + (coordinates[d] - frame.offset[d]);
  }
  return index;
}

std::vector<int64_t> CoordinatesOf(const std::vector<int64_t>& shape, int64_t index) {
  std::vector<int64_t> coordinates(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) return coordinates;
    coordinates[d] = index % shape[d];
    index /= shape[d];
  }
  return coordinates;
}

std::optional<TensorBox> Intersect(const TensorBox& a, const TensorBox& b) {
  TensorBox common;
  for (size_t d = 0; d < a.shape.size(); ++d) {
    const int64_t begin = std::max(a.offset[d], b.offset[d]);
    const int64_t end = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    if (end <= begin) return std::nullopt;
    common.offset.push_back(begin);
    common.shape.push_back(end - begin);
  }
  return common;
}

TensorBox RowsHolding(const TensorBox& box, int64_t begin, int64_t end) {
  if (box.shape.empty()) return box;
  int64_t row = 1;
  for (size_t d = 1; d < box.shape.size(); ++d) row *= box.shape[d];
  TensorBox rows = box;
  const int64_t first = begin / row;
  rows.offset[0] += first;
  rows.shape[0] = (end - 1) / row + 1 - first;
  return rows;
}

void ForEachRun(const std::vector<int64_t>& global_shape, const TensorBox& box,
                absl::FunctionRef<bool(const std::vector<int64_t>& first, int64_t length)> visit) {
  for (int64_t dim : box.shape) {
    if (dim == 0) return;
  }
  // Dimensions [inner, rank) make one run: the box spans every one of them after `inner`.
  size_t inner = box.shape.size();
  int64_t length = 1;
  while (inner > 0) {
    --inner;
    length *= box.shape[inner];
    if (box.shape[inner] != global_shape[inner]) break;
  }
  // An odometer over dimensions [0, inner).
  std::vector<int64_t> first = box.offset;
  while (true) {
    if (!visit(first, length)) return;
    size_t d = inner;
    while (true) {
      if (d == 0) return;
      --d;
      if (++first[d] < box.offset[d] + box.shape[d]) break;
      first[d] = box.offset[d];
    }
  }
}

void ForEachRangeRun(
    const std::vector<int64_t>& global_shape, const TensorBox& box, int64_t begin, int64_t end,
    absl::FunctionRef<void(int64_t global_index, int64_t box_index, int64_t length)> visit) {
  if (begin >= end) return;
  const TensorBox whole{std::vector<int64_t>(global_shape.size(), 0), global_shape};
  ForEachRun(global_shape, RowsHolding(box, begin, end),
             [&](const std::vector<int64_t>& first, int64_t length) {
               const int64_t box_index = FlatIndexIn(box, first);
               const int64_t from = std::max(begin, box_index);
               const int64_t to = std::min(end, box_index + length);
               if (from < to) {
                 visit(FlatIndexIn(whole, first) + (from - box_index), from, to - from);
               }
               return box_index + length < end;
             });
}

}  // namespace tessera::trainer
