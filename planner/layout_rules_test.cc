#include "planner/layout_rules.h"

#include "gtest/gtest.h"

namespace tessera::planner {
namespace {

v1::ModelDims Dims(int heads, int kv_heads, int ffn, int layers) {
  v1::ModelDims dims;
  dims.set_num_attention_heads(heads);
  dims.set_num_kv_heads(kv_heads);
  dims.set_ffn_hidden_size(ffn);
  dims.set_num_layers(layers);
  return dims;
}

TEST(LayoutRulesTest, DegreesThatDivideEveryDimensionPass) {
  const v1::ModelDims dims = Dims(32, 8, 14336, 32);
  for (int tp : {1, 2, 4, 8}) {
    for (int pp : {1, 2, 4, 8, 16, 32}) {
      EXPECT_FALSE(CheckModelDivisibility(dims, tp, pp).has_value()) << tp << " " << pp;
    }
  }
}

TEST(LayoutRulesTest, EachBrokenRuleNamesItsFieldAndDimension) {
  const auto text = [](const v1::ModelDims& dims, int tp, int pp) {
    const auto violation = CheckModelDivisibility(dims, tp, pp);
    return violation ? violation->ToString() : std::string("ok");
  };
  EXPECT_EQ(text(Dims(12, 12, 3072, 12), 8, 1),
            "parallelism.layout.tensor_parallel: 8 does not divide the model's "
            "num_attention_heads 12");
  EXPECT_EQ(text(Dims(32, 8, 14336, 32), 16, 1),
            "parallelism.layout.tensor_parallel: 16 does not divide the model's num_kv_heads 8");
  EXPECT_EQ(text(Dims(32, 8, 11004, 32), 8, 1),
            "parallelism.layout.tensor_parallel: 8 does not divide the model's "
            "ffn_hidden_size 11004");
  EXPECT_EQ(text(Dims(32, 8, 14336, 32), 1, 3),
            "parallelism.layout.pipeline_parallel: 3 does not divide the model's num_layers 32");
  // Tensor parallelism is checked first.
  EXPECT_EQ(CheckModelDivisibility(Dims(12, 12, 3072, 12), 8, 5)->field,
            "parallelism.layout.tensor_parallel");
}

TEST(LayoutRulesTest, MixtureOfExpertsTrainsWithoutTensorOrPipelineSplits) {
  v1::ModelDims dims = Dims(32, 8, 14336, 32);
  dims.set_num_experts(8);
  EXPECT_FALSE(CheckModelDivisibility(dims, 1, 1).has_value());
  const auto tp = CheckModelDivisibility(dims, 2, 1);
  ASSERT_TRUE(tp.has_value());
  EXPECT_EQ(tp->field, "parallelism.layout.tensor_parallel");
  EXPECT_NE(tp->problem.find("mixture-of-experts"), std::string::npos) << tp->problem;
  const auto pp = CheckModelDivisibility(dims, 1, 2);
  ASSERT_TRUE(pp.has_value());
  EXPECT_EQ(pp->field, "parallelism.layout.pipeline_parallel");
}

}  // namespace
}  // namespace tessera::planner
