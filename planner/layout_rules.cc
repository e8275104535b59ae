#include "planner/layout_rules.h"

#include "absl/strings/str_cat.h"

namespace tessera::planner {

std::optional<LayoutRuleViolation> CheckModelDivisibility(const v1::ModelDims& dims,
                                                          int tensor_parallel,
                                                          int pipeline_parallel) {
  constexpr char kTensorParallel[] = "parallelism.layout.tensor_parallel";
  const int tp = tensor_parallel;
  if (dims.num_experts() > 0 && tp > 1) {
    return LayoutRuleViolation{kTensorParallel,
                               absl::StrCat(tp, " with a mixture-of-experts model (num_experts ",
                                            dims.num_experts(), "): not supported yet, use 1")};
  }
  if (dims.num_experts() > 0 && pipeline_parallel > 1) {
    return LayoutRuleViolation{
        "parallelism.layout.pipeline_parallel",
        absl::StrCat(pipeline_parallel, " with a mixture-of-experts model (num_experts ",
                     dims.num_experts(), "): not supported yet, use 1")};
  }
  const struct {
    const char* name;
    int64_t value;
  } split_by_tp[] = {{"num_attention_heads", dims.num_attention_heads()},
                     {"num_kv_heads", dims.num_kv_heads()},
                     {"ffn_hidden_size", dims.ffn_hidden_size()}};
  for (const auto& dim : split_by_tp) {
    if (dim.value % tp != 0) {
      return LayoutRuleViolation{
          kTensorParallel, absl::StrCat(tp, " does not divide the model's ", dim.name, " ",
                                        dim.value)};
    }
  }
  if (dims.num_layers() % pipeline_parallel != 0) {
    return LayoutRuleViolation{"parallelism.layout.pipeline_parallel",
                               absl::StrCat(pipeline_parallel, " does not divide the model's ",
                                            "num_layers ", dims.num_layers())};
  }
  return std::nullopt;
}

}  // namespace tessera::planner
